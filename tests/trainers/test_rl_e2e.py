"""The whole RL dataflow end to end on a tiny model: Ray with 2 FSDP ranks, and local mode.
vLLM in 2 FSDP ranks, synced after every update: rollout/test_fleet.py."""

from __future__ import annotations

import itertools
import json

import pytest
import tiny_runs
import torch
from safetensors.torch import load_file

from treadle.config import load_config
from treadle.tracking.tracker import read_metrics
from treadle.trainers.rl import train

REQUIRED = {
    "step",
    "reward/mean",
    "response/length_mean",
    "actor/pg_loss",
    "actor/kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/clip_frac",
    "timing/step",
    "timing/generate",
    "timing/update_actor",
    "throughput/tokens_per_s",
    "perf/tflops/actor",  # the update's model FLOP rate (local, or the Ray ranks' mean)
}


def grpo_config(task, out, *overrides: str):
    return load_config(
        None,
        tiny_runs.overrides(
            task,
            out,
            f"data.val_files=[{task['test']}]",
            "data.max_prompt_length=64",
            "data.val_size=8",
            "rollout.max_new_tokens=16",
            "actor.lr=1e-3",
            "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size=4",
            "algorithm.kl_coef=0.01",
            "trainer.total_steps=2",
            "trainer.save_every=1",
            *overrides,
            prompts=4,
            samples=4,
        ),
    )


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def profiled(out) -> dict[str, set[str]]:
    """The profiled steps' folders, each with the processes that wrote a trace and a table."""
    found: dict[str, set[str]] = {}
    for trace in sorted(out.glob("profile/step_*/*.json.gz")):
        assert trace.with_name(trace.name.removesuffix(".json.gz") + ".txt").is_file()
        found.setdefault(trace.parent.name, set()).add(trace.name.removesuffix(".json.gz"))
    return found


def check_run(task, out, steps: int) -> list[dict]:
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert m.keys() >= REQUIRED, REQUIRED - m.keys()
        assert 0.0 < m["reward/mean"] < 1.0
        assert 1.0 <= m["response/length_mean"] <= 16.0
        assert m["actor/grad_norm"] > 0
        assert m["perf/tflops/actor"] > 0 and "perf/mfu/actor" not in m  # (a CPU: no peak)
    assert (out / "config.yaml").is_file()
    assert (out / f"checkpoints/step_{steps}/state.json").is_file()
    assert json.loads((out / f"checkpoints/step_{steps}/state.json").read_text())["step"] == steps
    before, after = weights(task["model"]), weights(out / "final_model")
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), f"unchanged: {set(before) - set(changed)}"
    return metrics


@pytest.mark.slow
def test_grpo_ray_two_ranks_then_resume(tiny_task, ray_session, length_reward, tmp_path):
    out = tmp_path / "run"
    ray2 = ("actor.world_size=2", f"reward.function={length_reward}")
    train(grpo_config(tiny_task, out, *ray2, "trainer.profile_steps=[2]"))
    check_run(tiny_task, out, 2)
    # the profiled step: the driver's own part, and each rank's methods
    assert profiled(out) == {"step_2": {"driver", "actor-rank0", "actor-rank1"}}
    for rank in (0, 1):
        table = (out / f"profile/step_2/actor-rank{rank}.txt").read_text()
        # the method's range, and the colocated engine's steps
        assert "treadle/actor.update_actor" in table and "treadle/engine_step" in table
    assert not list((out / "checkpoints").glob("*.tmp"))
    # The same command with more steps resumes from step 2 instead of starting over.
    train(grpo_config(tiny_task, out, *ray2, "trainer.total_steps=3"))
    metrics = check_run(tiny_task, out, 3)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert metrics[-1]["step"] == 3


@pytest.mark.slow
def test_grpo_local_backend_resume_is_deterministic(tiny_task, length_reward, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    local = (
        "trainer.backend=local",
        "trainer.eval_every=3",
        "algorithm.rollout_correction=tis",  # truncated IS on: the worker path runs
        "algorithm.kl_reward_coef=0.05",  # adaptive KL in the reward: its state must resume
        "algorithm.kl_target=0.001",
        "algorithm.kl_horizon=20",
        f"reward.function={length_reward}",
    )
    # the straight run's step 2 profiled: the same numbers
    train(
        grpo_config(
            tiny_task, straight, *local, "trainer.total_steps=3", "trainer.profile_steps=[2]"
        )
    )
    train(grpo_config(tiny_task, resumed, *local, "trainer.total_steps=2"))
    train(grpo_config(tiny_task, resumed, *local, "trainer.total_steps=3"))
    a, b = check_run(tiny_task, straight, 3), check_run(tiny_task, resumed, 3)
    # the first step of each process reports its start-up, split into parts; no other step
    parts = {"data", "workers", "workers/actor_model", "workers/reference_model", "rollout"}
    for first, later in ((a[0], a[1:]), (b[0], [b[1]]), (b[2], [])):
        assert first["timing/startup"] > 0 and {f"startup/{p}" for p in parts} <= first.keys()
        assert all("timing/startup" not in m for m in later)
    assert "startup/resume" in b[2] and "startup/resume" not in b[0]
    for key in (
        "reward/mean",
        "actor/pg_loss",
        "actor/kl",
        "response/length_mean",
        "actor/reward_kl",
        "actor/reward_kl_coef",
    ):
        assert b[-1][key] == pytest.approx(a[-1][key], rel=1e-5, abs=1e-7), key
    # The adaptive coefficient moved by the rule β ← β (1 + clip(KL/target - 1, ±0.2) n/H).
    for prev, cur in itertools.pairwise(a):
        error = min(max(prev["actor/reward_kl"] / 0.001 - 1, -0.2), 0.2)
        want = prev["actor/reward_kl_coef"] * (1 + error * 16 / 20)
        assert cur["actor/reward_kl_coef"] == pytest.approx(want, rel=1e-6)
    assert a[-1]["actor/reward_kl_coef"] != 0.05
    assert 0.0 <= a[-1]["eval/val/accuracy"] <= 1.0
    # one process: the driver's profile holds the whole step (generation and the update)
    assert profiled(straight) == {"step_2": {"driver"}} and not profiled(resumed)
    table = (straight / "profile/step_2/driver.txt").read_text()
    phases = ("generate", "engine_step", "reward", "update_actor")
    assert all(f"treadle/{p}" in table for p in phases)
    wa, wb = weights(straight / "final_model"), weights(resumed / "final_model")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_worker_side_config_error_reaches_driver_as_itself(tiny_task, ray_session, tmp_path):
    """A model folder without weights fails inside the Ray workers; the driver sees the
    ConfigError naming model.path, not "the actor died"."""
    import shutil

    from treadle.runtime.errors import ConfigError

    broken = tmp_path / "no_weights"
    shutil.copytree(tiny_task["model"], broken)
    (broken / "model.safetensors").unlink()
    cfg = grpo_config(
        tiny_task,
        tmp_path / "run",
        "actor.world_size=2",
        f"model.path={broken}",
        f"model.tokenizer_path={tiny_task['model']}",
    )
    with pytest.raises(ConfigError, match=r"model\.path: .* no \*\.safetensors weights"):
        train(cfg)
