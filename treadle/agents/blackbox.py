"""Black-box agents: code written against the OpenAI API, trained on unchanged.

``rollout.agent_loop=openai:path/to/agent.py:fn`` (or ``openai:module:fn``) runs, for every
sample, ::

    async def fn(client: openai.AsyncOpenAI, row: dict) -> float | dict | None

``client`` talks to the run's OpenAI-compatible endpoint (:mod:`treadle.serving.endpoint`) under
a session of the trajectory's own; ``row`` is the data row, every column of it. The agent calls
the model as it likes (chat or completions, tools, several conversations); it imports nothing
of treadle. What it returns:

- a number: the trajectory's reward;
- a dict: its ``reward`` (a number, or None) and other numbers, reported as
  ``agent/<key>_mean``;
- None: ``reward.function`` scores the last completion's text.

When the agent returns, the session's recorded calls become the training samples
(:func:`treadle.agents.sessions.merge_calls`): the tokens trained on are the tokens the engine
sampled, never re-tokenized text. An agent that raises, returns something else, makes no call
or runs past ``rollout.agent_timeout_s`` fails its run (:func:`~treadle.agents.loops.run_agents`
drops it and counts it in ``agent/errors``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

from treadle.agents.sessions import merge_calls
from treadle.runtime.errors import ConfigError
from treadle.runtime.plugins import load_callable, require_call

AgentFn = Callable[[Any, dict[str, Any]], Awaitable[Any]]


class OpenAIAgent:
    """The agent loop that runs one black-box agent function (see the module docstring)."""

    def __init__(self, fn: AgentFn, spec: str) -> None:
        self.fn = fn
        self.__qualname__ = spec  # how run_agents names it in errors

    async def __call__(self, client: Any, sample: Any, tools: Any) -> Any:
        """One run: ``client`` an :class:`~treadle.agents.loops.AgentClient`, ``sample`` a
        :class:`~treadle.agents.loops.Sample`; the trajectories of the agent's session."""
        endpoint = client.endpoint
        if endpoint is None:
            raise RuntimeError("the run has no OpenAI-compatible endpoint for the agent")
        import openai

        session = client.new_session()
        url = endpoint.open_session(session, client.params)
        try:
            async with openai.AsyncOpenAI(
                base_url=url, api_key=endpoint.api_key, max_retries=0
            ) as oai:
                result = await self.fn(oai, dict(sample.row))
        finally:
            calls = endpoint.close_session(session)
        reward, info = agent_result(result)
        if not calls:
            raise ValueError("it made no model call through its client")
        trajectories = merge_calls(calls, client.limits.max_response_length)
        last = max(calls, key=lambda c: c.index)
        text = client.decode(last.completion_ids)
        for t in trajectories:
            t.reward, t.response_text = reward, text
            t.info.update(info)
        return trajectories


def agent_result(value: Any) -> tuple[float | None, dict[str, float]]:
    """An agent's return value as (reward or None, numbers to report); anything else raises."""
    if value is None:
        return None, {}
    if isinstance(value, dict):
        info = {k: v for k, v in value.items() if k != "reward"}
        bad = [k for k, v in info.items() if not _is_number(v)]
        if bad:
            raise TypeError(f"it returned a dict whose {bad[0]!r} is not a number")
        reward = value.get("reward")
        if reward is not None and not _is_number(reward):
            raise TypeError(f"it returned reward {reward!r}, not a finite number")
        return (None if reward is None else float(reward)), {k: float(v) for k, v in info.items()}
    if _is_number(value):
        return float(value), {}
    raise TypeError(
        f"it returned {_shown(value)}: an agent returns its reward (a number), a dict with "
        "'reward', or None"
    )


def _is_number(value: Any) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and math.isfinite(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_openai_agent(spec: str) -> OpenAIAgent:
    """``openai:<module:fn | path/to/file.py:fn>``; the function must be async."""
    target = spec.removeprefix("openai:")
    fn = load_callable(target, "rollout.agent_loop")
    if not asyncio.iscoroutinefunction(fn):
        raise ConfigError(
            f"rollout.agent_loop: {target!r} must be an async function "
            "(async def agent(client: openai.AsyncOpenAI, row: dict) -> float | dict | None)"
        )
    require_call(fn, target, "rollout.agent_loop", ("client", "row"), "await agent(client, row)")
    return OpenAIAgent(fn, target)
