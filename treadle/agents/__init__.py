"""Agent loops: multi-turn rollouts over the rollout client, with tools.

An agent loop is ``async def loop(client: AgentClient, sample: Sample, tools: Toolbox) ->
Trajectory`` (:mod:`treadle.agents.loops`); tools are plain functions
(:mod:`treadle.agents.tools`); a trajectory is token ids in, token ids out, with a loss mask
(:mod:`treadle.agents.trajectory`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treadle.runtime.lazy import lazy

if TYPE_CHECKING:
    from treadle.agents.loops import AgentClient, AgentLoopError, Limits, Sample, run_agents
    from treadle.agents.tools import Tool, Toolbox, ToolCall, ToolResult, parse_tool_calls
    from treadle.agents.trajectory import Trajectory

# imported on first use: the loops import the rollout client and torch, which a check of a
# config's names (treadle.agents.registry) does not need
_LAZY = {
    **dict.fromkeys(["AgentClient", "AgentLoopError", "Limits", "Sample", "run_agents"], "loops"),
    **dict.fromkeys(["Tool", "Toolbox", "ToolCall", "ToolResult", "parse_tool_calls"], "tools"),
    "Trajectory": "trajectory",
}

__all__ = [
    "AgentClient",
    "AgentLoopError",
    "Limits",
    "Sample",
    "Tool",
    "ToolCall",
    "ToolResult",
    "Toolbox",
    "Trajectory",
    "parse_tool_calls",
    "run_agents",
]

__getattr__ = lazy(__name__, _LAZY)
