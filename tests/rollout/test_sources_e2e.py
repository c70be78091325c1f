"""The asynchronous modes end to end: Ray, a split vLLM replica, the tiny model.

Async with ``max_staleness: 0`` draws, samples and trains exactly what sync does (same rewards,
lengths and losses step by step); one_step_off trains each step on samples one version behind
the learner; an async run with partial rollouts killed with SIGKILL after a checkpoint is
completed by running the same command again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from treadle.config import load_config
from treadle.trainers.rl import RLTrainer

pytestmark = pytest.mark.slow


def _overrides(task, out, reward, *extra: str) -> list[str]:
    return [
        f"reward.function={reward}",
        f"model.path={task['model']}",
        f"data.train_files=[{task['train']}]",
        "data.val_files=[]",
        "data.batch_size=4",
        "data.max_prompt_length=64",
        "rollout.n=4",
        "rollout.max_new_tokens=16",
        "rollout.engine=vllm",
        "rollout.placement=split",
        "actor.lr=5e-3",
        "actor.ppo_mini_batch_size=16",
        "actor.micro_batch_size=8",
        "algorithm.kl_coef=0",
        "trainer.num_cpus=2",
        "trainer.progress=false",
        "trainer.total_steps=3",
        f"trainer.output_dir={out}",
        *extra,
    ]


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_async_with_no_staleness_trains_exactly_what_sync_trains(
    tiny_task, length_reward, tmp_path, ray_session
):
    runs = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        extra = [f"trainer.mode={mode}", "async.max_staleness=0"]
        RLTrainer(load_config(None, _overrides(tiny_task, out, length_reward, *extra))).fit()
        runs[mode] = _metrics(out)
    keys = ("reward/mean", "response/length_mean", "generated_tokens", "rollout/weight_version")
    for sync, async_ in zip(runs["sync"], runs["async"], strict=True):
        assert {k: sync.get(k) for k in keys} == {k: async_.get(k) for k in keys}
        assert async_["actor/pg_loss"] == pytest.approx(sync["actor/pg_loss"], abs=1e-6)
        assert async_["async/staleness_max"] == 0 and async_["async/dropped"] == 0
    assert [m["rollout/weight_version"] for m in runs["async"]] == [0, 1, 2]


def test_one_step_off_trains_on_samples_one_version_old(
    tiny_task, length_reward, tmp_path, ray_session
):
    out = tmp_path / "run"
    cfg = load_config(None, _overrides(tiny_task, out, length_reward, "trainer.mode=one_step_off"))
    RLTrainer(cfg).fit()
    metrics = _metrics(out)
    # step 1 takes version 0 (nothing older exists); later steps the batch of the step before
    assert [m["async/staleness_max"] for m in metrics] == [0, 1, 1]
    assert [m["rollout/weight_version"] for m in metrics] == [0, 0, 1]
    assert all(0 <= m["async/trainer_idle_frac"] <= 1 for m in metrics)
    assert all(0 <= m["async/rollout_idle_frac"] <= 1 for m in metrics)


def test_an_async_run_killed_with_sigkill_is_completed_by_running_it_again(
    tiny_task, length_reward, tmp_path
):
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "treadle.cli",
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
    done = subprocess.run(args, check=False, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout + done.stderr
    state = json.loads((out / "checkpoints" / "step_5" / "state.json").read_text())
    assert state["step"] == 5 and "async" in state
    assert [m["step"] for m in _metrics(out)] == [1, 2, 3, 4, 5]  # steps redone: once
    for m in _metrics(out):
        assert m["async/staleness_max"] <= 2
    assert (out / "final_model" / "model.safetensors").is_file()
