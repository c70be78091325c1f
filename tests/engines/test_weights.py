"""Weights on their way to a rollout engine: cast where they are (CastTensors, the colocated
path), and as safetensors buckets (the split path and vLLM's loader)."""

from __future__ import annotations

import torch
from safetensors.torch import load

from treadle.engines.weights import CastTensors, weight_buckets


def named() -> list[tuple[str, torch.Tensor]]:
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    return [("a", w), ("b", w), ("steps", torch.arange(3)), ("lm_head.weight", w)]


def test_cast_tensors_casts_floats_skips_names_and_counts_bytes():
    tensors = CastTensors(named(), torch.bfloat16, frozenset({"lm_head.weight"}))
    out = dict(tensors)
    assert list(out) == ["a", "b", "steps"]
    assert (out["a"].dtype, out["steps"].dtype) == (torch.bfloat16, torch.int64)
    assert torch.equal(out["a"], named()[0][1].bfloat16())
    assert tensors.bytes == 2 * (12 * 2) + 3 * 8  # two bf16 [4, 3], three int64


def test_buckets_hold_the_same_tensors_and_tied_ones_apart():
    out: dict[str, torch.Tensor] = {}
    for payload in weight_buckets(named(), 1 << 20, torch.bfloat16, frozenset({"lm_head.weight"})):
        out.update(load(payload))
    assert sorted(out) == ["a", "b", "steps"]
    assert torch.equal(out["a"], out["b"]) and out["a"].dtype == torch.bfloat16
    small = list(weight_buckets(named(), 1, None))  # a bucket a tensor at 1 byte
    assert len(small) == 4
