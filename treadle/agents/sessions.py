"""A session's recorded model calls become training samples, token for token.

A black-box agent talks to the model through the OpenAI-compatible endpoint
(:mod:`treadle.serving.endpoint`), which records, for every call of a session, the prompt token
ids it sent to the engine and the completion token ids, log-probs and weight versions the engine
sampled. :func:`merge_calls` turns those calls into trajectories without re-tokenizing any text:

- a call whose prompt starts with a trajectory's whole conversation so far (its prompt, every
  completion and what came between) extends it: the new prompt tokens are appended with loss
  mask 0, the completion with loss mask 1;
- a call that extends no trajectory (a chat template that rewrites history or drops
  ``<think>``, an agent that edits or truncates its messages, a second conversation) starts a
  new one. Each trajectory is a separate sample with the session's reward; the number of extra
  trajectories is the session's prefix breaks (``agent/prefix_breaks``).

A call extends the newest trajectory it fits, so two conversations interleaved in one session
(a sub-agent, parallel calls) each stay whole. A call that would take a trajectory past its
token budget (``width``: ``rollout.max_response_length``) starts a new one too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from treadle.agents.trajectory import Trajectory
from treadle.serving.server import Response


class RecordedCall(Protocol):
    """What the endpoint recorded of one call (:class:`treadle.serving.endpoint.Call`)."""

    index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    token_versions: list[int]
    stop_reason: str


def merge_calls(calls: Sequence[RecordedCall], width: int) -> list[Trajectory]:
    """The trajectories of a session's ``calls`` (see the module docstring), in the order they
    started; those beyond the first are its prefix breaks."""
    trajectories: list[Trajectory] = []
    for call in sorted(calls, key=lambda c: c.index):
        t = _extended(trajectories, call, width)
        if t is None:
            t = Trajectory(list(call.prompt_ids))
            trajectories.append(t)
        else:
            t.add_tokens(call.prompt_ids[len(t.all_token_ids) :])
        t.add_response(_response(call))
    return trajectories


def _extended(trajectories: list[Trajectory], call: RecordedCall, width: int) -> Trajectory | None:
    """The newest trajectory whose whole conversation ``call``'s prompt starts with, if the
    call's tokens still fit its budget."""
    prompt = call.prompt_ids
    for t in reversed(trajectories):
        so_far = t.all_token_ids
        if len(prompt) < len(so_far) or prompt[: len(so_far)] != so_far:
            continue
        after_prompt = len(prompt) - len(t.prompt_ids) + len(call.completion_ids)
        return t if after_prompt <= width else None
    return None


def _response(call: RecordedCall) -> Response:
    versions = list(call.token_versions) or [0] * len(call.completion_ids)
    return Response(
        f"call{call.index}",
        list(call.completion_ids),
        list(call.log_probs),
        call.stop_reason,
        min(versions, default=0),
        "endpoint",
        tuple(versions),
    )
