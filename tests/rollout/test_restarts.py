"""Replica restarts (issue 27): a split replica that dies or stops answering is started again,
at most ``rollout.max_restarts`` times, and the requests it held are sent again.

The client's side against test doubles (fast); a GRPO run whose replica is SIGKILLed twice mid-
rollout, once between rollouts and once during a weight sync, under Ray (slow). Replicas killed
while the asynchronous producer generates: tests/test_soak.py (three minutes of bench/soak.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import threading
import time

import pytest

from treadle.engines.inference import SamplingParams
from treadle.serving import Request, Response, RolloutClient, RolloutError

SAMPLE = SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=5)


class RecordingReplica:
    """Answers after ``delay`` seconds; records what it was sent."""

    def __init__(self, name: str, delay: float = 0.0) -> None:
        self.name, self.delay = name, delay
        self.calls: list[list[Request]] = []

    async def generate(self, requests: list[Request]) -> list[Response]:
        self.calls.append(list(requests))
        await asyncio.sleep(self.delay)
        return [Response(r.request_id, [1], [-0.5], "stop", 0, self.name) for r in requests]


class DyingReplica(RecordingReplica):
    """Takes its calls, then fails them all after ``delay`` seconds, as a killed actor does."""

    async def generate(self, requests: list[Request]) -> list[Response]:
        self.calls.append(list(requests))
        await asyncio.sleep(self.delay)
        raise RolloutError(f"{self.name} (pid 1) died during a rollout (killed)")


def _client(replicas, max_restarts: int, up_after: float = 0.05, **kw) -> RolloutClient:
    client = RolloutClient(replicas, max_restarts=max_restarts, **kw)
    restarted: list[tuple[int, str]] = []

    async def restart(index: int, error: RolloutError) -> None:
        restarted.append((index, str(error)))
        await asyncio.sleep(up_after)
        client.replace(index, RecordingReplica(f"new {index}"), up=True)

    client.restarts.restart = restart
    client.restarted = restarted  # type: ignore[attr-defined]
    return client


def _requests(client: RolloutClient, n: int) -> list[Request]:
    return [Request(client.new_id(), (1, 2, 3), SAMPLE) for _ in range(n)]


def test_a_dead_replicas_requests_go_to_a_live_one_once_each():
    live, dying = RecordingReplica("a", delay=0.01), DyingReplica("b", delay=0.02)
    client = _client([live, dying], max_restarts=1, up_after=1.0)
    try:
        requests = _requests(client, 8)
        out = client.generate(requests)
        assert [r.request_id for r in out] == [r.request_id for r in requests]
        assert [r.replica for r in out[1::2]] == ["a"] * 4  # b's share, sent again to a
        assert sum(len(c) for c in live.calls) == 8  # every request answered once
        assert client.restarted[0][0] == 1  # type: ignore[attr-defined]
        # generate returned once the restart was done too (it may use the actor, idle then)
        assert client.down == set() and client.replicas[1].name == "new 1"
        assert client.outstanding == [0, 0]
    finally:
        client.close()


def test_with_every_replica_down_requests_wait_for_the_restarted_one():
    client = _client([DyingReplica("only", delay=0.01)], max_restarts=2)
    try:
        out = client.generate(_requests(client, 3))
        assert [r.replica for r in out] == ["new 0"] * 3
        assert client.restarts.left == 1 and client.outstanding == [0]
    finally:
        client.close()


def test_a_replica_that_stops_answering_is_restarted():
    client = _client([RecordingReplica("slow", delay=5.0)], max_restarts=1, timeout_s=0.2)
    try:
        out = client.generate(_requests(client, 2))
        assert [r.replica for r in out] == ["new 0"] * 2
        ((_, error),) = client.restarted  # type: ignore[attr-defined]
        assert "did not answer 2 request(s) within rollout.request_timeout_s=0.2 s" in error
    finally:
        client.close()


def test_restarts_run_out():
    client = RolloutClient([DyingReplica("r", delay=0.0)], max_restarts=1)

    async def restart(index: int, error: RolloutError) -> None:
        client.replace(index, DyingReplica("r again"), up=True)  # dies too

    client.restarts.restart = restart
    try:
        with pytest.raises(
            RolloutError,
            match=r"^r again \(pid 1\) died during a rollout \(killed\); "
            r"rollout.max_restarts=1 restarts used already$",
        ):
            client.generate(_requests(client, 2))
    finally:
        client.close()


def test_no_restarts_keeps_the_first_error():
    client = RolloutClient([DyingReplica("r", delay=0.0)])  # max_restarts=0: as before
    try:
        with pytest.raises(RolloutError, match=r"^r \(pid 1\) died during a rollout \(killed\)$"):
            client.generate(_requests(client, 2))
        assert client.down == set()
    finally:
        client.close()


def test_a_failed_restart_stops_the_run():
    client = RolloutClient([DyingReplica("r", delay=0.0)], max_restarts=3)

    async def restart(index: int, error: RolloutError) -> None:
        raise RuntimeError("no room for it")

    client.restarts.restart = restart
    try:
        with pytest.raises(RolloutError, match=r"; its restart failed: no room for it$"):
            client.generate(_requests(client, 1))
    finally:
        client.close()


# ----------------------------------------------------------------------------- under Ray


def _kill_when_busy(client: RolloutClient, index: int, pid: int) -> threading.Thread:
    """A thread that SIGKILLs replica ``index``'s process once requests are outstanding there
    (mid-rollout: an event of the run, not a time)."""

    def kill() -> None:
        while client.outstanding[index] == 0:
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def _trainer(task, reward, out, *extra: str):  # type: ignore[no-untyped-def]
    """A GRPO trainer on the tiny task, two split replicas, long rollouts; the sizes of the
    batches its steps sample are recorded in ``trainer.sizes``."""
    from treadle.config import load_config
    from treadle.trainers.rl import RLTrainer

    overrides = [
        f"reward.function={reward}",
        f"model.path={task['model']}",
        f"data.train_files=[{task['train']}]",
        f"data.val_files=[{task['test']}]",
        "data.batch_size=4",
        "data.max_prompt_length=64",
        "rollout.n=4",
        "rollout.max_new_tokens=48",
        "rollout.ignore_eos=true",  # long rollouts: the kill lands while they run
        "rollout.placement=split",
        "rollout.replicas=2",
        "rollout.max_restarts=5",
        "actor.ppo_mini_batch_size=16",
        "actor.micro_batch_size=8",
        "trainer.num_cpus=2",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        *extra,
    ]
    t = RLTrainer(load_config(None, overrides))
    t.sizes = []
    sample = t.source.sample

    def counted(step, m):  # type: ignore[no-untyped-def]
        batch = sample(step, m)
        t.sizes.append(len(batch))
        return batch

    t.source.sample = counted  # type: ignore[method-assign]
    return t


def _wait_gone(pid: int) -> None:
    """Until the process ``pid`` has ended."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.long
