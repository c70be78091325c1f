"""transformers' sdpa attention with the CPU's bfloat16 backward in float32
(treadle.engines.attention): the same function as transformers' where it does not apply, the
float32 computation where it does, and the registry entry the training engine installs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from treadle.controller import Collect, Dispatch, Worker, WorkerGroup, register
from treadle.engines.attention import sdpa_attention, use_cpu_float32_backward
from treadle.engines.fsdp import TrainEngine
from treadle.models.loading import load_causal_lm

HEADS, KV_HEADS, LENGTH, DIM = 6, 2, 9, 8


def attention_inputs(dtype, grad):
    g = torch.Generator().manual_seed(0)
    shapes = [(2, HEADS, LENGTH, DIM), (2, KV_HEADS, LENGTH, DIM), (2, KV_HEADS, LENGTH, DIM)]
    tensors = [torch.randn(s, generator=g).to(dtype).requires_grad_(grad) for s in shapes]
    module = SimpleNamespace(is_causal=True, num_key_value_groups=HEADS // KV_HEADS)
    return module, *tensors


def test_a_bfloat16_query_with_gradients_computes_in_float32():
    module, q, k, v = attention_inputs(torch.bfloat16, grad=True)
    out, _ = sdpa_attention(module, q, k, v, None)
    assert out.dtype == torch.bfloat16
    # The reference: transformers' function on the float32 copies, its result cast back.
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, _ = sdpa_attention_forward(module, q32, k32, v32, None)
    assert torch.equal(out, ref.to(torch.bfloat16))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(g.to(torch.bfloat16))
    ref.backward(g.to(torch.bfloat16).float())
    for mine, theirs in ((q, q32), (k, k32), (v, v32)):
        assert mine.grad is not None and theirs.grad is not None
        assert mine.grad.dtype == torch.bfloat16
        assert torch.equal(mine.grad, theirs.grad.to(torch.bfloat16))


def test_an_additive_mask_is_cast_along():
    mask = torch.zeros(2, 1, LENGTH, LENGTH, dtype=torch.bfloat16)
    mask[:, :, :, 0] = float("-inf")  # nobody sees position 0 ...
    mask[:, :, 0, 0] = 0.0  # ... but itself
    mask = mask + torch.full((LENGTH, LENGTH), float("-inf")).triu(1).to(torch.bfloat16)
    module, q, k, v = attention_inputs(torch.bfloat16, grad=True)
    out, _ = sdpa_attention(module, q, k, v, mask)
    ref, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), mask.float())
    assert torch.equal(out, ref.to(torch.bfloat16))


@pytest.mark.parametrize(("dtype", "grad"), [(torch.bfloat16, False), (torch.float32, True)])
def test_elsewhere_it_is_transformers_own(dtype, grad):
    module, q, k, v = attention_inputs(dtype, grad=grad)
    out, _ = sdpa_attention(module, q, k, v, None)
    ref, _ = sdpa_attention_forward(module, q, k, v, None)
    assert out.dtype == dtype
    assert torch.equal(out, ref)


def test_installed_as_transformers_sdpa():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    use_cpu_float32_backward()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention


class EngineWorker(Worker):
    """Builds a bf16 mixed-precision training engine with transformers' own ``sdpa``
    registered first; says what ``sdpa`` is after."""

    def __init__(self, rank, world_size, addr, port, *, model_path: str) -> None:
        super().__init__(rank, world_size, addr, port)
        AttentionInterface.register("sdpa", sdpa_attention_forward)
        self.engine = TrainEngine(
            load_causal_lm(model_path), chunk_size=4, compute_dtype=torch.bfloat16
        )

    @register(Dispatch.ALL, Collect.RANK0)
    def sdpa_is_treadles(self) -> bool:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention


def test_the_training_engine_installs_it(vllm_model):
    group = WorkerGroup(
        EngineWorker, world_size=1, backend="local", kwargs={"model_path": str(vllm_model)}
    )
    try:
        assert group.sdpa_is_treadles()
    finally:
        group.shutdown()
