"""Every command for 2 steps on one CUDA GPU, in bf16 mixed precision and in pure bf16: the runs
of tests/command_runs.py (the CPU's device guard, tests/test_devices.py, runs them too).

That a run computed on the GPU is in its metrics: the local backend logs each step's peak
device memory (``perf/max_memory_allocated_gib``), which a CPU run does not have."""

from __future__ import annotations

import math

import pytest
import torch
from command_runs import CASES, argv
from gpu_runs import GPU, PRECISIONS
from safetensors.torch import load_file

from treadle.cli import main
from treadle.engines.flops import peak_tflops
from treadle.tracking.tracker import read_metrics

pytestmark = GPU

TRAINS = {name for name, case in CASES.items() if case.command != "eval"}
# the runs whose every weight tensor moves in 2 steps (float32 weights; LoRA moves its target
# layers only; a reward model's weights are another model's)
ALL_MOVE = TRAINS - {"lora", "rm"}


def weights(folder) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", list(CASES))
def test_a_command_runs_two_steps_on_the_gpu(
    name, precision, tiny_task, teacher_model, tmp_path, capsys
):
    out = tmp_path / "run"
    code = main(argv(name, tiny_task, out, *PRECISIONS[precision], teacher=teacher_model, steps=2))
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    if name == "eval":  # eval.n=2: pass@2 and the others of n samples
        assert "eval/val/pass@2" in printed.out
        return
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    known_peak = peak_tflops(torch.device("cuda")) is not None
    for m in metrics:
        assert m["perf/max_memory_allocated_gib"] > 0  # it ran on the GPU
        rates = {k: v for k, v in m.items() if k.startswith("perf/mfu/")}
        assert bool(rates) == known_peak and all(0 < v < 1 for v in rates.values()), rates
        assert m["perf/max_memory_reserved_gib"] >= m["perf/max_memory_allocated_gib"]
        losses = {k: v for k, v in m.items() if k.endswith(("loss", "grad_norm", "/kl", "jsd"))}
        assert losses and all(math.isfinite(v) for v in losses.values()), losses
        assert any(v > 0 for k, v in m.items() if k.endswith("grad_norm"))
    before, after = weights(tiny_task["model"]), weights(out / "final_model")
    common = before.keys() & after.keys()
    changed = [k for k in common if not torch.equal(before[k].float(), after[k].float())]
    assert changed, "no weight moved"
    if name in ALL_MOVE and precision == "bf16_mixed":
        assert len(changed) == len(before), sorted(set(before) - set(changed))
