"""Recorded calls merged into samples by prefix, and failed agent runs dropped and counted.

Calls are built by hand here (what the endpoint records); the endpoint itself is tested in
tests/rollout/test_endpoint.py and the black-box agents end to end in
tests/rollout/test_blackbox_e2e.py.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import pytest

from treadle.agents.blackbox import agent_result
from treadle.agents.loops import AgentLoopError, Failures, Limits, Sample, run_agents
from treadle.agents.sessions import merge_calls
from treadle.agents.tools import Toolbox
from treadle.agents.trajectory import Trajectory
from treadle.engines.inference import SamplingParams
from treadle.serving.client import RolloutClient
from treadle.serving.server import Request, Response


@dataclass
class Call:
    index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    stop_reason: str = "stop"

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        self.log_probs = self.log_probs or [-0.5] * n
        self.token_versions = self.token_versions or [7] * n


def test_calls_that_extend_the_conversation_merge_into_one_sample():
    # turn 1: prompt [1, 2] -> [3, 4]; turn 2 appends [5, 6] (a tool message) -> [7];
    # turn 3 appends [8] -> [9, 10]
    calls = [
        Call(0, [1, 2], [3, 4]),
        Call(1, [1, 2, 3, 4, 5, 6], [7], [-0.1], [8]),
        Call(2, [1, 2, 3, 4, 5, 6, 7, 8], [9, 10]),
    ]
    (t,) = merge_calls(calls, width=100)
    assert t.prompt_ids == [1, 2]
    assert t.token_ids == [3, 4, 5, 6, 7, 8, 9, 10]
    assert t.loss_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert t.log_probs == [-0.5, -0.5, 0.0, 0.0, -0.1, 0.0, -0.5, -0.5]
    assert t.token_versions == [7, 7, -1, -1, 8, -1, 7, 7]
    assert t.turns == 3 and t.weight_versions == [7, 8, 7]
    t.check()


def test_a_broken_prefix_splits_the_session_into_segments():
    calls = [
        Call(0, [1, 2], [3, 4]),
        Call(1, [1, 2, 3, 4, 5], [6]),
        Call(2, [1, 2, 9, 5], [7, 8]),  # history rewritten: [3, 4] became [9]
        Call(3, [1, 2, 9, 5, 7, 8, 5], [11]),  # extends the new segment
    ]
    (a, b) = merge_calls(calls, width=100)
    assert (a.prompt_ids, a.token_ids, a.loss_mask) == ([1, 2], [3, 4, 5, 6], [1, 1, 0, 1])
    assert (b.prompt_ids, b.token_ids, b.loss_mask) == ([1, 2, 9, 5], [7, 8, 5, 11], [1, 1, 0, 1])


def test_interleaved_conversations_each_stay_whole_and_the_budget_splits():
    calls = [
        Call(0, [1], [2]),
        Call(1, [50], [51]),  # a second conversation
        Call(2, [1, 2, 3], [4]),  # extends the first, not the newest
        Call(3, [50, 51, 52], [53]),
    ]
    (a, b) = merge_calls(calls, width=100)
    assert a.all_token_ids == [1, 2, 3, 4] and b.all_token_ids == [50, 51, 52, 53]
    # with a budget of 3 tokens after the prompt, the third call no longer fits the first
    parts = merge_calls(calls[:1] + calls[2:3], width=2)
    assert [p.all_token_ids for p in parts] == [[1, 2], [1, 2, 3, 4]]


def test_calls_merge_in_arrival_order_whatever_order_they_are_given():
    calls = [Call(1, [1, 2, 3], [4]), Call(0, [1], [2])]
    (t,) = merge_calls(calls, width=10)
    assert (t.all_token_ids, t.loss_mask) == ([1, 2, 3, 4], [1, 0, 1])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, (1.0, {})),
        (0.25, (0.25, {})),
        (None, (None, {})),
        ({"reward": 0.5, "turns": 2}, (0.5, {"turns": 2.0})),
        ({"checked": 1}, (None, {"checked": 1.0})),
    ],
)
def test_agent_results(value, expected):
    assert agent_result(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("42", "it returned '42': an agent returns its reward"),
        (True, "it returned True: an agent returns its reward"),
        (float("nan"), "it returned nan"),
        ({"reward": "high"}, "it returned reward 'high', not a finite number"),
        ({"reward": 1, "note": "x"}, "it returned a dict whose 'note' is not a number"),
    ],
)
def test_agent_results_that_are_junk_are_named(value, message):
    with pytest.raises(TypeError, match=message):
        agent_result(value)


# ----------------------------------------------------------------------------- failed runs


class EchoReplica:
    """Answers every request with token 5 (EOS-free), log-prob -1."""

    name = "echo"

    async def generate(self, requests: list[Request]) -> list[Response]:
        return [Response(r.request_id, [5], [-1.0], "stop", 0, self.name) for r in requests]


async def moody(client, sample, tools):
    """Fails in the way its sample's ``row['mood']`` says."""
    mood = sample.row["mood"]
    if mood == "raise":
        raise RuntimeError("the agent tripped")
    if mood == "hang":
        await asyncio.Event().wait()
    if mood == "junk":
        return "42"
    t = Trajectory(list(sample.prompt_ids))
    t.add_response(await client.generate(sample.prompt_ids))
    return t


def run_moody(moods: list[str], max_frac: float, timeout_s: float = 30.0):
    client = RolloutClient([EchoReplica()])
    samples = [Sample(f"u:{i}", [1, 2], "p", "", {"mood": m}) for i, m in enumerate(moods)]
    try:
        return client.run(
            run_agents(
                moody,
                client,
                samples,
                1,
                SamplingParams(),
                tokenizer=None,
                tools=Toolbox([]),
                limits=Limits(),
                max_concurrent=8,
                failures=Failures(timeout_s, max_frac),
            )
        )
    finally:
        client.close()


def test_failed_runs_are_dropped_counted_and_named(caplog):
    moods = ["ok", "raise", "ok", "junk", "hang", "ok"]
    with caplog.at_level(logging.WARNING, logger="treadle.agents.loops"):
        runs = run_moody(moods, max_frac=0.5, timeout_s=0.5)
    assert [len(ts) for ts in runs.trajectories] == [1, 0, 1, 0, 0, 1]
    assert [i for i, _ in runs.rows()] == [0, 2, 5]
    assert runs.errors == [
        "agent loop 'moody' failed on sample u:1: RuntimeError: the agent tripped",
        "agent loop 'moody' failed on sample u:3: TypeError: it returned str, not a Trajectory",
        "agent loop 'moody' failed on sample u:4: ran longer than rollout.agent_timeout_s=0.5 s",
    ]
    assert runs.counters() == {"agent/errors": 3.0, "agent/prefix_breaks": 0}
    assert [r.getMessage() for r in caplog.records] == [
        f"{e}; its sample is dropped" for e in runs.errors
    ]


def test_too_many_failed_runs_stop_the_batch_with_one_line():
    with pytest.raises(AgentLoopError) as e:
        run_moody(["ok", "raise", "raise", "ok"], max_frac=0.25)
    assert str(e.value) == (
        "2 of 4 agent runs failed in this batch, more than rollout.max_agent_error_frac=0.25; "
        "the first: agent loop 'moody' failed on sample u:1: RuntimeError: the agent tripped"
    )
    with pytest.raises(AgentLoopError, match="1 of 1 agent runs failed"):
        run_moody(["raise"], max_frac=1.0)  # nothing left to train on
