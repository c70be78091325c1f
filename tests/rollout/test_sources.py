"""Asynchronous training (trainer.mode one_step_off / async, treadle.rollout.sources.AsyncSource).

The producer's rules (when a step-batch may start, what is dropped as stale, what a checkpoint
keeps) are checked against a rollout double that records the weight version each step-batch
started with; the modes end to end with Ray, split vLLM replicas and the tiny model: async with
max_staleness 0 samples and trains exactly as sync, and an async run killed with SIGKILL is
completed by running the same command again.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from treadle.config import load_config
from treadle.data import PromptDataset, ResumableSampler
from treadle.engines.inference import SamplingParams
from treadle.protocol import Batch
from treadle.rollout.sources import AsyncSource
from treadle.rollout.sources.admission import Group as _Group
from treadle.runtime.errors import ConfigError
from treadle.serving import Request, Response, RolloutClient

N = 2  # samples per prompt
BATCH = 4  # prompts per step


class IdleReplica:
    name = "rollout replica 0"

    async def generate(self, requests: list[Request]) -> list[Response]:
        raise AssertionError("the double's rollout does not send requests")


class FakeRollout:
    """Generates a step-batch after ``delay`` seconds: every sample's one token is the step,
    its version the replicas' version when the step-batch started (``started`` records it)."""

    def __init__(self, version: int = 0, delay: float = 0.01) -> None:
        self.client = RolloutClient([IdleReplica()])
        self.version, self.delay = version, delay
        self.started: dict[int, int] = {}  # step-batch (its seed) -> version at its start
        self.syncs: list[tuple[int, bool]] = []

    async def agenerate(self, prompts: Batch, params: SamplingParams) -> Batch:
        step, version = params.seed % 100_003, self.version  # the seed is seed * 100_003 + step
        self.started[step] = version
        await asyncio.sleep(self.delay)
        batch = prompts.repeat(params.n, interleave=True)
        batch["responses"] = torch.full((len(batch), 1), step)
        batch["response_mask"] = torch.ones(len(batch), 1, dtype=torch.long)
        batch["weight_version"] = torch.full((len(batch),), version)
        return batch

    def sync_weights(self, version: int, interrupt: bool = False) -> dict[str, float]:
        self.syncs.append((version, interrupt))
        self.version = version
        return {}

    def busy_seconds(self) -> list[float]:
        return [0.0]

    def take_counters(self) -> dict[str, float]:
        return {}


def _dataset(rows: int = 40) -> PromptDataset:
    return PromptDataset(
        [
            {
                "uid": f"p{i}",
                "prompt_text": "",
                "prompt_ids": [1] * (1 + i % 3),
                "ground_truth": "",
                "row": {},
            }
            for i in range(rows)
        ],  # type: ignore[misc]
        pad_id=0,
    )


def _score(batch: Batch, m=None) -> torch.Tensor:
    return torch.arange(len(batch), dtype=torch.float32)[:, None]  # varied: nothing filtered


def _producer(rollout: FakeRollout, start: int = 0, state=None, score=_score, **kw):
    overrides = [
        "trainer.mode=async",
        "rollout.placement=split",
        f"rollout.n={N}",
        f"data.batch_size={BATCH}",
        f"actor.ppo_mini_batch_size={N * BATCH}",
        *[f"async.{k}={v}" for k, v in kw.items()],
    ]
    cfg = load_config(None, overrides)
    sampler = ResumableSampler(40, BATCH, seed=3)
    producer = AsyncSource(cfg, rollout, _dataset(), sampler, score, start)  # type: ignore[arg-type]
    if state is not None:
        producer.load_state(state)
    return producer


def _run(producer: AsyncSource, first: int, last: int) -> list[tuple[list[str], dict]]:
    """Steps first..last: take a batch, 'update', sync as due; the uids and metrics."""
    out = []
    for step in range(first, last + 1):
        m: dict[str, float] = {}
        batch = producer.sample(step, m)
        assert len(batch) == N * BATCH
        out.append((list(batch["uid"]), m))
        producer.after_update(step)
    return out


