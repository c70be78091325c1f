"""TextArena's games as black-box agents: ``rollout.agent_loop: openai:treadle.agents.arena:play``.

`TextArena <https://github.com/LeonGuertler/TextArena>`_ (``pip install 'treadle[textarena]'``)
holds about a hundred text games (Sudoku, Wordle-like, Minesweeper, TowerOfHanoi, Guess the
Number, ...), each with its own rules, judge and reward. :func:`play` runs one episode of the
single-player game a data row names, unchanged: TextArena makes the game, deals it from the
row's seed and scores it; the player's moves are the model's chat completions, asked through
the ``openai`` client the black-box loop (:mod:`treadle.agents.blackbox`) points at the run's
endpoint, so every call is recorded and trained on token for token. The game's reward for the
player is the trajectory's reward.

A row's columns (others are ignored):

- ``env_id`` (default ``GuessTheNumber-v0-raw``): a TextArena id, ``textarena.make`` takes it;
- ``seed`` (optional): the deal; without it one is derived from the row, so the
  ``rollout.n`` samples of a prompt play the same deal (GRPO compares them);
- ``max_turns`` (default 64): moves at most, beyond the game's own limit (then reward 0).

What the model sees. TextArena's agents send the player's whole view each turn as one user
message after a system prompt (its ``STANDARD_GAME_PROMPT``); :func:`play` does the same for
the ids whose wrappers render that view as text (``GuessTheNumber-v0``, ``...-train``). For the
``-raw`` ids the game hands over its new messages instead, and :func:`play` keeps one growing
chat (each move an assistant message, the game's answer the next user message), so the calls
of an episode extend each other and merge into one training sample (where the chat template
renders a reply back to the tokens sampled); with a rendered view each
move is a sample of its own (``agent/prefix_breaks``), all with the episode's reward.

Returned per episode: ``reward``, ``moves`` (moves made), ``invalid_move`` (1 when the game
ended on a move it rejected), ``finished`` (1 when the game ended within ``max_turns``).
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

try:
    import textarena as ta
    from textarena.agents.basic_agents import STANDARD_GAME_PROMPT
except ImportError as e:  # `treadle check` names it before a run starts
    raise ImportError(
        f"treadle.agents.arena plays TextArena's games: pip install 'treadle[textarena]' ({e})"
    ) from e

MODEL = "policy"  # the endpoint serves the run's model whatever the name
DEFAULT_ENV = "GuessTheNumber-v0-raw"
MAX_TURNS = 64
GAME_ID = -1  # textarena.GAME_ID: the game's own messages
PLAYER = 0


async def play(client: Any, row: dict[str, Any]) -> dict[str, float]:
    """One episode of the TextArena game ``row`` names, the model playing through ``client``
    (an ``openai.AsyncOpenAI``); its reward and counts (see the module docstring)."""
    env = ta.make(str(row.get("env_id", DEFAULT_ENV)))
    saved = random.getstate()  # TextArena seeds the global generator: leave ours as it was
    try:
        env.reset(num_players=1, seed=_seed(row))
    finally:
        random.setstate(saved)
    system = {"role": "system", "content": STANDARD_GAME_PROMPT}
    messages: list[dict[str, str]] = [system]
    done, moves = False, 0
    while not done and moves < int(row.get("max_turns", MAX_TURNS)):
        player, observation = env.get_observation()
        if player != PLAYER:
            raise ValueError(f"{env.env_id}: player {player} to move; only one-player games run")
        if isinstance(observation, str):  # a wrapper rendered the whole view: ask afresh
            messages = [system, {"role": "user", "content": observation}]
        else:  # the game's new messages: the next user turn of one chat
            messages.append({"role": "user", "content": _news(observation)})
        reply = await client.chat.completions.create(model=MODEL, messages=messages)
        action = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": action})
        done, _ = env.step(action=action)
        moves += 1
    rewards, game_info = env.close()
    reward = float(rewards[PLAYER]) if done and rewards else 0.0
    invalid = float(bool(game_info[PLAYER].get("invalid_move")))
    return {"reward": reward, "moves": moves, "invalid_move": invalid, "finished": float(done)}


def _seed(row: dict[str, Any]) -> int:
    seed = row.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    text = json.dumps(row, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def _news(messages: list[tuple[int, str, Any]]) -> str:
    """The game's messages since the player's last move, as text (its own move left out: the
    chat holds it already)."""
    lines = [
        text if sender == GAME_ID else f"[Player {sender}] {text}"
        for sender, text, _ in messages
        if sender != PLAYER
    ]
    return "\n".join(lines)
