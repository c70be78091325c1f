"""``rollout.agent_loop``: the name of a built-in loop, a loop of your own, or a black-box agent.

- ``single_turn``, ``tools``: :mod:`treadle.agents.loops`;
- ``env``: episodes of a gym-style text environment, ``rollout.env`` (:mod:`treadle.agents.env`);
- ``module:function`` or ``path/to/file.py:function``: an async agent loop of your own,
  ``async def loop(client: AgentClient, sample: Sample, tools: Toolbox) -> Trajectory``;
- ``openai:module:function`` or ``openai:path/to/file.py:function``: a black-box agent that
  talks to the model through the OpenAI API (:mod:`treadle.agents.blackbox`).
"""

from __future__ import annotations

import asyncio

from treadle.agents.blackbox import PREFIX, load_openai_agent
from treadle.agents.env import load_env_loop
from treadle.agents.loops import AgentLoop, single_turn, tool_loop
from treadle.errors import ConfigError
from treadle.plugins import load_callable

BUILTIN_LOOPS: dict[str, AgentLoop] = {"single_turn": single_turn, "tools": tool_loop}


def load_agent_loop(spec: str, env: str | None = None) -> AgentLoop:
    """``rollout.agent_loop``: a built-in name, a loop by path or a black-box agent; async.
    ``env``: ``rollout.env``, the environment factory of the ``env`` loop."""
    if spec in BUILTIN_LOOPS:
        return BUILTIN_LOOPS[spec]
    if spec == "env":
        return load_env_loop(env)
    if needs_endpoint(spec):
        return load_openai_agent(spec)
    if ":" not in spec:
        raise ConfigError(
            f"rollout.agent_loop: unknown loop {spec!r}; built-in loops are "
            f"{', '.join([*BUILTIN_LOOPS, 'env'])}, or give 'module:function', "
            "'path/to/file.py:function' or a black-box agent as 'openai:module:function'"
        )
    fn = load_callable(spec, "rollout.agent_loop")
    if not asyncio.iscoroutinefunction(fn):
        raise ConfigError(
            f"rollout.agent_loop: {spec!r} must be an async function "
            "(async def loop(client, sample, tools) -> Trajectory)"
        )
    return fn  # type: ignore[return-value]


def needs_endpoint(spec: str) -> bool:
    """Whether the loop talks to the model through the OpenAI-compatible endpoint."""
    return spec.startswith(PREFIX)