def test_staleness_stays_within_the_bound_and_step_batches_wait_for_fresh_weights():
    rollout = FakeRollout()
    producer = _producer(rollout, max_staleness=1)
    try:
        steps = _run(producer, 1, 6)
        for _, m in steps:
            assert m["async/staleness_max"] <= 1 and m["async/dropped"] == 0
        assert max(m["async/staleness_max"] for _, m in steps) == 1  # it did run ahead
        # step-batch s started only with version >= s - 2 (s - 1 - max_staleness)
        assert all(v >= s - 2 for s, v in rollout.started.items())
        assert rollout.syncs == [(s, False) for s in range(1, 7)]  # waits for requests in flight
    finally:
        rollout.client.close()


def test_max_staleness_zero_is_synchronous_sample_for_sample():
    """Each step trains the prompts a sync run draws for it, sampled by the learner's weights."""
    rollout = FakeRollout()
    producer = _producer(rollout, max_staleness=0)
    sampler = ResumableSampler(40, BATCH, seed=3)
    try:
        for step, (uids, m) in enumerate(_run(producer, 1, 5), start=1):
            expected = [f"p{i}" for i in sampler.next_indices() for _ in range(N)]
            assert uids == expected
            assert rollout.started[step] == step - 1 and m["async/staleness_max"] == 0
    finally:
        rollout.client.close()


def test_samples_older_than_the_bound_are_dropped_and_counted():
    rollout = FakeRollout()
    producer = _producer(rollout, max_staleness=1, partial_rollout="true")
    try:
        _run(producer, 1, 1)
        while len(producer.buffer) < 2 * BATCH:  # step-batches 2 and 3, versions 0 and 1
            time.sleep(0.01)
        producer.learner = 3  # as if two more updates had passed them by
        producer.sync()
        m: dict[str, float] = {}
        batch = producer.sample(4, m)
        assert m["async/dropped"] == 2 * N * BATCH and m["async/dropped_total"] == 2 * N * BATCH
        assert set(batch["weight_version"].tolist()) == {3}
        assert rollout.syncs[-1] == (3, True)  # partial rollouts: the sync interrupts
    finally:
        rollout.client.close()


def test_a_checkpoint_resumes_generation_at_the_first_group_not_trained():
    rollout = FakeRollout()
    producer = _producer(rollout, max_staleness=2)
    try:
        before = [u for uids, _ in _run(producer, 1, 3) for u in uids]
        state = producer.state()
    finally:
        rollout.client.close()
    assert state["async"] == {"next_step": 4, "consumed": []}  # three step-batches, all taken
    again = FakeRollout(version=3)  # the replicas start with the resumed weights
    resumed = _producer(again, 3, state, max_staleness=2)
    try:
        after = [u for uids, _ in _run(resumed, 4, 6) for u in uids]
    finally:
        again.client.close()
    sampler = ResumableSampler(40, BATCH, seed=3)
    everything = [f"p{i}" for _ in range(6) for i in sampler.next_indices() for _ in range(N)]
    assert before + after == everything  # nothing trained twice, nothing skipped


def test_a_partly_trained_step_batch_is_drawn_again_without_its_trained_groups():
    """A checkpoint taken while a step-batch is half trained (dynamic sampling took part of
    it): the resumed producer generates only its other groups."""
    rollout = FakeRollout()
    producer = _producer(rollout, max_staleness=1)
    try:
        _run(producer, 1, 1)
        taken = producer.client.run(producer._take(1))  # one group of step-batch 2
        state = producer.state()
    finally:
        rollout.client.close()
    assert state["async"] == {"next_step": 2, "consumed": [[2, taken[0].index]]}
    again = FakeRollout(version=1)
    resumed = _producer(again, 1, state, max_staleness=1)
    try:
        uids = [u for uids, _ in _run(resumed, 2, 2) for u in uids]
    finally:
        again.client.close()
    sampler = ResumableSampler(40, BATCH, seed=3)
    sampler.next_indices()
    second, third = sampler.next_indices(), sampler.next_indices()
    rest = [f"p{i}" for k, i in enumerate(second) if k != taken[0].index]
    assert uids[: N * (BATCH - 1)] == [u for u in rest for _ in range(N)]
    assert uids[N * (BATCH - 1) :] == [f"p{third[0]}"] * N  # then the next step-batch


