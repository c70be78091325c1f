"""Guess the number: a text game with gymnasium's reset/step API, for ``rollout.agent_loop=env``.

The game thinks of a number in [low, high]; the model guesses, the game answers "higher" or
"lower"; reward 1 for finding it (on the turn it is found), 0 otherwise. It imports nothing
from treadle: any object with these two methods is an environment.
"""

from __future__ import annotations

import random
import re
from typing import Any


class GuessTheNumber:
    def __init__(self, low: int = 1, high: int = 10) -> None:
        self.low, self.high, self.target = low, high, low

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None):
        self.target = random.Random(seed).randint(self.low, self.high)
        return (
            f"I am thinking of a whole number from {self.low} to {self.high}. Guess it: answer "
            "with one number. I will tell you whether it is higher or lower."
        ), {}

    def step(self, action: str):
        found = re.search(r"-?\d+", action)
        if found is None:
            return "Answer with one number.", 0.0, False, False, {}
        guess = int(found.group())
        if guess == self.target:
            return "Correct!", 1.0, True, False, {}
        return ("Higher." if guess < self.target else "Lower."), 0.0, False, False, {}


def make_env(row: dict[str, Any]) -> GuessTheNumber:
    """The game a data row describes (its ``low`` and ``high`` columns)."""
    return GuessTheNumber(int(row.get("low", 1)), int(row.get("high", 10)))
