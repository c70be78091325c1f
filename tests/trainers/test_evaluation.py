"""Named validation sets and sampled evaluation (treadle.trainers.evaluation).

The driver's side is checked against verl 0.9.1's ``process_validation_metrics`` on samples a
scripted rollout makes (failed runs, sessions split into segments, data sources, answers that
vote), then a real run reports every set's metrics.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from pathlib import Path

import pytest
import torch
from reference import verl_module
from tiny_runs import DIES_ONCE, overrides, train

from treadle.config import load_config
from treadle.protocol import Batch
from treadle.tasks.arithmetic import extract_answer
from treadle.trainers.evaluation import close_sets, evaluate_sets, load_val_sets


class ScriptedClient:
    def run(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.new_event_loop().run_until_complete(coro)


class ScriptedRollout:
    """Answers every prompt ``params.n`` times with a random number near the truth; some runs
    fail (no row), some sessions split in two segments (a wrong one, then the answer)."""

    def __init__(self, seed: int, fail: float = 0.1) -> None:
        self.rng, self.fail = random.Random(seed), fail
        self.client = ScriptedClient()
        self.params = None

    async def agenerate(self, prompts: Batch, params, count=True) -> Batch:  # type: ignore[no-untyped-def]
        assert not count  # an evaluation's failed runs are not agent/errors
        self.params = params
        picks, texts, samples = [], [], []
        for i, truth in enumerate(prompts["ground_truth"]):
            for j in range(params.n):
                if self.rng.random() < self.fail:
                    continue  # a failed run
                answer = self.rng.choice([truth, truth, str(int(truth) + 1), "", "0"])
                segments = ["I do not know", f"Answer: {answer}"] if self.rng.random() < 0.2 else []
                for text in segments or [f"The answer is {answer}"]:
                    picks.append(i)
                    texts.append(text)
                    samples.append(i * params.n + j)
        out = prompts.select(picks)
        out["response_text"] = texts
        out["sample_index"] = torch.tensor(samples)
        out["trajectory_reward"] = torch.full((len(picks),), math.nan, dtype=torch.float64)
        return out

    def take_counters(self) -> dict[str, float]:
        return {}


def expected(out: Batch, n: int, prompts: int) -> tuple[list[str], list[str], dict]:
    """verl's flat inputs for ``out``: a sample is its best segment, a failed run acc 0 (with
    no answer); the k-th prompt's source is "even" or "odd"."""
    best: dict[int, tuple[float, str]] = {}
    for i, text, truth in zip(
        out["sample_index"].tolist(), out["response_text"], out["ground_truth"], strict=True
    ):
        score = 1.0 if extract_answer(text) == truth else 0.0
        if i not in best or score > best[i][0]:
            best[i] = (score, extract_answer(text) or "")
    sources, uids, acc, preds = [], [], [], []
    for p in range(prompts):
        for j in range(n):
            score, pred = best.get(p * n + j, (0.0, ""))
            sources.append("even" if p % 2 == 0 else "odd")
            uids.append(str(p))
            acc.append(score)
            preds.append(pred)
    return sources, uids, {"acc": acc, "pred": preds}


def as_ours(reported: dict[str, float], n: int, prefix: str) -> dict[str, float]:
    """verl's names as ours: best@k/mean is best@k; its mean@n is also the accuracy (greedy:
    the accuracy alone)."""
    out = {f"{prefix}{name.removesuffix('/mean')}": v for name, v in reported.items()}
    out[f"{prefix}accuracy"] = out.pop(f"{prefix}mean@1") if n == 1 else out[f"{prefix}mean@{n}"]
    return out


@pytest.fixture
def sets_config(tiny_task, tmp_path):
    """val (the test file, first 12 rows) and `tagged` (rows with a data_source, 10 of them)."""
    rows = [json.loads(line) for line in Path(tiny_task["test"]).read_text().splitlines()]
    tagged = tmp_path / "tagged.jsonl"
    with tagged.open("w") as f:
        for k, row in enumerate(rows[:10]):
            f.write(json.dumps({**row, "data_source": "even" if k % 2 == 0 else "odd"}) + "\n")

    def make(*extra: str):  # type: ignore[no-untyped-def]
        return load_config(
            None,
            [
                f"model.path={tiny_task['model']}",
                f"data.val_files=[{tiny_task['test']}]",
                "data.val_size=12",
                f"data.val_sets={{tagged: {{files: [{tagged}]}}}}",
                "reward.function=arithmetic",
                *extra,
            ],
        )

    return make