def test_a_replica_killed_twice_mid_run_is_restarted_and_every_step_has_its_samples(
    tiny_task, length_reward, tmp_path, ray_session, caplog
):
    import ray

    t = _trainer(tiny_task, length_reward, tmp_path / "run")
    sizes = t.sizes
    client, metrics = t.rollout.client, []
    try:
        with caplog.at_level(logging.WARNING, logger="treadle"):
            for step in range(1, 5):
                killer = None
                if step in (2, 3):  # replica 1, then its successor
                    pid = ray.get(t.rollout.replicas[1].describe.remote())["pid"]
                    killer = _kill_when_busy(client, 1, pid)
                metrics.append(t.step(step))
                if killer is not None:
                    killer.join(timeout=60)
                    assert not killer.is_alive()
        assert sizes == [16] * 4  # data.batch_size x rollout.n, every step
        restarts = [m.get("rollout/replica_restarts", 0.0) for m in metrics]
        assert restarts == [0.0, 1.0, 1.0, 0.0]  # in the step whose rollout lost requests
        warnings = [r.getMessage() for r in caplog.records if "restarting it" in r.getMessage()]
        assert len(warnings) == 2, warnings
        assert all(w.startswith("rollout replica 1 (pid ") for w in warnings), warnings
        assert all("died during a rollout" in w and "SIGKILL" in w for w in warnings)
        assert client.down == set() and client.restarts.left == 3
        # the restarted replica holds the current weights and version
        assert set(t.source.sample(5, {})["weight_version"].tolist()) == {4}
        # one dead between rollouts is restarted before the weight sync it would break
        pid = ray.get(t.rollout.replicas[0].describe.remote())["pid"]
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
        t.rollout.sync_weights(5)
        assert t.rollout.take_counters() == {"rollout/replica_restarts": 1.0}
        last = caplog.records[-1].getMessage()
        assert re.match(r"rollout replica 0 \(pid \d+\) died between rollouts", last), last
        assert set(t.source.sample(6, {})["weight_version"].tolist()) == {5}
        # one killed during a weight sync (its receive called, the broadcast not begun): the
        # sync is made again with new replicas for every one that did not load it all (the
        # live one waits in the broken group for good), and the run goes on
        pid = ray.get(t.rollout.replicas[1].describe.remote())["pid"]
        send = t.rollout.group.sync_weights

        def killed_first(version: int) -> int:
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)
            t.rollout.group.sync_weights = send
            return send(version)

        t.rollout.group.sync_weights = killed_first
        t.rollout.sync_weights(6)
        assert t.rollout.take_counters() == {"rollout/replica_restarts": 2.0}
        last = caplog.records[-1].getMessage()
        assert re.match(
            r"rollout replica 1 \(pid \d+\) died during a weight sync \(.*SIGKILL.*\); "
            r"restarting rollout replica 0, rollout replica 1$",
            last,
        ), last
        assert client.down == set() and client.restarts.left == 0
        assert set(t.source.sample(7, {})["weight_version"].tolist()) == {6}
    finally:
        t.close()
