"""KL divergence between the policy and the frozen reference: estimators and coefficient control.

Per-token estimators of ``KL(π_θ || π_ref)`` from the log-probs of the sampled tokens (Schulman,
"Approximating KL divergence", 2020), registered in ``KL_ESTIMATORS`` and used either as a
reward penalty (``r_t - β·kl_t``) or as a loss term. With ``x = log π_θ - log π_ref``:

- ``k1``: ``x`` (unbiased, high variance, can be negative per token),
- ``k2`` / ``mse``: ``½ x²`` (biased, low variance; on-policy, its gradient as a loss term is
  the gradient of the true KL),
- ``k3``: ``exp(-x) + x - 1`` (unbiased, non-negative, low variance),
- ``abs``: ``|x|``.

The coefficient β comes from a controller: ``FixedKLController`` or ``AdaptiveKLController``
(Ziegler et al., arXiv 1909.08593). Both expose ``value`` and ``update(current_kl, n_steps)``
and save their state with ``state_dict()`` so a resumed run continues with the same β.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from treadle.algorithms.registry import KL_ESTIMATORS, register_kl_estimator


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate [B,T] with the estimator registered as ``kind``."""
    return KL_ESTIMATORS.get(kind)(log_probs, ref_log_probs)


@register_kl_estimator("k1")
def kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``k1 = log π - log π_ref``."""
    return log_probs - ref_log_probs


@register_kl_estimator("k2")
@register_kl_estimator("mse")
def kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``k2 = ½ (log π - log π_ref)²`` (also registered as ``mse``)."""
    return 0.5 * (log_probs - ref_log_probs).square()


@register_kl_estimator("k3")
def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``k3 = exp(log π_ref - log π) - (log π_ref - log π) - 1``, clamped to [-10, 10].

    The log-ratio is clamped to [-20, 20] before ``exp`` so a bad token cannot overflow.
    """
    log_ratio = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10.0, 10.0)


@register_kl_estimator("abs")
def kl_abs(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``|log π - log π_ref|``."""
    return (log_probs - ref_log_probs).abs()


def kl_in_reward(
    token_level_scores: Tensor,
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    coef: float,
    kind: str = "k1",
) -> tuple[Tensor, Tensor]:
    """The KL penalty as part of the reward (InstructGPT, arXiv 2203.02155; verl's
    ``use_kl_in_reward``): ``r_t = score_t - coef * KL_t`` on valid tokens.

    Returns the shaped rewards [B,T] and each sequence's mean per-token KL [B] (what an
    adaptive controller steers).
    """
    mask = response_mask.to(log_probs.dtype)
    kl = kl_penalty(log_probs, ref_log_probs, kind) * mask
    rewards = token_level_scores - coef * kl
    return rewards, kl.sum(-1) / mask.sum(-1).clamp(min=1)


class FixedKLController:
    """A constant KL coefficient β."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive β (Ziegler et al., arXiv 1909.08593) steering the measured KL toward a target.

    ``e = clip(KL / target - 1, -0.2, 0.2)``, ``β ← β (1 + e · n_steps / horizon)``: β grows
    when the KL is above target and shrinks below, by at most 20% per ``horizon`` steps.
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"need target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β after ``n_steps`` samples (or steps) whose measured KL was ``current_kl``."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