def test_dynamic_sampling_takes_more_groups_even_past_the_staleness_gate():
    """filter_groups with max_staleness 0: groups of equal rewards (prompts with an even
    number here) are dropped, and the starving trainer gets further step-batches at once."""

    def score(batch: Batch, m=None) -> torch.Tensor:
        odd = torch.tensor([int(u[1:]) % 2 for u in batch["uid"]], dtype=torch.float32)
        return (odd * torch.arange(len(batch)))[:, None]  # even prompts: all zero

    rollout = FakeRollout()
    producer = _producer(rollout, score=score, max_staleness=0)
    producer.cfg.algorithm.filter_groups = True
    try:
        m: dict[str, float] = {}
        batch = producer.sample(1, m)
    finally:
        rollout.client.close()
    assert all(int(u[1:]) % 2 for u in batch["uid"]) and len(batch) == N * BATCH
    assert len(rollout.started) > 1 and set(rollout.started.values()) == {0}
    assert 0 < m["rollout/kept_group_frac"] < 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.mode=async"], "needs replicas of their own: set rollout.placement=split"),
        (
            ["trainer.mode=async", "rollout.placement=split", "async.sync_every=3"],
            "async.sync_every=3 lets the replicas fall more than async.max_staleness=1",
        ),
        (
            ["trainer.mode=async", "rollout.placement=split", "async.buffer_groups=2"],
            "async.buffer_groups=2 cannot hold one batch",
        ),
    ],
)
def test_async_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_remax_is_refused_in_the_async_modes():
    from treadle.trainers.rl import check_names

    cfg = load_config(
        None,
        ["trainer.mode=one_step_off", "rollout.placement=split", "algorithm.adv_estimator=remax"],
    )
    with pytest.raises(ConfigError, match=r"remax needs greedy baselines .* trainer\.mode=sync"):
        check_names(cfg)


class UnevenRollout(FakeRollout):
    """Prompts p0, p5, p10, ...: every run failed (no rows); p3, p6, ...: one session split
    (an extra row); the counters say so."""

    async def agenerate(self, prompts: Batch, params: SamplingParams) -> Batch:
        batch = await super().agenerate(prompts, params)
        number = [int(u[1:]) for u in batch["uid"]]
        rows = [i for i, k in enumerate(number) if k % 5]
        rows += [i for i, k in enumerate(number) if k % 5 and k % 3 == 0 and i % N == 0]
        self.failed = getattr(self, "failed", 0) + sum(1 for k in number if k % 5 == 0)
        return batch.select(sorted(rows))

    def take_counters(self) -> dict[str, float]:
        failed, self.failed = getattr(self, "failed", 0), 0
        return {"agent/errors": float(failed)}


def test_groups_are_counted_by_prompt_when_runs_fail_or_sessions_split():
    rollout = UnevenRollout()
    producer = _producer(rollout, max_staleness=0)
    try:
        m: dict[str, float] = {}
        batch = producer.sample(1, m)
    finally:
        rollout.client.close()
    uids = list(batch["uid"])
    groups = list(dict.fromkeys(uids))  # in order, each once
    assert len(groups) == BATCH and all(int(u[1:]) % 5 for u in groups)
    for u in groups:  # consecutive rows: N, or N + 1 where the session split
        assert uids.count(u) == N + (int(u[1:]) % 3 == 0)
    assert uids == [u for u in groups for _ in range(uids.count(u))]
    # the failed runs of the step-batches generated so far (N runs of each failed prompt)
    assert m["agent/errors"] > 0 and m["agent/errors"] % N == 0


