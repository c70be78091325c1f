"""``rollout.endpoint.enabled``: the synchronous trainer serves its endpoint between steps too,
so an outside process can call the run's model whatever the mode; weight syncs wait for its
requests in flight."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import openai
import tiny_runs

from treadle.config import load_config
from treadle.serving import Request, Response, RolloutClient
from treadle.serving.client import held
from treadle.trainers.rl import RLTrainer


def test_the_sync_trainer_answers_an_outside_process_between_steps(tiny_task, tmp_path):
    cfg = load_config(
        None,
        tiny_runs.overrides(
            tiny_task,
            tmp_path / "run",
            "rollout.engine=hf",
            "trainer.backend=local",
            "rollout.max_new_tokens=6",
            "rollout.endpoint.enabled=true",
            "rollout.endpoint.api_key=outside-key",
        ),
    )
    trainer = RLTrainer(cfg)
    try:
        endpoint = trainer.rollout.endpoint
        assert endpoint is not None  # single_turn needs none: enabled makes it
        outside = openai.OpenAI(
            base_url=endpoint.url, api_key="outside-key", max_retries=0, timeout=120
        )

        def ask() -> Any:  # from this thread, while the driver is between steps
            return outside.completions.create(model="any", prompt="1 + 2 =", max_tokens=4)

        before = ask()
        metrics = trainer.run_step(1)  # generate, train, sync the weights (none in flight)
        after = ask()
    finally:
        trainer.close()
    assert before.choices[0].finish_reason in ("stop", "length")
    assert after.usage.completion_tokens >= 1
    assert metrics["reward/mean"] >= 0.0
    assert trainer.rollout.version == 1


class GatedReplica:
    """Answers each request once ``release`` is set (one token)."""

    def __init__(self) -> None:
        self.name = "gated"
        self.started, self.release = threading.Event(), threading.Event()
        self.answered = 0

    async def generate(self, requests: list[Request]) -> list[Response]:
        self.started.set()
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        self.answered += len(requests)
        return [Response(r.request_id, [7], [-0.1], "length", 0, self.name) for r in requests]

    async def score(self, requests: list[Any]) -> list[Any]:
        raise NotImplementedError


def wait_until(condition: Any, deadline_s: float = 60.0) -> None:
    tick = threading.Event()
    for _ in range(int(deadline_s / 0.01)):
        if condition():
            return
        tick.wait(0.01)
    raise AssertionError("not reached in time")


def test_a_weight_sync_waits_for_the_requests_in_flight():
    from treadle.engines.inference import SamplingParams

    replica = GatedReplica()
    client = RolloutClient([replica])
    client.start_background()
    try:
        asked = client.spawn(client.submit(Request("r", (1, 2), SamplingParams())))
        assert replica.started.wait(60)
        seen: list[int] = []

        def sync() -> None:
            with held(client):  # what Rollout.sync_weights does around the update
                seen.append(replica.answered)

        syncing = threading.Thread(target=sync)
        syncing.start()
        wait_until(lambda: not client._open.is_set())  # paused, the request still in flight
        assert seen == []
        replica.release.set()
        syncing.join(60)
        assert seen == [1] and asked.result(60).token_ids == [7]
    finally:
        client.close()
