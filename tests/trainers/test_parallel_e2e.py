"""GRPO end to end with 2 actor ranks in one tensor- or sequence-parallel group: two steps,
and the run resumed from its step-1 checkpoint redoes step 2 exactly."""

from __future__ import annotations

import shutil

import pytest
import tiny_runs
import torch
from safetensors.torch import load_file

from treadle.config import load_config
from treadle.tracking.tracker import read_metrics
from treadle.trainers.rl import train


def grpo_config(model, task, out, reward, layout: str):
    return load_config(
        None,
        tiny_runs.overrides(
            task,
            out,
            f"model.path={model}",  # in place of the task's model
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=12",
            "actor.world_size=2",
            layout,
            "actor.lr=1e-3",
            "actor.micro_batch_size=4",
            "actor.pack_row_tokens=32",
            "algorithm.kl_coef=0.01",  # the reference is split the same way
            f"reward.function={reward}",
            "reward.num_workers=0",  # scored in the driver: no reward processes to start
            "trainer.total_steps=2",
            "trainer.save_every=1",
            "trainer.keep_last=2",
            samples=4,
        ),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        # the optimizer state of 2-D (data x tensor) DTensors is gathered and put back
        "actor.tensor_parallel_size=2",
        # sequence parallel shards parameters as plain FSDP2 does, over both ranks of its group
        "actor.sequence_parallel_size=2",
    ],
)
def test_grpo_two_steps_then_exact_resume(
    layout, parallel_model, tiny_task, length_reward, ray_session, tmp_path
):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(grpo_config(parallel_model, tiny_task, straight, length_reward, layout))
    metrics = read_metrics(straight)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    # The rollout samples from the weights the split actor trained (gathered into each
    # replica after step 1): its log-probs are the actor's own, to float32 rounding.
    assert all(m["rollout/logprob_diff_max"] < 1e-4 for m in metrics)
    before = load_file(str(parallel_model / "model.safetensors"))
    after = load_file(str(straight / "final_model" / "model.safetensors"))
    assert after.keys() == before.keys()  # an ordinary unsharded HF folder
    assert all(after[k].shape == before[k].shape for k in before)
    assert all(not torch.equal(after[k], before[k]) for k in before)
    # Interrupted after step 1: the same command resumes from step_1 and redoes step 2.
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_2")
    shutil.rmtree(resumed / "final_model")
    train(grpo_config(parallel_model, tiny_task, resumed, length_reward, layout))
    again = load_file(str(resumed / "final_model" / "model.safetensors"))
    for k in after:
        torch.testing.assert_close(again[k], after[k], rtol=1e-5, atol=1e-6)
    last = read_metrics(resumed)[-1]
    assert last["step"] == 2 and "startup/resume" in last
    for key in ("reward/mean", "actor/pg_loss", "actor/kl", "actor/grad_norm"):
        assert last[key] == pytest.approx(metrics[-1][key], rel=1e-5, abs=1e-7), key