@pytest.mark.parametrize(("n", "seed"), [(1, 42), (4, 42), (6, 5)])
def test_sets_equal_verl_process_validation_metrics(sets_config, n, seed):
    verl = verl_module("verl.trainer.ppo.metric_utils")
    cfg = sets_config(f"eval.n={n}", "eval.temperature=1.0", f"eval.seed={seed}")
    sets = load_val_sets(cfg)
    try:
        assert list(sets) == ["val", "tagged"]
        assert len(sets["val"].rows) == 12 and sets["val"].sources is None
        assert sets["tagged"].sources == ["even", "odd"] * 5
        rollout = ScriptedRollout(seed)
        outs = {}
        real = rollout.agenerate

        async def keep(prompts, params, count=True):  # type: ignore[no-untyped-def]
            out = await real(prompts, params, count)
            outs[len(outs)] = out
            return out

        rollout.agenerate = keep  # type: ignore[method-assign]
        metrics = evaluate_sets(cfg, rollout, sets)  # type: ignore[arg-type]
    finally:
        close_sets(sets)
    p = rollout.params
    assert (p.n, p.temperature, p.top_p, p.seed) == (n, 1.0, 1.0, seed)
    assert p.max_new_tokens == cfg.rollout.max_new_tokens  # eval.max_new_tokens=null
    for k, (name, count) in enumerate((("val", 12), ("tagged", 10))):
        sources, uids, infos = expected(outs[k], n, count)
        everything = verl.process_validation_metrics(["all"] * len(uids), uids, infos, seed)
        theirs = as_ours(everything["all"]["acc"], n, f"eval/{name}/")
        ours = {key: v for key, v in metrics.items() if key.startswith(f"eval/{name}/")}
        reward = {key: ours.pop(key) for key in list(ours) if key.endswith("/reward")}
        passes = {key: ours.pop(key) for key in list(ours) if "/pass@" in key}
        stderr = {key: ours.pop(key) for key in list(ours) if key.endswith("/stderr")}
        per_prompt = [sum(infos["acc"][i : i + n]) / n for i in range(0, len(uids), n)]
        assert stderr.pop(f"eval/{name}/accuracy/stderr") == pytest.approx(
            statistics.pstdev(per_prompt) / count**0.5
        )  # (not verl's: the prompts' accuracies' standard error)
        by_source = [f"eval/tagged/{s}/accuracy/stderr" for s in ("even", "odd")]
        assert sorted(stderr) == (by_source if name == "tagged" else [])
        assert reward.pop(f"eval/{name}/reward") == pytest.approx(sum(infos["acc"]) / len(uids))
        if name == "tagged":
            by_source = verl.process_validation_metrics(sources, uids, infos, seed)
            for source in ("even", "odd"):
                theirs.update(as_ours(by_source[source]["acc"], n, f"eval/tagged/{source}/"))
                half = [a for a, s in zip(infos["acc"], sources, strict=True) if s == source]
                got = reward.pop(f"eval/tagged/{source}/reward")
                assert got == pytest.approx(sum(half) / len(half))
        assert not reward
        assert ours == theirs
        ks = {1: [], 4: [2, 4], 6: [2, 4, 6]}[n]
        wanted = [f"eval/{name}/pass@{k}" for k in ks]
        if name == "tagged":
            wanted += [f"eval/tagged/{s}/pass@{k}" for s in ("even", "odd") for k in ks]
        assert sorted(passes) == sorted(wanted)
        if n > 1:  # pass@n: a prompt with any right sample
            right = [any(infos["acc"][i : i + n]) for i in range(0, len(uids), n)]
            assert passes[f"eval/{name}/pass@{n}"] == pytest.approx(sum(right) / count)


