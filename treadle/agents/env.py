"""The ``env`` agent loop: an environment with gymnasium's ``reset`` / ``step`` API, in text.

``rollout.agent_loop: env`` with ``rollout.env: 'module:make_env'`` (or
``'path/to/file.py:make_env'``) plays one episode per trajectory. ``make_env(row)`` gets the
data row (every column of the file) and returns the environment, any object with

- ``reset(seed=None, options=None) -> (observation, info)`` (a bare observation is accepted),
- ``step(action) -> (observation, reward, terminated, truncated, info)`` (gym's older
  ``(observation, reward, done, info)`` too),

whose observations are text and whose actions are the model's text. Either method may be a
coroutine function (a slow environment should be, so that the other episodes run meanwhile).
``close()`` is called when the episode ends, if the environment has it.

The choices made:

- **The environment speaks first.** Its first observation is the first user message, and the
  trajectory's prompt is the chat template of that message (the row's prompt column is not
  shown: the row parametrises the environment through ``make_env``). A task's instructions
  belong in that observation.
- **Every model turn is an action**: its sampled tokens decoded, a turn cut by its length
  included (it was sampled). Every next observation is appended as a user message (tokens,
  loss mask 0), cut to ``rollout.max_tool_response_tokens`` tokens.
- **The episode ends** when the environment says so (terminated or truncated: stop reason
  ``stop``), after ``rollout.max_turns`` actions (``max_turns``), or when the next
  observation would not leave the model room to answer within the trajectory's budget
  (``rollout.max_response_length``: ``length``).
- **The reward is the sum of the rewards ``step`` returned**, set on the trajectory
  (:attr:`~treadle.agents.trajectory.Trajectory.reward`), so ``reward.function`` is not called.
- ``reset`` gets ``seed=`` when it takes one: the row's ``seed`` column if it holds an integer,
  else a number derived from the sample's id, so that a prompt's ``rollout.n`` samples play the
  same episode (a GRPO group compares answers to one task) and different rows differ.

``info`` gets ``env_steps`` (actions taken) and ``env_done`` (1 when the environment ended the
episode): the metrics ``agent/env_steps_mean`` and ``agent/env_done_mean``.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable
from typing import Any

from treadle.agents.loops import AgentClient, AgentLoop, Sample
from treadle.agents.tools import Toolbox
from treadle.agents.trajectory import Trajectory
from treadle.data.templating import render
from treadle.runtime.errors import ConfigError
from treadle.runtime.plugins import load_callable, require_call

EnvFactory = Callable[[dict[str, Any]], Any]


def load_env_loop(spec: str | None) -> AgentLoop:
    """The loop of ``rollout.agent_loop=env`` over the factory ``rollout.env`` names."""
    if not spec:
        raise ConfigError(
            "rollout.agent_loop=env needs rollout.env: the environment factory as "
            "'module:make_env' or 'path/to/file.py:make_env' (called with the data row)"
        )
    make_env = load_callable(spec, "rollout.env")
    require_call(make_env, spec, "rollout.env", ("row",), "make_env(row)")
    return env_loop(make_env, spec)


def env_loop(make_env: EnvFactory, name: str = "env") -> AgentLoop:
    """An agent loop playing one episode of ``make_env(sample.row)`` per trajectory."""

    async def loop(client: AgentClient, sample: Sample, tools: Toolbox) -> Trajectory:
        env = make_env(dict(sample.row))
        try:
            return await play(client, sample, env)
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                await _maybe_await(close())

    loop.__qualname__ = loop.__name__ = f"env {name}"
    return loop


async def play(client: AgentClient, sample: Sample, env: Any) -> Trajectory:
    """One episode of ``env``, the model acting; see the module docstring."""
    first = await _maybe_await(env.reset(**_reset_kwargs(env.reset, sample)))
    first = first[0] if isinstance(first, tuple) and len(first) == 2 else first  # (obs, info)
    t = Trajectory(_prompt_ids(client, _text(first, "reset")))
    total, steps, done = 0.0, 0, False
    while True:
        budget = min(client.params.max_new_tokens, client.remaining(t))
        response = await client.generate(t.all_token_ids, budget)
        t.add_response(response)
        action = t.response_text = client.decode(response.token_ids)
        observation, reward, done = _step(await _maybe_await(env.step(action)))
        total, steps = total + reward, steps + 1
        if done:
            t.stop_reason = "stop"
            break
        if t.turns >= client.limits.max_turns:
            t.stop_reason = "max_turns"
            break
        message = {"role": "user", "content": _cut(client, observation)}
        ids = client.encode_messages([message], after=response.token_ids)
        if len(ids) >= client.remaining(t):  # no room left for the model to read and answer
            t.stop_reason = "length"
            break
        t.add_tokens(ids)
    t.reward = total
    t.info.update(env_steps=steps, env_done=float(done))
    return t


# ----------------------------------------------------------------------------- the gym API


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _reset_kwargs(reset: Callable[..., Any], sample: Sample) -> dict[str, Any]:
    try:
        takes_seed = "seed" in inspect.signature(reset).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        takes_seed = False
    if not takes_seed:
        return {}
    seed = sample.row.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        seed = zlib.crc32(sample.uid.encode())
    return {"seed": seed}


def _text(obs: Any, where: str) -> str:
    if not isinstance(obs, str):
        raise TypeError(
            f"the environment's {where}() gave a {type(obs).__name__} observation; the env "
            "loop needs text (wrap the environment so that its observations are strings)"
        )
    return obs


def _step(value: Any) -> tuple[str, float, bool]:
    """(observation, reward, done) of what ``step`` returned (gymnasium's 5-tuple or gym's 4)."""
    if not isinstance(value, tuple) or len(value) not in (4, 5):
        raise TypeError(
            f"the environment's step() returned {type(value).__name__} {value!r:.80}; expected "
            "(observation, reward, terminated, truncated, info)"
        )
    obs, reward = _text(value[0], "step"), value[1]
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        try:
            reward = float(reward)  # numpy scalars
        except (TypeError, ValueError):
            raise TypeError(
                f"the environment's step() gave the reward {reward!r}; expected a number"
            ) from None
    done = bool(value[2]) or (len(value) == 5 and bool(value[3]))
    return obs, float(reward), done


# ----------------------------------------------------------------------------- tokens


def _prompt_ids(client: AgentClient, observation: str) -> list[int]:
    """The first observation as the conversation's first user message, then the model's
    header (the tokenizer's chat template)."""
    tok = client.tokenizer
    text = render(tok, [{"role": "user", "content": observation}], generation=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _cut(client: AgentClient, text: str) -> str:
    """An observation cut to ``max_tool_response_tokens`` tokens."""
    limit = client.limits.max_tool_response_tokens
    ids = client.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= limit:
        return text
    return client.decode(ids[:limit]) + " ...(cut)"
