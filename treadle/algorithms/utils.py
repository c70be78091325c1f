"""Masked statistics over response-side tensors, and group sums over the samples of a prompt.

``mask`` (bool or 0/1 float, same shape as ``x``) is the single source of truth for which
positions count. Masked-out positions are *selected away* with ``torch.where`` rather than
multiplied by zero, so padding that holds ``inf``/``nan`` (e.g. log-probs of pad tokens) never
leaks into a statistic. Every function is safe for an all-zero mask: it returns 0, not NaN.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``Σ_{mask=1} x``, over all elements or along ``dim``."""
    selected = torch.where(mask.bool(), x, torch.zeros_like(x))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    """Number of valid positions (float), over all elements or along ``dim``."""
    valid = mask.bool().float()
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``Σ_{mask=1} x / Σ mask``; 0 where there is no valid position."""
    return masked_sum(x, mask, dim) / masked_count(mask, dim).clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the valid elements: ``Σ (x - mean)² / (n - 1)`` (``/ n`` if not unbiased).

    Returns 0 when there are too few valid elements (n = 0, or n = 1 with ``unbiased``).
    """
    n = masked_count(mask)
    centered = x - masked_mean(x, mask)
    sq_sum = masked_sum(centered * centered, mask)
    denom = n - 1 if unbiased else n
    return torch.where(denom > 0, sq_sum / denom.clamp(min=1), torch.zeros_like(sq_sum))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over valid elements (unbiased var); 0 where mask is 0.

    With ``shift_mean=False`` the mean is added back: only the scale changes.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def mismatch_stats(log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> Tensor:
    """How far the rollout engine's log-probs are from the trainer's on the same tokens.

    Returns float64 ``[Σ|Δ|, Σ π/π_rollout, n tokens, max|Δ|]`` over valid positions with
    ``Δ = log π - log π_rollout``: sums, so pieces (micro-batches, ranks) combine by adding the
    first three and taking the max of the last; :func:`mismatch_metrics` turns them into means.
    """
    delta = (log_probs.detach() - rollout_log_probs).double()
    valid = mask.bool()
    absd = torch.where(valid, delta.abs(), torch.zeros_like(delta))
    ratio = torch.where(valid, delta.clamp(max=20.0).exp(), torch.zeros_like(delta))
    return torch.stack([absd.sum(), ratio.sum(), valid.sum().double(), absd.max()])


def mismatch_metrics(stats: Tensor) -> dict[str, float]:
    """``rollout/logprob_diff_mean``, ``_max`` and ``rollout/is_ratio_mean`` from
    :func:`mismatch_stats` (combined)."""
    tokens = max(float(stats[2]), 1.0)
    return {
        "rollout/logprob_diff_mean": float(stats[0]) / tokens,
        "rollout/logprob_diff_max": float(stats[3]),
        "rollout/is_ratio_mean": float(stats[1]) / tokens,
    }


def group_index(group_ids: Sequence[Hashable], scores: Tensor) -> Tensor:
    """Dense group index [B] (0..G-1) of each sample, in order of first appearance."""
    ids = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    if len(ids) != scores.shape[0]:
        raise ValueError(f"group_ids has {len(ids)} entries but the batch has {scores.shape[0]}")
    lookup: dict[Hashable, int] = {}
    index = [lookup.setdefault(g, len(lookup)) for g in ids]
    return torch.tensor(index, dtype=torch.long, device=scores.device)


def group_sum(x: Tensor, index: Tensor) -> Tensor:
    """For each sample, the sum of ``x`` over the samples of its group ([B] -> [B])."""
    sums = torch.zeros(int(index.max()) + 1, dtype=x.dtype, device=x.device)
    return sums.index_add_(0, index, x)[index]


def group_reduce(x: Tensor, index: Tensor, reduce: str) -> Tensor:
    """``reduce`` ("sum", "amax", "amin") of ``x`` [B] over each group: [G] (index [B] from
    :func:`group_index`)."""
    out = x.new_zeros(int(index.max()) + 1)
    return out.scatter_reduce(0, index, x, reduce, include_self=False)


def trajectory_weights(
    group_ids: Sequence[Hashable], trajectory_ids: Sequence[Hashable]
) -> Tensor | None:
    """Each sample's weight in its group's statistics: 1 / the number of samples of its
    trajectory (a session split into segments is several samples of one trajectory, which
    must weigh as one); None when every trajectory is one sample (every weight 1)."""
    keys = list(zip(group_ids, trajectory_ids, strict=True))
    counts: dict[tuple[Hashable, Hashable], int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    if all(n == 1 for n in counts.values()):
        return None
    return torch.tensor([1.0 / counts[key] for key in keys], dtype=torch.float64)