def test_the_group_filter_cuts_the_batch_at_whole_groups():
    from treadle.rollout.sources import GroupFilter

    cfg = load_config(
        None, [f"rollout.n={N}", "data.batch_size=2", f"actor.ppo_mini_batch_size={N}"]
    )
    groups = GroupFilter(cfg)
    rows = ["a"] * N + ["b"] * (N + 1) + ["c"] * N  # b: a session split into two rows
    part = Batch.from_dict(
        {"prompts": torch.ones(len(rows), 1, dtype=torch.long)},
        {"uid": rows},
    )
    part["prompt_mask"] = torch.ones(len(rows), 1, dtype=torch.long)
    groups.add(part, failed=1)
    assert groups.done() and groups.examined == 4
    assert list(groups.batch({})["uid"]) == ["a"] * N + ["b"] * (N + 1)


# ----------------------------------------------------------------------------- admission


@pytest.mark.parametrize(
    ("at", "waiting", "steps"),
    [
        # between steps 1 and 2: four groups a step, oldest first
        ((2, 0), 0, [2, 2, 2, 2, 3, 3, 3, 3, 4]),
        # step 2 took 2 groups and waits for 2 more: 2 more go to step 2, the rest after
        ((2, 2), 2, [2, 2, 3, 3, 3, 3, 4]),
        # dynamic sampling: step 2 took 6 groups (4 dropped) and waits for 2 more
        ((2, 6), 2, [2, 2, 3, 3, 3, 3, 4]),
        # ... and between two takes: it may stop now, so the next group may be step 3's
        ((2, 6), 0, [3, 3, 3, 3, 4]),
    ],
)
def test_the_latest_step_that_trains_a_group_by_its_place_in_line(at, waiting, steps):
    from treadle.rollout.sources import trained_by

    assert [trained_by(p, *at, waiting, 4) for p in range(len(steps))] == steps


def test_a_step_batch_is_admitted_when_its_last_group_will_be_trained_in_time():
    """max_staleness 1, four groups a step (one_step_off's schedule, worked by hand)."""
    from treadle.rollout.sources import Admission

    bounded, drop = Admission(True, 1, 4), Admission(False, 1, 4)
    # after step 1, replicas at version 0: step-batch 2 (nothing ahead) is trained at step 2
    assert bounded.fresh(2, 4, version=0, ahead=0, at=(2, 0), waiting=0)
    # step-batch 3 behind it is trained at step 3: version 1 at least (the sync after step 1)
    assert not bounded.fresh(3, 4, version=0, ahead=4, at=(2, 0), waiting=0)
    assert bounded.fresh(3, 4, version=1, ahead=4, at=(2, 0), waiting=0)
    assert not bounded.fresh(4, 4, version=1, ahead=8, at=(2, 0), waiting=0)
    assert drop.fresh(3, 4, 1, 4, (2, 0), 0) and not drop.fresh(4, 4, 1, 8, (2, 0), 0)
    # resumed with one group of step-batch 2 trained: its other 3 and step-batch 3 (groups
    # 3..6 in line) are trained by step 3; step-batch 4 (7..10) by step 4, so needs version 2
    assert bounded.fresh(3, 4, version=1, ahead=3, at=(2, 0), waiting=0)
    assert not bounded.fresh(4, 4, version=1, ahead=7, at=(2, 0), waiting=0)
    assert bounded.fresh(4, 4, version=2, ahead=7, at=(2, 0), waiting=0)
    # the trainer waits for step-batch 3, step-batch 2 still generating: bounded waits for it
    later = [_Group(3, i, Batch.from_dict({"x": torch.zeros(1)})) for i in range(4)]
    assert not bounded.ready(later, 4, flying={2}) and drop.ready(later, 4, flying={2})
    assert bounded.ready(later, 4, flying={4}) and not bounded.ready(later[:3], 4, flying=set())


class SecondAfterThird(FakeRollout):
    """Step-batch 2 finishes after step-batch 3: once the trainer has looked at a buffer
    holding step-batch 3 (``looked``, set by :class:`Watched`)."""

    def __init__(self) -> None:
        super().__init__()
        self.looked = asyncio.Event()

    async def agenerate(self, prompts: Batch, params: SamplingParams) -> Batch:
        batch = await super().agenerate(prompts, params)
        if params.seed % 100_003 == 2:
            await self.looked.wait()
        return batch


