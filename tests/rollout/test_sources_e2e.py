"""The asynchronous modes end to end: Ray, a split replica, the tiny model. The runs with partial
rollouts (a request cut at a weight sync and continued) use vLLM; the others the transformers
engine (HF), which starts faster and serves the source the same way.

Async with ``max_staleness: 0`` draws, samples and trains exactly what sync does (same rewards,
lengths and losses step by step); one_step_off trains each step on samples one version behind
the learner; an async run with partial rollouts killed with SIGKILL after a checkpoint is
completed by running the same command again; at max_staleness 1, a step-batch that finishes
after the next one is trained by ``async.admission: bounded`` (``drop``, which drops it, is
tests/rollout/test_sources.py's, on a fake rollout).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest
import tiny_runs

from treadle.cli import main
from treadle.config import load_config
from treadle.trainers.rl import RLTrainer

pytestmark = pytest.mark.slow


def _overrides(task, out, reward, *extra: str) -> list[str]:
    """A split vLLM replica unless ``extra`` names another engine (it comes last)."""
    return tiny_runs.overrides(
        task,
        out,
        f"reward.function={reward}",
        "data.val_files=[]",
        "data.max_prompt_length=64",
        "rollout.max_new_tokens=16",
        "rollout.engine=vllm",
        "rollout.placement=split",
        "actor.lr=5e-3",
        "actor.micro_batch_size=8",
        "trainer.num_cpus=2",
        "trainer.total_steps=3",
        *extra,
        prompts=4,
        samples=4,
    )


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_async_with_no_staleness_trains_exactly_what_sync_trains(
    tiny_task, length_reward, tmp_path, ray_session
):
    runs = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        extra = [f"trainer.mode={mode}", "async.max_staleness=0", "rollout.engine=hf"]
        if mode == "sync":  # its step 2 profiled, the split replica's process too
            extra.append("trainer.profile_steps=[2]")
        RLTrainer(load_config(None, _overrides(tiny_task, out, length_reward, *extra))).fit()
        runs[mode] = _metrics(out)
    step = tmp_path / "sync/profile/step_2"
    assert sorted(p.name for p in step.iterdir()) == [
        f"{name}.{kind}"
        for name in ("actor-rank0", "driver", "rollout-replica-0")
        for kind in ("json.gz", "txt")
    ]
    assert "treadle/engine_step" in (step / "rollout-replica-0.txt").read_text()
    assert "treadle/engine_step" not in (step / "actor-rank0.txt").read_text()  # split
    keys = ("reward/mean", "response/length_mean", "generated_tokens", "rollout/weight_version")
    for sync, async_ in zip(runs["sync"], runs["async"], strict=True):
        assert {k: sync.get(k) for k in keys} == {k: async_.get(k) for k in keys}
        assert async_["actor/pg_loss"] == pytest.approx(sync["actor/pg_loss"], abs=1e-6)
        assert async_["async/staleness_max"] == 0 and async_["async/dropped"] == 0
    assert [m["rollout/weight_version"] for m in runs["async"]] == [0, 1, 2]


def test_one_step_off_trains_one_version_behind_and_evaluates_beside_training(
    tiny_task, length_reward, tmp_path, ray_session, monkeypatch
):
    """one_step_off trains each step on samples one version behind the learner. Evaluated at
    steps 2 and 3: step 2's evaluation may not send a request before step 3's update is done
    (an event set then), so it finishes only if the trainer went on without waiting for it;
    every token it evaluated comes from version 2, and its metrics are logged with step 2."""
    from treadle.trainers import rl

    step3_updated = threading.Event()
    sent: list[bool] = []  # per evaluation: whether step 3 was updated before its requests
    outs: list[dict] = []
    real = rl.agenerate_sets

    async def gated(rollout, sets, params):  # type: ignore[no-untyped-def]
        if not outs and not sent:  # step 2's evaluation
            sent.append(await asyncio.to_thread(step3_updated.wait, 300))
        else:
            sent.append(step3_updated.is_set())
        out = await real(rollout, sets, params)
        outs.append(out)
        return out

    monkeypatch.setattr(rl, "agenerate_sets", gated)
    out = tmp_path / "run"
    extra = [
        "trainer.mode=one_step_off",
        "rollout.engine=hf",
        f"data.val_files=[{tiny_task['test']}]",
        "data.val_size=8",
        "trainer.eval_every=2",
        "eval.n=2",
        "eval.temperature=1.0",
    ]
    trainer = RLTrainer(load_config(None, _overrides(tiny_task, out, length_reward, *extra)))
    running: dict[int, set[int]] = {}  # at each update: the steps whose evaluation runs
    after_update = trainer.source.after_update

    def updated(step: int) -> dict[str, float]:
        running[step] = trainer.source.evaluating()
        if step == 3:
            step3_updated.set()
        return after_update(step)

    trainer.source.after_update = updated  # type: ignore[method-assign]
    final = trainer.fit()
    assert sent == [True, True]  # step 2's evaluation waited for step 3's update: it overlapped
    assert running == {1: set(), 2: set(), 3: {2}}
    metrics = _metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # step 1 takes version 0 (nothing older exists); later steps the batch of the step before
    assert [m["async/staleness_max"] for m in metrics] == [0, 1, 1]
    assert [m["rollout/weight_version"] for m in metrics] == [0, 0, 1]
    assert all(0 <= m["async/trainer_idle_frac"] <= 1 for m in metrics)
    assert all(0 <= m["async/rollout_idle_frac"] <= 1 for m in metrics)
    assert not [k for k in metrics[0] if k.startswith("eval/")]
    for step, m, batches in ((2, metrics[1], outs[0]), (3, metrics[2], outs[1])):
        assert m["eval/weight_version"] == step  # logged with its step, on that step's weights
        for batch in batches.values():
            tokens = batch["token_versions"][batch["token_versions"] >= 0]
            assert set(tokens.tolist()) == {step}
            assert set(batch["weight_version"].tolist()) == {step}
        assert {"eval/val/accuracy", "eval/val/pass@2", "eval/val/maj@2"} <= m.keys()
    assert metrics[2]["async/eval_wait"] >= 0  # the sync after step 3 waited for step 2's
    assert final["eval/val/accuracy"] == metrics[2]["eval/val/accuracy"]


def test_a_checkpoint_ranked_by_its_evaluation_waits_for_the_one_beside_training(
    tiny_task, length_reward, tmp_path, ray_session
):
    """one_step_off with trainer.keep_best: each save step waits for its own evaluation (which
    runs beside training), so every checkpoint records it and the best one is kept."""
    out = tmp_path / "run"
    extra = [
        "trainer.mode=one_step_off",
        "rollout.engine=hf",
        f"data.val_files=[{tiny_task['test']}]",
        "data.val_size=8",
        "trainer.total_steps=2",
        "trainer.eval_every=1",
        "trainer.save_every=1",
        "trainer.keep_last=1",
        "trainer.keep_best=eval/val/reward",
    ]
    RLTrainer(load_config(None, _overrides(tiny_task, out, length_reward, *extra))).fit()
    logged = {m["step"]: m["eval/val/reward"] for m in _metrics(out)}
    assert set(logged) == {1, 2}
    kept = sorted((out / "checkpoints").iterdir())
    best = max(logged, key=lambda s: (logged[s], -s))  # a tie keeps the earlier
    assert [p.name for p in kept] == sorted({f"step_{best}", "step_2"})
    for path in kept:
        state = json.loads((path / "state.json").read_text())
        step = int(path.name.removeprefix("step_"))
        assert state["eval"]["eval/val/reward"] == logged[step]


@pytest.mark.slow
@pytest.mark.long
def test_an_async_run_killed_with_sigkill_is_completed_by_running_it_again(
    tiny_task, length_reward, tmp_path, ray_session, capsys
):
    """The command killed is a process of its own (its Ray, its replica); the same command
    run again here, in this process, joins the session's Ray (one Ray start fewer)."""
    out = tmp_path / "run"
    command = [
        "train",
        "examples/arithmetic/grpo.yaml",
        *_overrides(tiny_task, out, length_reward),
        "trainer.mode=async",
        "async.max_staleness=2",
        "async.partial_rollout=true",
        "algorithm.rollout_correction=tis",
        "trainer.total_steps=5",
        "trainer.save_every=1",
    ]
    args = [sys.executable, "-m", "treadle", *command]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / "step_2" / "state.json").is_file():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "step 2 was not saved"
            time.sleep(0.2)
        proc.kill()  # SIGKILL: nothing is cleaned up
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    capsys.readouterr()
    code = main(command)
    done = capsys.readouterr()
    assert code == 0, done.err[-3000:]
    assert "resumed from" in done.out + done.err
    state = json.loads((out / "checkpoints" / "step_5" / "state.json").read_text())
    assert state["step"] == 5 and "async" in state
    assert [m["step"] for m in _metrics(out)] == [1, 2, 3, 4, 5]  # steps redone: once
    for m in _metrics(out):
        assert m["async/staleness_max"] <= 2
    assert (out / "final_model" / "model.safetensors").is_file()