def test_a_set_scores_with_its_own_reward(sets_config, tmp_path):
    """`reward` of a set: here a function that gives every response 0.5 (never right)."""
    reward = tmp_path / "length.py"
    reward.write_text("def score(prompt, response, ground_truth):\n    return 0.5\n")
    cfg = sets_config(
        f"data.val_sets={{long: {{files: [{tmp_path / 'tagged.jsonl'}], reward: {reward}:score, "
        "size: 3}}"
    )
    sets = load_val_sets(cfg)
    try:
        assert sets["long"].reward == f"{reward}:score" and sets["val"].reward == "arithmetic"
        assert len(sets["long"].rows) == 3
        metrics = evaluate_sets(cfg, ScriptedRollout(0, fail=0.0), sets)  # type: ignore[arg-type]
    finally:
        close_sets(sets)
    assert metrics["eval/long/accuracy"] == 0.0 and metrics["eval/long/reward"] == 0.5
    assert metrics["eval/val/accuracy"] == metrics["eval/val/reward"] > 0  # arithmetic's
    # per data source where the rows carry one, not elsewhere
    assert metrics["eval/long/even/reward"] == metrics["eval/long/odd/reward"] == 0.5
    per_source = [k for k in metrics if k.removesuffix("/stderr").count("/") > 2]
    assert not [key for key in per_source if key.startswith("eval/val/")]


def test_a_run_reports_every_set_with_sampled_metrics(tiny_task, tmp_path, capsys):
    """A two-step RL run (local backend, vLLM-free transformers engine) evaluates both sets at
    its last step with 4 samples each; the CLI prints one held-out line per set."""
    hard = tmp_path / "hard.jsonl"
    hard.write_text("".join(Path(tiny_task["test"]).read_text().splitlines(True)[-6:]))
    out = tmp_path / "run"
    code, metrics = train(
        out,
        overrides(
            tiny_task,
            out,
            "trainer.backend=local",
            "trainer.total_steps=2",
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=16",
            f"data.val_files=[{tiny_task['test']}]",
            "data.val_size=8",
            f"data.val_sets={{hard: {{files: [{hard}], reward: chat_arithmetic}}}}",
            "eval.n=4",
            "eval.temperature=1.0",
            "eval.max_new_tokens=8",
        ),
    )
    assert code == 0
    assert not any(key.startswith("eval/") for key in metrics[0])  # due at the last step only
    last = metrics[-1]
    for name in ("val", "hard"):
        m = {
            k.removeprefix(f"eval/{name}/"): v
            for k, v in last.items()
            if k.startswith(f"eval/{name}/")
        }
        boot = {
            f"{s}@{k}{t}" for s in ("best", "worst", "maj") for k in (2, 4) for t in ("", "/std")
        }
        plain = {"accuracy", "accuracy/stderr", "reward", "mean@4", "std@4", "pass@2", "pass@4"}
        assert set(m) == plain | boot
        assert m["accuracy"] == m["mean@4"]
        assert m["accuracy"] <= m["pass@2"] <= m["pass@4"] <= 1.0
        assert m["worst@4"] <= m["worst@2"] <= m["accuracy"] <= m["best@2"] <= m["best@4"]
    printed = capsys.readouterr().out
    assert f"held-out accuracy: {100 * last['eval/val/accuracy']:.1f}%" in printed
    assert f"held-out accuracy (hard): {100 * last['eval/hard/accuracy']:.1f}%" in printed


def test_an_evaluation_reward_worker_that_dies_is_restarted_and_counted(tiny_task, tmp_path):
    """A set's reward process killed while scoring is started again like training's, and
    counted in ``reward/worker_restarts`` (read at each step before that step's evaluation)."""
    reward = tmp_path / "dies_once.py"
    reward.write_text(DIES_ONCE)
    hard = f"{{files: [{tiny_task['test']}], size: 4, reward: '{reward}:score'}}"
    out = tmp_path / "run"
    code, metrics = train(
        out,
        overrides(
            tiny_task,
            out,
            "trainer.backend=local",
            "trainer.total_steps=2",
            "trainer.eval_every=1",
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=8",
            "reward.num_workers=1",
            f"data.val_sets={{hard: {hard}}}",
            "eval.max_new_tokens=8",
        ),
    )
    assert code == 0
    assert [m["reward/worker_restarts"] for m in metrics] == [0.0, 1.0]
    assert all("eval/hard/accuracy" in m for m in metrics)