def watch(producer: AsyncSource, looked: asyncio.Event) -> None:
    """Set ``looked`` when the trainer checks a buffer that holds step-batch 3's groups."""
    from treadle.rollout.sources import Admission

    class Watched(Admission):
        def ready(self, buffer, count, flying) -> bool:  # type: ignore[no-untyped-def]
            if any(g.step == 3 for g in buffer):
                looked.set()
            return super().ready(buffer, count, flying)

    a = producer.admission
    producer.admission = Watched(a.bounded, a.max_staleness, a.batch_size)


@pytest.mark.parametrize("admission", ["drop", "bounded"])
def test_bounded_admission_drops_nothing_where_dropping_does(admission):
    """max_staleness 1, step-batch 2 finishing after step-batch 3: dropping takes step-batch 3
    for step 2 and drops step-batch 2 (version 0) at step 3; bounded takes them in order."""
    rollout = SecondAfterThird()
    producer = _producer(rollout, max_staleness=1, admission=admission)
    watch(producer, rollout.looked)
    try:
        steps = _run(producer, 1, 3)
    finally:
        rollout.client.close()
    sampler = ResumableSampler(40, BATCH, seed=3)
    drawn = [[f"p{i}" for i in sampler.next_indices() for _ in range(N)] for _ in range(4)]
    dropped = [m["async/dropped"] for _, m in steps]
    if admission == "drop":
        assert dropped == [0, 0, N * BATCH]
        assert [uids for uids, _ in steps] == [drawn[0], drawn[2], drawn[3]]
    else:
        assert dropped == [0, 0, 0] and steps[-1][1]["async/dropped_total"] == 0
        assert [uids for uids, _ in steps] == drawn[:3]  # oldest first
        assert [m["async/staleness_max"] for _, m in steps] == [0, 1, 1]


def test_groups_dynamic_sampling_takes_on_top_are_admitted_within_the_bound():
    """filter_groups at max_staleness 1 (prompts with an even number: equal rewards): steps
    take more groups than a step-batch, from later step-batches, and none is stale."""

    def score(batch: Batch, m=None) -> torch.Tensor:
        odd = torch.tensor([int(u[1:]) % 2 for u in batch["uid"]], dtype=torch.float32)
        return (odd * torch.arange(len(batch)))[:, None]

    rollout = FakeRollout()
    producer = _producer(rollout, score=score, max_staleness=1)
    producer.cfg.algorithm.filter_groups = True
    try:
        steps = _run(producer, 1, 5)
    finally:
        rollout.client.close()
    assert all(m["async/dropped"] == 0 and m["async/staleness_max"] <= 1 for _, m in steps)
    assert any(m["rollout/kept_group_frac"] < 1 for _, m in steps)
    assert max(rollout.started) > 6  # it drew more than a step-batch a step


def test_rollout_idle_leaves_out_a_replica_that_died_or_started_afresh():
    """The soak test kills replicas: one dead when the step's metrics are taken (its busy time
    None) or restarted since (its count from 0 again) is left out of that step's idle fraction,
    and the step goes on."""

    class Replicas(FakeRollout):
        busy: tuple[float | None, ...] = ()

        def busy_seconds(self) -> list[float | None]:  # type: ignore[override]
            return list(self.busy)

    rollout = Replicas()
    producer = _producer(rollout)
    try:
        producer._busy = [1.0, 2.0]

        def idle(busy: list[float | None]) -> float | None:
            rollout.busy = tuple(busy)
            producer._clock = time.perf_counter() - 10.0  # ten seconds since the last call
            return producer.metrics(step_seconds=1.0).get("async/rollout_idle_frac")

        assert idle([None, 7.0]) == pytest.approx(0.5, abs=0.01)  # replica 0 died: 5 s of 10
        assert idle([0.5, 7.0]) == pytest.approx(1.0, abs=0.01)  # it is back, from 0: left out
        assert idle([2.5, 9.0]) == pytest.approx(0.8, abs=0.01)  # both again: 2 s busy each
        assert idle([None, None]) is None and producer._busy == [None, None]
    finally:
        rollout.client.close()
