"""One actor step on the GPU against the same step on the CPU: the same fixed batch and weights
(gpu_runs.step_outputs: the old-policy pass, then GRPO's loss with a KL term and an entropy
bonus), the CPU's in a process that sees no GPU. Log-probs, entropy, the loss's terms and every
parameter's gradient agree: to float32's rounding in float32, to bf16's in bf16 mixed
precision (where the two devices' kernels sum in other orders)."""

from __future__ import annotations

import pytest
import torch
from gpu_runs import GPU, on_cpu, step_outputs
from safetensors.torch import load_file

pytestmark = GPU

TOLERANCE = {False: 2e-4, True: 3e-2}  # float32; bf16 mixed precision


@pytest.mark.parametrize("mixed", [False, True], ids=["float32", "bf16_mixed"])
def test_a_gpu_step_is_the_cpu_step(tiny_task, tmp_path, mixed):
    model, train = str(tiny_task["model"]), str(tiny_task["train"])
    result = tmp_path / "cpu.safetensors"
    args = ["tests/gpu/gpu_runs.py", "step", model, train, str(tmp_path / "cpu"), str(int(mixed))]
    cpu = on_cpu([*args, str(result)])
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    want = load_file(result)
    got = step_outputs(model, train, tmp_path / "gpu", mixed)
    assert got.keys() == want.keys()
    tol = TOLERANCE[mixed]
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=tol * 2)
    for key in ("actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm"):
        assert float(got[key]) == pytest.approx(float(want[key]), rel=tol, abs=1e-6), key
    grads = [k for k in want if k.startswith("grad/")]
    assert len(grads) > 10
    for key in grads:
        scale = float(want[key].abs().max())
        torch.testing.assert_close(got[key], want[key], rtol=tol, atol=tol * scale, msg=key)
