"""The agent loops of a run and the batch their trajectories make.

:class:`Agents` is the run's agent loop (``rollout.agent_loop``), its tools and bounds, read
from the config once. :func:`trajectory_batch` builds the response side of the batch from the
trajectories, one row per trajectory. Choices:

- Response-side tensors are padded on the right to one width: the most tokens a trajectory
  may have after its prompt (``rollout.max_response_length``, or ``max_new_tokens`` for one
  turn); a loop that returns more is a :class:`~treadle.serving.client.RolloutError`.
- A loop that rewrote its prompt gets its own prompt in the batch.
- The loss mask is the trajectory's (tool tokens 0); for agent loops other than single_turn
  tool tokens are attended (``response_attention_mask``), and ``turns`` and every number
  each trajectory's info has (``agent_<key>``) become fields.
- ``weight_version`` is the oldest of a sample's token versions; ``token_versions`` holds each
  token's (-1 where the model did not sample).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from treadle.agents.loops import AgentLoop, Failures, Limits, single_turn, tool_loop
from treadle.agents.registry import load_agent_loop
from treadle.agents.tools import CallParser, Toolbox, call_parser, parse_tool_calls
from treadle.agents.trajectory import Trajectory
from treadle.config import Config
from treadle.data import collate_prompts
from treadle.engines.inference import SamplingParams
from treadle.protocol import Batch
from treadle.serving.client import RolloutError


def left_trim(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row's ids where its mask is 1 (the prompts without their padding)."""
    return [tuple(row[m.bool()].tolist()) for row, m in zip(ids, mask, strict=True)]


def pad_right(rows: list[list[Any]], width: int, value: Any, dtype: torch.dtype) -> torch.Tensor:
    """``[len(rows), width]`` of ``dtype``: each row, then ``value``."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


@dataclass
class Agents:
    """The agent loop of a run, its tools and bounds (``rollout.agent_loop`` and friends)."""

    loop: AgentLoop
    tools: Toolbox
    tokenizer: Any
    max_turns: int = 1
    max_response_length: int | None = None  # None: one turn, params.max_new_tokens
    max_tool_response_tokens: int = 256
    max_concurrent: int = 256
    failures: Failures = field(default_factory=Failures)
    parse_calls: CallParser = parse_tool_calls  # the tools loop's (rollout.tool_parser)

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Any) -> Agents:
        r = cfg.rollout
        loop = load_agent_loop(r.agent_loop, r.env)
        builtin = loop in (single_turn, tool_loop)  # they end within their requests' timeouts
        tools = Toolbox.load(r.tools, r.tool_timeout_s)
        return cls(
            loop,
            tools,
            tokenizer,
            r.max_turns,
            None if loop is single_turn else cfg.response_length(),
            r.max_tool_response_tokens,
            r.max_concurrent_trajectories,
            Failures(None if builtin else r.agent_timeout_s, r.max_agent_error_frac),
            call_parser(tokenizer, r.tool_parser, tools.schemas) if tools else parse_tool_calls,
        )

    def width(self, params: SamplingParams) -> int:
        """Response columns of a batch: the most tokens a trajectory may have after its prompt."""
        return self.max_response_length or params.max_new_tokens

    def limits(self, params: SamplingParams) -> Limits:
        return Limits(self.max_turns, self.width(params), self.max_tool_response_tokens)


def trajectory_batch(
    batch: Batch,
    trajectories: list[Trajectory],
    width: int,
    agents: Agents,
    pad_id: int,
    decode: Callable[[list[list[int]]], list[str]],
) -> Batch:
    """The response side of ``batch`` (one row per trajectory) padded to ``width``; ``decode``
    makes the response text of the model's tokens."""
    given = [list(ids) for ids in left_trim(batch["prompts"], batch["prompt_mask"])]
    if [t.prompt_ids for t in trajectories] != given:
        ids, mask = collate_prompts([t.prompt_ids for t in trajectories], pad_id)
        batch["prompts"], batch["prompt_mask"] = ids, mask  # a loop rewrote its prompt
    longest = max(len(t.token_ids) for t in trajectories)
    if longest > width:
        raise RolloutError(
            f"an agent loop returned {longest} tokens after the prompt, more than its "
            f"budget of {width} (rollout.max_response_length)"
        )

    def pad(rows: list[list[Any]], value: Any, dtype: torch.dtype) -> torch.Tensor:
        return pad_right(rows, width, value, dtype)

    batch["responses"] = pad([t.token_ids for t in trajectories], pad_id, torch.long)
    batch["response_mask"] = pad([t.loss_mask for t in trajectories], 0, torch.long)
    batch["rollout_log_probs"] = pad([t.log_probs for t in trajectories], 0.0, torch.float32)
    batch["weight_version"] = torch.tensor([min(t.weight_versions) for t in trajectories])
    batch["token_versions"] = pad([t.token_versions for t in trajectories], -1, torch.long)
    decoded = decode([t.model_token_ids for t in trajectories])
    batch["response_text"] = [
        text if t.response_text is None else t.response_text
        for t, text in zip(trajectories, decoded, strict=True)
    ]
    batch["stop_reason"] = [t.stop_reason for t in trajectories]
    rewards = [math.nan if t.reward is None else t.reward for t in trajectories]
    batch["trajectory_reward"] = torch.tensor(rewards, dtype=torch.float64)  # NaN: none
    if agents.loop is not single_turn:  # tool tokens are attended, not trained
        ones = [[1] * len(t.token_ids) for t in trajectories]
        batch["response_attention_mask"] = pad(ones, 0, torch.long)
        batch.update(tensors=_agent_fields(trajectories))
    return batch


def _agent_fields(trajectories: list[Trajectory]) -> dict[str, torch.Tensor]:
    """``turns`` and ``agent_<key>`` for every number each trajectory's info has [B]."""
    fields = {"turns": torch.tensor([float(t.turns) for t in trajectories])}
    for key in sorted(set.intersection(*(set(t.info) for t in trajectories))):
        values = [t.info[key] for t in trajectories]
        if all(isinstance(v, int | float) for v in values):
            fields[f"agent_{key}"] = torch.tensor([float(v) for v in values])
    return fields
