"""Rollout correction: the policy that sampled is not the policy that learns.

The rollout log-probs come from the engine that generated (another dtype or kernel, and in the
asynchronous modes weights one or more versions old); PPO's ratio is taken against the
learner's old policy. Per token, with ``ratio = pi_old / pi_rollout`` (verl's rollout
correction; Liu, Li et al., "When Speed Kills Stability", 2025):

- ``tis``: truncated importance sampling, the policy-gradient term is weighted by
  ``min(ratio, cap)``;
- ``mis``: masked importance sampling, weighted by ``ratio`` where ``ratio <= cap``; tokens above
  the cap are dropped from the loss (they stay in the token-mean's count).

The weights are constants (no gradient). Log-ratios are clamped to [-20, 20] before ``exp``.
"""

from __future__ import annotations

import torch
from torch import Tensor

MODES = ("none", "tis", "mis")


def rollout_correction(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    mask: Tensor,
    mode: str,
    cap: float,
) -> tuple[Tensor | None, Tensor, float]:
    """``(weights, mask, over_cap_frac)``: the per-token importance weights (None for
    ``none``), the loss mask with ``mis``'s rejected tokens removed, and the fraction of valid
    tokens whose ratio was above the cap (truncated by ``tis``, dropped by ``mis``)."""
    if mode not in MODES:
        raise ValueError(f"rollout correction {mode!r}: valid are {', '.join(MODES)}")
    if mode == "none":
        return None, mask, 0.0
    valid = mask.bool()
    log_ratio = torch.where(valid, old_log_probs.detach() - rollout_log_probs, 0.0)
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    over = (ratio > cap) & valid
    over_frac = float(over.sum()) / max(int(valid.sum()), 1)
    if mode == "tis":
        return ratio.clamp(max=cap), mask, over_frac
    kept = mask * (~over).to(mask.dtype)
    return ratio * (~over).to(ratio.dtype), kept, over_frac
