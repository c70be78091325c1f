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
from typing import TYPE_CHECKING

from treadle.runtime.errors import ConfigError
from treadle.runtime.plugins import load_callable, require_call

if TYPE_CHECKING:
    from treadle.agents.loops import AgentLoop

# name -> its function in treadle.agents.loops (imported when a loop is loaded: it imports the
# rollout client and torch, which checking a config's names does not need)
BUILTIN_LOOPS: dict[str, str] = {"single_turn": "single_turn", "tools": "tool_loop"}
CALL = "await loop(client, sample, tools)"  # how a loop of one's own is called
OPENAI = "openai:"  # a black-box agent's spec begins with it (treadle.agents.blackbox)


def load_agent_loop(spec: str, env: str | None = None) -> AgentLoop:
    """``rollout.agent_loop``: a built-in name, a loop by path or a black-box agent; async.
    ``env``: ``rollout.env``, the environment factory of the ``env`` loop."""
    if spec in BUILTIN_LOOPS:
        from treadle.agents import loops

        loop: AgentLoop = getattr(loops, BUILTIN_LOOPS[spec])
        return loop
    if spec == "env":
        from treadle.agents.env import load_env_loop

        return load_env_loop(env)
    if needs_endpoint(spec):
        from treadle.agents.blackbox import load_openai_agent

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
    require_call(fn, spec, "rollout.agent_loop", ("client", "sample", "tools"), CALL)
    return fn  # type: ignore[return-value]


def needs_endpoint(spec: str) -> bool:
    """Whether the loop talks to the model through the OpenAI-compatible endpoint."""
    return spec.startswith(OPENAI)
