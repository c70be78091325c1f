"""bench/sp_attention.py's methods compute the same attention (the CPU's two; the GPU's
varlen waits for one), so its ratios compare like with like."""

from __future__ import annotations

import torch
from bench_scripts import bench_script


def test_the_masked_and_per_sequence_methods_agree():
    with bench_script("sp_attention") as bench:
        methods = bench._methods("cpu")
        assert list(methods) == ["masked", "per_sequence"]
        pos = (torch.arange(64) % 16)[None]  # four sequences of 16
        qkv = torch.randn(3, 1, 2, 64, 8, generator=torch.Generator().manual_seed(0))
        masked, per_sequence = (m(qkv, pos) for m in methods.values())
        assert masked.shape == per_sequence.shape == (1, 64, 2, 8)
        torch.testing.assert_close(per_sequence, masked)
        # the second sequence does not see the first: its first output is its own value
        torch.testing.assert_close(masked[0, 16], qkv[2, 0, :, 16])
        seconds, peak = bench.measure(methods["per_sequence"], qkv, pos, repeats=1)
        assert seconds > 0 and peak == 0.0
