"""A trajectory: the tokens of one whole conversation, and which of them the model sampled.

Token-in, token-out: a trajectory is built from the token ids the engine returned and the
token ids the loop appended (tool results, environment messages), never from re-tokenized
text, so the tokens trained on are the tokens sampled. ``loss_mask`` is 1 on the model's tokens
and 0 on the prompt, tool and environment tokens; every token is attended to whatever its mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from treadle.serving.server import Response

STOP_REASONS = ("stop", "length", "max_turns")
"""``stop``: the model gave its final answer; ``length``: a turn, or the trajectory's token
budget, ran out; ``max_turns``: the last allowed turn still called a tool."""


@dataclass
class Trajectory:
    """One conversation, built with :meth:`add_response` and :meth:`add_tokens`.

    ``response_text`` is what the reward function reads as the response (the loop sets it,
    e.g. to the final answer; unset: the decoded model tokens). ``reward``: the trajectory's
    reward when the loop knows it (a black-box agent's return value, an environment's reward);
    None: ``reward.function`` scores it. ``info`` holds whatever else the loop wants to report
    (numbers in it become ``agent/<key>_mean`` metrics).
    """

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # after the prompt
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    stop_reason: str = "stop"
    weight_versions: list[int] = field(default_factory=list)  # one per turn: its oldest token's
    token_versions: list[int] = field(default_factory=list)  # per token; -1 if not sampled
    response_text: str | None = None
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def all_token_ids(self) -> list[int]:
        """The whole conversation: prompt, then everything after it."""
        return [*self.prompt_ids, *self.token_ids]

    def add_response(self, response: Response) -> None:
        """The model's turn: its sampled tokens, trained on."""
        self.token_ids += response.token_ids
        self.loss_mask += [1] * len(response.token_ids)
        self.log_probs += response.log_probs
        self.weight_versions.append(response.weight_version)
        self.token_versions += response.versions()
        self.turns += 1
        self.stop_reason = response.stop_reason

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """Tokens the model did not sample (tool results, the next turn's header): not trained."""
        self.token_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.log_probs += [0.0] * len(token_ids)
        self.token_versions += [-1] * len(token_ids)

    @property
    def model_token_ids(self) -> list[int]:
        return [t for t, m in zip(self.token_ids, self.loss_mask, strict=True) if m]

    def check(self) -> None:
        """A loop's trajectory is consistent (a custom loop's mistakes named here, not later)."""
        n = len(self.token_ids)
        if not len(self.loss_mask) == len(self.log_probs) == len(self.token_versions) == n:
            raise ValueError(
                f"trajectory: {n} token ids, {len(self.loss_mask)} loss-mask entries, "
                f"{len(self.log_probs)} log-probs and {len(self.token_versions)} token versions; "
                "they must match (build it with add_response and add_tokens)"
            )
        if not self.turns or not any(self.loss_mask):
            raise ValueError("trajectory: no model turn (call add_response at least once)")
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(
                f"trajectory: stop_reason {self.stop_reason!r} is not one of {STOP_REASONS}"
            )
