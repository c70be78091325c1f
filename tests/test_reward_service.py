"""The reward service (``reward.url``) against a real aiohttp server started here, in a thread
of its own: scores arrive in order and train, a slow service times out, a flaky one succeeds
after retries, a down one stops with one line, the token comes from the environment."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import tiny_runs
import torch
from aiohttp import web

from treadle.check.user_code import check_reward_service
from treadle.config import load_config
from treadle.rewards import Scorer
from treadle.rewards.results import with_rows
from treadle.rewards.service import RewardService, ServiceOptions
from treadle.runtime.errors import ConfigError, RewardError
from treadle.trainers.rl import RLTrainer

FAST = {"backoff_s": 0.01, "timeout_s": 30.0}


def length_score(sample: dict[str, Any]) -> float:
    return (len(sample["response"]) % 5) / 4


class Service:
    """A reward service on 127.0.0.1 that answers as ``answer(request number, body)`` says
    (a dict: JSON 200; an int: that status; None: no answer until the test ends)."""

    def __init__(self, answer: Callable[[int, dict[str, Any]], Any]) -> None:
        self.answer = answer
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.loop = asyncio.new_event_loop()
        self.release = asyncio.Event()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.started.wait(30)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/score", self._score)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}/score"
        self.started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    async def _score(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        answer = self.answer(len(self.bodies), body)
        if answer is None:
            await self.release.wait()
            return web.json_response({"rewards": []})
        if isinstance(answer, int):
            return web.Response(status=answer, text=f"status {answer}\nsecond line")
        return web.json_response(answer)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.release.set)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@contextlib.contextmanager
def service(answer: Callable[[int, dict[str, Any]], Any]) -> Iterator[Service]:
    s = Service(answer)
    try:
        yield s
    finally:
        s.close()


def scored(n: int, body: dict[str, Any]) -> dict[str, Any]:
    return {"rewards": [length_score(s) for s in body["samples"]]}


PROMPTS = ["p0", "p1", "p2", "p3", "p4"]
RESPONSES = ["a", "bb", "ccc", "dddd", "eeeee"]
TRUTHS = ["1", "2", "3", "4", "5"]


def test_scores_arrive_in_order_in_batches_with_the_rows():
    with service(scored) as s:
        options = ServiceOptions(s.url, batch_size=2, concurrency=2, **FAST)
        with RewardService(options) as rs:
            rows = [
                {"prompt": p, "answer": t, "level": i}
                for i, (p, t) in enumerate(zip(PROMPTS, TRUTHS, strict=True))
            ]
            values = rs(with_rows(PROMPTS, RESPONSES, TRUTHS, rows))
    assert values == [length_score({"response": r}) for r in RESPONSES]
    assert sorted(len(b["samples"]) for b in s.bodies) == [1, 2, 2]
    sent = sorted((x for b in s.bodies for x in b["samples"]), key=lambda x: x["prompt"])
    assert sent[3] == {
        "prompt": "p3",
        "response": "dddd",
        "ground_truth": "4",
        "row": {"prompt": "p3", "answer": "4", "level": 3},
    }


def test_a_slow_service_times_out_in_one_line():
    with service(lambda n, body: None) as s:
        options = ServiceOptions(s.url, retries=1, backoff_s=0.01, timeout_s=0.3)
        with RewardService(options) as rs, pytest.raises(RewardError) as e:
            rs(with_rows(PROMPTS[:1], RESPONSES[:1], TRUTHS[:1], None))
    message = str(e.value)
    assert "\n" not in message and f"reward.url={s.url}" in message
    assert "no answer within reward.url_timeout_s=0.3 s" in message and "2 tries" in message
    assert len(s.bodies) == 2


def test_a_flaky_service_succeeds_after_retries():
    flaky = service(lambda n, body: 503 if n <= 2 else scored(n, body))
    with flaky as s, RewardService(ServiceOptions(s.url, retries=3, **FAST)) as rs:
        assert rs(with_rows(PROMPTS, RESPONSES, TRUTHS, None)) == [
            length_score({"response": r}) for r in RESPONSES
        ]
    assert len(s.bodies) == 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_service_that_stays_down_stops_with_one_line():
    url = f"http://127.0.0.1:{free_port()}/score"
    with (
        RewardService(ServiceOptions(url, retries=2, **FAST)) as rs,
        pytest.raises(RewardError) as e,
    ):
        rs(with_rows(PROMPTS, RESPONSES, TRUTHS, None))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"reward.url={url}: cannot reach it (")
    assert "3 tries over" in message and "is the reward service running" in message


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (400, "it answered HTTP 400: status 400 (not retried)"),
        (401, "HTTP 401: status 401 (not retried; check reward.url_auth_env's token)"),
        (
            {"rewards": [1.0]},
            'it answered 1 rewards for 5 samples; a reward service answers {"rewards"',
        ),
        ({"scores": [1.0]}, 'it answered {"scores": [1.0]} for 5 samples'),
    ],
)
def test_a_refusal_or_a_wrong_answer_is_one_line_without_retries(answer, expected):
    refusing = service(lambda n, body: answer)
    with (
        refusing as s,
        RewardService(ServiceOptions(s.url, **FAST)) as rs,
        pytest.raises(RewardError) as e,
    ):
        rs(with_rows(PROMPTS, RESPONSES, TRUTHS, None))
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert len(s.bodies) == 1


def test_the_token_comes_from_the_environment_variable(monkeypatch):
    monkeypatch.setenv("TREADLE_TEST_RM_TOKEN", "s3cret-token")
    options = {"auth_env": "TREADLE_TEST_RM_TOKEN"}
    with service(scored) as s, RewardService(ServiceOptions(s.url, **options)) as rs:
        rs(with_rows(PROMPTS[:1], RESPONSES[:1], TRUTHS[:1], None))
    assert s.headers[0]["Authorization"] == "Bearer s3cret-token"
    monkeypatch.delenv("TREADLE_TEST_RM_TOKEN")
    with pytest.raises(ConfigError, match="TREADLE_TEST_RM_TOKEN is not set"):
        RewardService(ServiceOptions(s.url, auth_env="TREADLE_TEST_RM_TOKEN"))


def test_the_scorer_weighs_the_service_with_the_rule(tmp_path):
    rule = tmp_path / "rule.py"
    rule.write_text("def score(prompt, response, ground_truth):\n    return 1.0\n")
    values = [{"a": 0.5, "b": 0.25}, {"a": 1.0, "b": 0.0}]
    with service(lambda n, body: {"rewards": values}) as s:
        both = ServiceOptions(s.url, weight=2.0, **FAST)
        with Scorer(f"{rule}:score", 0, service=both, rule_weight=0.5) as scorer:
            assert scorer(PROMPTS[:2], RESPONSES[:2], TRUTHS[:2]) == [2.0, 2.5]
        with Scorer(f"{rule}:score", 0, service=both, rule_weight=0.0) as alone:
            served = alone(PROMPTS[:2], RESPONSES[:2], TRUTHS[:2])
        assert served == [1.5, 2.0] and served.components == [
            {"a": 1.0, "b": 0.5},
            {"a": 2.0, "b": 0.0},
        ]
        bad = ServiceOptions(s.url, **FAST)
        s.answer = lambda n, body: {"rewards": [1.0, "x"]}
        with (
            Scorer(f"{rule}:score", 0, service=bad, rule_weight=0.0) as alone,
            pytest.raises(RewardError) as e,
        ):
            alone(PROMPTS[:2], RESPONSES[:2], TRUTHS[:2])
    assert str(e.value).startswith(f"reward service '{s.url}' failed on sample 1: returned 'x'")


def test_the_config_keeps_the_token_out_and_weighs_by_default():
    cfg = load_config(None, ["reward.url=http://127.0.0.1:9/score"])
    assert cfg.reward.rule_weight == 0.0  # the service alone, unless a weight is given
    cfg = load_config(None, ["reward.url=http://127.0.0.1:9/score", "reward.function_weight=0.5"])
    assert cfg.reward.rule_weight == 0.5
    with pytest.raises(ConfigError) as e:
        load_config(None, ["reward.url=http://user:hunter2@127.0.0.1:9/score"])
    assert "reward.url_auth_env" in str(e.value) and "hunter2" not in str(e.value)
    with pytest.raises(ConfigError, match="nothing would score"):
        load_config(None, ["reward.function_weight=0"])


def test_check_reaches_the_service_once_with_an_empty_batch():
    def alternate(n: int, body: dict[str, Any]) -> dict[str, Any]:
        return {"rewards": [float(k % 2) for k in range(len(body["samples"]))]}

    with service(alternate) as s:
        cfg = load_config(None, [f"reward.url={s.url}"])
        summary: list[str] = []
        problems: list[str] = []
        check_reward_service(cfg, summary, problems)
    assert problems == [] and s.bodies == [{"samples": []}]
    assert summary == [f"reward.url: {s.url} answered (weight 1)"]
    down = load_config(None, [f"reward.url=http://127.0.0.1:{free_port()}/score"])
    check_reward_service(down, summary, problems)
    assert len(problems) == 1 and "cannot reach it" in problems[0] and "(1 try;" in problems[0]


def test_an_rl_step_trains_on_the_services_scores(tiny_task, tmp_path):
    """The local backend, the hf engine: every sample goes to the service, its scores are the
    step's rewards, and the policy moves."""

    def alternate(n: int, body: dict[str, Any]) -> dict[str, Any]:
        return {"rewards": [float(k % 2) for k in range(len(body["samples"]))]}

    with service(alternate) as s:
        cfg = load_config(
            None,
            tiny_runs.overrides(
                tiny_task,
                tmp_path / "run",
                "rollout.engine=hf",
                "trainer.backend=local",
                "rollout.max_new_tokens=8",
                f"reward.url={s.url}",
                "reward.url_batch_size=3",
            ),
        )
        trainer = RLTrainer(cfg)
        try:
            engine = trainer.group.workers[0].server.engine.model  # synced after the update
            before = {n: p.detach().clone() for n, p in engine.named_parameters()}
            metrics = trainer.run_step(1)
            after = dict(engine.named_parameters())
        finally:
            trainer.close()
    samples = [x for b in s.bodies for x in b["samples"]]
    assert len(samples) == 4 and sorted(len(b["samples"]) for b in s.bodies) == [1, 3]
    assert metrics["reward/mean"] == pytest.approx(0.25)  # [0, 1, 0] and [0]
    assert all(set(x["row"]) >= {"prompt"} for x in samples)
    assert any(not torch.equal(before[k], after[k]) for k in before)
