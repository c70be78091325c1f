"""A profiled step on the GPU (``trainer.profile_steps``): the table adds the device's kernels
and, for each ``treadle/`` range, the device's work that began in it; in a GRPO run too."""

from __future__ import annotations

import torch
from command_runs import argv
from gpu_runs import GPU, PRECISIONS

from treadle.cli import main
from treadle.tracking.profiler import StepProfile, phase

pytestmark = GPU


def test_the_table_shows_the_device_work_of_each_range(tmp_path):
    a = torch.randn(2048, 2048, device="cuda")
    torch.tanh(a @ a)  # cuBLAS starts outside the profile (its first call takes ~0.1 s)
    torch.cuda.synchronize()
    profile = StepProfile(tmp_path, "driver")
    assert profile.device == "cuda"
    profile.start()
    with phase("update_actor"):
        for _ in range(20):
            a = torch.tanh(a @ a)
        torch.cuda.synchronize()
    with phase("generate"):  # no device work: a range of the CPU's time alone
        sum(range(100_000))
    profile.stop()
    text = (tmp_path / "driver.txt").read_text()
    assert "profiled on the cuda" in text and "the device: the 30 kernels" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    # range, calls, wall s, device s, busy: 20 products of 17 GFLOP keep the device busy
    update, generate = rows["treadle/update_actor"], rows["treadle/generate"]
    assert update[1] == "1" and float(update[3]) > 0 and int(update[4].rstrip("%")) >= 50
    assert generate[3] == "0.000" and generate[4] == "0%"
    kernels = text.split("the device:")[1].split("the CPU:")[0]
    assert "gemm" in kernels.lower() or "cutlass" in kernels.lower() or "sm90" in kernels


def test_a_profiled_grpo_step_shows_its_phases_device_work(tiny_task, teacher_model, tmp_path):
    """``trainer.profile_steps`` in a GRPO run on the GPU (local backend, bf16 mixed): the
    driver's table has the kernels, and the generation and the update each began device
    work."""
    out = tmp_path / "run"
    extra = (*PRECISIONS["bf16_mixed"], "trainer.profile_steps=[2]")
    assert main(argv("grpo", tiny_task, out, *extra, teacher=teacher_model, steps=2)) == 0
    text = (out / "profile/step_2/driver.txt").read_text()
    assert "profiled on the cuda" in text and "the device: the 30 kernels" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    for name in ("treadle/generate", "treadle/update_actor", "treadle/engine_step"):
        assert float(rows[name][3]) > 0, rows[name]  # device seconds begun in the range
