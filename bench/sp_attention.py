"""Sequence parallelism's attention over one packed row: per sequence against one masked call.

    python bench/sp_attention.py [--tiny] [--device auto|cuda|cpu]

After Ulysses' all-to-all a rank holds every position of a row for its share of the heads.
Three ways to attend within each packed sequence of it, forward and backward, median of
``--repeats`` after one warm-up:

- masked: one sdpa call over the whole row with its block-diagonal causal mask (treadle until
  2026-11-30: an ``s x s`` mask, no flash kernel, the whole square computed);
- per_sequence: causal sdpa on each sequence's slice (:func:`treadle.engines.parallel.
  segment_attention`, what treadle runs now);
- varlen (CUDA only): torch's ``varlen_attn``, every sequence in one flash kernel.

A row of ``--width`` tokens holds 1, 16 or 128 equal sequences. On a GPU: bf16, 8 heads of
128, a row of 16,384 (a long-context rank's share); ``--tiny`` (the CPU's default): float32,
4 heads of 64, 2,048. Prints a table, then ``ratio sp_attention <method>/masked n=<n>: <r>``
lines (time), and on a GPU the peak memory's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from treadle.engines.attention import sdpa_attention
from treadle.engines.parallel import packed_segments, segment_attention


def _methods(device: str) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Each method: (q, k, v stacked [3, 1, heads, s, d], position ids [1, s]) -> output."""
    module: Any = nn.Module()
    module.is_causal = True  # (read by transformers' sdpa)

    def masked(qkv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        seq = (pos == 0).long().cumsum(-1)
        s = pos.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=pos.device).tril()
        mask = ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]
        q, k, v = qkv
        return sdpa_attention(module, q, k, v, mask)[0]

    def per_sequence(qkv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv
        return segment_attention(module, q, k, v, packed_segments(pos))

    methods: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "masked": masked,
        "per_sequence": per_sequence,
    }
    if device == "cuda":
        from torch.nn.attention.varlen import varlen_attn

        def varlen(qkv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            q, k, v = (t[0].transpose(0, 1).contiguous() for t in qkv)  # [s, heads, d]
            bounds = packed_segments(pos)[0]
            starts = [a for a, _ in bounds] + [pos.shape[1]]
            cu = torch.tensor(starts, dtype=torch.int32, device=pos.device)
            longest = max(e - a for a, e in bounds)
            out: Any = varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0))
            return out[None]  # [1, s, heads, d], as the others

        methods["varlen"] = varlen
    return methods


def measure(
    method: Callable[..., torch.Tensor], qkv: torch.Tensor, pos: torch.Tensor, repeats: int
) -> tuple[float, float]:
    """Median seconds of forward + backward, and the peak device memory (GiB; 0 on CPU)."""
    cuda = qkv.device.type == "cuda"
    times = []
    for i in range(repeats + 1):
        x = qkv.detach().requires_grad_(True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        method(x, pos).float().sum().backward()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return statistics.median(times), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the CPU's size (default off a GPU)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    device = (
        args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    tiny = args.tiny or device == "cpu"
    width, heads, dim = (2048, 4, 64) if tiny else (16384, 8, 128)
    dtype = torch.float32 if tiny else torch.bfloat16
    methods = _methods(device)
    print(f"one row of {width} tokens, {heads} heads of {dim}, {dtype}, {device}")
    print(f"{'sequences':>9}  " + "  ".join(f"{m:>20}" for m in methods))
    rows: dict[int, dict[str, tuple[float, float]]] = {}
    for n in (1, 16, 128):
        pos = (torch.arange(width, device=device) % (width // n))[None]
        qkv = torch.randn(3, 1, heads, width, dim, device=device, dtype=dtype)
        rows[n] = {}
        for name, method in methods.items():
            try:
                rows[n][name] = measure(method, qkv, pos, args.repeats)
            except Exception as e:  # (a method the device cannot run: named, the others go on)
                print(f"{name}, {n} sequences: {type(e).__name__}: {str(e)[:200]}")
        got = rows[n]
        cells = (
            f"{got[m][0] * 1000:9.1f} ms {got[m][1]:5.2f} GiB" if m in got else f"{'failed':>20}"
            for m in methods
        )
        print(f"{n:>9}  " + "  ".join(cells))
    for n, row in rows.items():
        for name in [m for m in row if m != "masked" and "masked" in row]:
            (t, g), (t0, g0) = row[name], row["masked"]
            print(f"ratio sp_attention {name}/masked n={n}: {t / t0:.3f}")
            if device == "cuda":
                print(f"ratio sp_attention_memory {name}/masked n={n}: {g / g0:.3f}")


if __name__ == "__main__":
    main()