def test_async_at_max_staleness_one_waits_for_the_step_batch_dropping_would_lose(
    tiny_task, length_reward, tmp_path, ray_session
):
    """Step-batch 2 is held back until the trainer has looked at a buffer holding step-batch 3
    (the slow prompts of a real run): bounded admission (the default) waits for it and drops
    nothing. Where ``async.admission: drop`` trains step-batch 3 at step 2 and drops step-batch 2
    instead: tests/rollout/test_sources.py, on a fake rollout (the same source and policy)."""
    from treadle.rollout.sources import Admission

    out = tmp_path / "run"
    extra = [
        "trainer.mode=async",
        "async.max_staleness=1",
        "async.partial_rollout=true",
        "async.admission=bounded",
    ]
    cfg = load_config(None, _overrides(tiny_task, out, length_reward, *extra))
    trainer = RLTrainer(cfg)
    source = trainer.source
    looked = asyncio.Event()
    real = source.rollout.agenerate

    async def second_after_third(prompts, params, count=True):  # type: ignore[no-untyped-def]
        batch = await real(prompts, params, count)
        if params.seed == cfg.trainer.seed * 100_003 + 2:
            await looked.wait()
        return batch

    class Watched(Admission):
        def ready(self, buffer, count, flying) -> bool:  # type: ignore[no-untyped-def]
            if any(g.step == 3 for g in buffer):
                looked.set()
            return super().ready(buffer, count, flying)

    source.rollout.agenerate = second_after_third
    a = source.admission
    assert a.bounded  # what the run was configured with reached the source
    source.admission = Watched(a.bounded, a.max_staleness, a.batch_size)
    trainer.fit()
    metrics = _metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert looked.is_set()  # step-batch 3 was in the buffer while step-batch 2 was held back
    assert [m["async/dropped"] for m in metrics] == [0, 0, 0]
    assert metrics[-1]["async/dropped_total"] == 0
    assert [m["rollout/weight_version"] for m in metrics] == [0, 0, 1]
    assert all(m["async/staleness_max"] <= 1 for m in metrics)