def test_a_reasoning_gym_set_reports_each_dataset(tiny_task):
    """A set drawn from reasoning-gym: val_size rows from val_seed, each row's source is the
    dataset that made it, maj@k votes on the <answer> its reward reads."""
    gym = (
        "{source: reasoning_gym, reward: reasoning_gym, size: 10, reasoning_gym: {datasets: "
        "[{name: chain_sum, config: {min_terms: 2, max_terms: 2}}, {name: basic_arithmetic}], "
        "val_size: 12}}"
    )
    cfg = load_config(
        None,
        [
            f"model.path={tiny_task['model']}",
            "data.max_prompt_length=4096",  # (the tiny tokenizer spells words out)
            f"data.val_sets={{gym: {gym}}}",
        ],
    )
    sets = load_val_sets(cfg)
    try:
        (s,) = sets.values()
        assert s.name == "gym" and len(s.ds) == 12 and s.rows == list(range(10))
        assert s.reward == "reasoning_gym" and s.scorer.spec == "reasoning_gym"
        rows = [s.ds[i]["row"] for i in s.rows]
        assert s.sources == [r["metadata"]["source_dataset"] for r in rows]
        assert set(s.sources) == {"chain_sum", "basic_arithmetic"}
        assert s.answer("so <answer> 12 </answer>", rows[0]) == "12"
        assert s.answer("no tag", rows[0]) == ""
    finally:
        close_sets(sets)


def test_a_step_is_logged_once_its_evaluation_is_in_and_steps_stay_in_order():
    """HeldRecords holds a step's record while its evaluation runs beside training, and the
    records after it; they go out, in order, with the evaluation's metrics in its step."""
    from treadle.trainers.base import HeldRecords

    class Logged:
        def __init__(self) -> None:
            self.lines: list[tuple[str, int, object]] = []

        def log(self, step, metrics):  # type: ignore[no-untyped-def]
            self.lines.append(("log", step, dict(metrics)))

        def log_table(self, step, name, rows):  # type: ignore[no-untyped-def]
            self.lines.append((name, step, rows))

    running: set[int] = set()
    arrived: dict[int, dict[str, float]] = {}

    def late(wait: bool) -> dict[int, dict[str, float]]:
        out = dict(arrived)
        arrived.clear()
        return out

    tracker = Logged()
    held = HeldRecords(tracker, late, lambda: set(running))  # type: ignore[arg-type]
    held.add((1, {"reward/mean": 0.1}, []), wait=False)
    running.add(2)  # step 2's evaluation was sent
    held.add((2, {"reward/mean": 0.2}, [{"prompt": "p"}]), wait=False)
    held.add((3, {"reward/mean": 0.3}, []), wait=False)
    assert tracker.lines == [("log", 1, {"reward/mean": 0.1})]  # 2 and 3 wait for it
    running.clear()
    arrived[2] = {"eval/val/accuracy": 0.5}
    held.add((4, {"reward/mean": 0.4}, []), wait=False)
    assert tracker.lines[1:] == [
        ("log", 2, {"reward/mean": 0.2, "eval/val/accuracy": 0.5}),
        ("samples", 2, [{"prompt": "p"}]),
        ("log", 3, {"reward/mean": 0.3}),
        ("log", 4, {"reward/mean": 0.4}),
    ]
    assert held.held == []
    # a run that stops while an evaluation runs logs the held steps without it
    running.add(5)
    held.add((5, {"reward/mean": 0.5}, []), wait=False)
    assert tracker.lines[-1][1] == 4
    held.flush_all()
    assert tracker.lines[-1] == ("log", 5, {"reward/mean": 0.5}) and held.held == []


def test_a_reward_that_fails_names_the_data_row_of_its_sample(tmp_path):
    """'failed on sample 1' is a place in the batch: the message also names the sample's data
    row (its uid, `<file>:<row>`), where the bad ground truth or prompt is."""
    from treadle.rewards import Scorer
    from treadle.runtime.errors import RewardError
    from treadle.trainers.evaluation import rule_scores

    (tmp_path / "picky.py").write_text(
        "def score(prompt, response, ground_truth):\n    return float(int(ground_truth))\n"
    )
    batch = Batch.from_dict(
        objects={
            "prompt_text": ["1+1?", "2+2?", "3+3?"],
            "response_text": ["2", "4", "6"],
            "ground_truth": ["2", "four", "6"],
            "uid": ["train.jsonl:7", "train.jsonl:9", "train.jsonl:12"],
        }
    )
    with Scorer(f"{tmp_path / 'picky.py'}:score") as scorer, pytest.raises(RewardError) as error:
        rule_scores(scorer, batch)
    message = str(error.value)
    assert "failed on sample 1: raised ValueError" in message
    assert message.endswith("; its data row: train.jsonl:9")
