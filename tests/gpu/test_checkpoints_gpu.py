"""Checkpoints on the GPU: a resumed run is the run that did not stop, and a checkpoint written
on the GPU goes on on the CPU and back (the weights, the optimizer's state, the RNG and the
driver's state are device-free files)."""

from __future__ import annotations

import pytest
import torch
from command_runs import argv
from gpu_runs import GPU, on_cpu
from safetensors.torch import load_file

from treadle.cli import main
from treadle.tracking.tracker import read_metrics

pytestmark = GPU

MEMORY = "perf/max_memory_allocated_gib"  # logged by a run that computes on the GPU


@pytest.fixture
def deterministic():
    """cuBLAS and torch's kernels deterministic where they can be (warn elsewhere): two runs
    of the same steps then give the same numbers, atomics' order aside."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def test_resume_on_the_gpu_is_the_run_that_did_not_stop(tiny_task, tmp_path, deterministic):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    keys = ("trainer.save_every=1", "trainer.eval_every=0", "algorithm.rollout_correction=tis")
    assert main(argv("grpo", tiny_task, straight, *keys, steps=3)) == 0
    assert main(argv("grpo", tiny_task, resumed, *keys, steps=2)) == 0
    assert main(argv("grpo", tiny_task, resumed, *keys, steps=3)) == 0
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    assert "startup/resume" in b[2] and MEMORY in b[2]
    for key in ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/kl"):
        assert b[2][key] == pytest.approx(a[2][key], rel=1e-5, abs=1e-7), key
    wa = load_file(straight / "final_model" / "model.safetensors")
    wb = load_file(resumed / "final_model" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)


def test_a_gpu_checkpoint_goes_on_on_the_cpu_and_back(tiny_task, tmp_path):
    out = tmp_path / "run"
    keys = ("trainer.save_every=1", "trainer.eval_every=0")
    assert main(argv("grpo", tiny_task, out, *keys, steps=1)) == 0  # step 1 on the GPU
    cpu = on_cpu(["-m", "treadle", *argv("grpo", tiny_task, out, *keys, steps=2)])
    assert cpu.returncode == 0, cpu.stderr[-3000:]  # step 2 on the CPU, from step 1's files
    assert main(argv("grpo", tiny_task, out, *keys, steps=3)) == 0  # step 3 back on the GPU
    first, second, third = read_metrics(out)
    assert [first["step"], second["step"], third["step"]] == [1, 2, 3]
    assert MEMORY in first and MEMORY not in second and MEMORY in third  # GPU, CPU, GPU
    assert "startup/resume" in second and "startup/resume" in third
    for m in (first, second, third):
        assert m["actor/grad_norm"] > 0
    state = load_file(out / "checkpoints" / "step_3" / "optimizer.safetensors")
    assert state and all(torch.isfinite(t).all() for t in state.values())
