"""KL divergence between the policy and the frozen reference: estimators and coefficient control.

Per-token estimators of ``KL(π_θ || π_ref)`` from the log-probs of the sampled tokens (Schulman,
"Approximating KL divergence", 2020), registered in ``KL_ESTIMATORS`` and used either as a
reward penalty (``r_t - β·kl_t``) or as a loss term. With ``x = log π_θ - log π_ref``:

- ``k1``: ``x`` (unbiased, high variance, can be negative per token),
- ``k2`` / ``mse``: ``½ x²`` (biased, low variance; on-policy, its gradient as a loss term is
  the gradient of the true KL),
- ``k3``: ``exp(-x) + x - 1`` (unbiased, non-negative, low variance),
- ``abs``: ``|x|``;
- ``k1+``, ``k3+``, ``abs+`` (and ``k2+``, the same as ``k2``): the value of the base
  estimator with the gradient of ``k2`` (straight-through), so a KL *loss* gets k2's
  gradient, the gradient of the true KL on-policy, while its reported value stays unbiased;
- ``full``: the exact KL over the vocabulary at each position, from the two full
  distributions, not from the sampled token. It needs the reference's whole distribution in
  the actor's update (the actor computes it, see ``treadle.workers.actor``); it cannot be a
  reward penalty (``treadle check`` refuses ``kl_reward_estimator=full``).

verl's names are aliases: ``kl`` = ``k1``, ``low_var_kl`` = ``k3`` (and their ``+`` forms).
``mse`` = ``k2``.

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
    """k1 (Schulman, http://joschu.net/blog/kl-approx.html): ``log π - log π_ref``."""
    return log_probs - ref_log_probs


@register_kl_estimator("k2")
def kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k2 (Schulman, http://joschu.net/blog/kl-approx.html): ``½ (log π - log π_ref)²``.

    Also named ``mse``, ``k2+``, ``mse+``."""
    return 0.5 * (log_probs - ref_log_probs).square()


@register_kl_estimator("k3")
def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k3 (Schulman, http://joschu.net/blog/kl-approx.html): ``exp(log π_ref - log π) -
    (log π_ref - log π) - 1``, clamped to [-10, 10].

    The log-ratio is clamped to [-20, 20] before ``exp`` so a bad token cannot overflow.
    """
    log_ratio = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10.0, 10.0)


@register_kl_estimator("abs")
def kl_abs(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """abs (Schulman, http://joschu.net/blog/kl-approx.html): ``|log π - log π_ref|``."""
    return (log_probs - ref_log_probs).abs()


def _straight_through(value: Tensor, log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``value`` in the forward pass, the gradient of ``k2`` in the backward pass."""
    k2 = kl_k2(log_probs, ref_log_probs)
    return k2 - k2.detach() + value.detach()


@register_kl_estimator("k1+")
def kl_k1_plus(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k1+ (Schulman, http://joschu.net/blog/kl-approx.html; verl): ``k1`` with ``k2``'s gradient.

    Straight-through: the value ``log π - log π_ref`` (unbiased), the gradient
    ``(log π - log π_ref)∇log π``, whose expectation on-policy is the gradient of the KL
    (k1's own gradient, ``∇log π``, has expectation 0).
    """
    return _straight_through(kl_k1(log_probs, ref_log_probs), log_probs, ref_log_probs)


@register_kl_estimator("k3+")
def kl_k3_plus(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k3+ (Schulman, http://joschu.net/blog/kl-approx.html; verl): ``k3`` with ``k2``'s gradient.

    The value of ``k3`` (clamped as ``k3``), the gradient of ``½(log π - log π_ref)²``.
    """
    return _straight_through(kl_k3(log_probs, ref_log_probs), log_probs, ref_log_probs)


@register_kl_estimator("abs+")
def kl_abs_plus(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """abs+ (verl): ``|log π - log π_ref|`` with ``k2``'s gradient (straight-through)."""
    return _straight_through(kl_abs(log_probs, ref_log_probs), log_probs, ref_log_probs)


# full_vocab: the inputs are log-softmax over the vocabulary [..., V], not [B, T]
@register_kl_estimator("full", full_vocab=True)
def kl_full(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """Exact KL (Kullback & Leibler, 1951): ``Σ_v π(v)(log π(v) - log π_ref(v))`` per position.

    ``log_probs`` and ``ref_log_probs`` are full log-softmax distributions ``[..., V]``; the
    result drops the last dim. No sampling noise, and its gradient is the KL's own. verl
    0.9.1 names it and raises NotImplementedError; treadle computes it in the actor's update,
    where the reference's distribution is at hand. Positions where both put probability 0 on
    a token contribute 0 there (``0·(-inf)`` is avoided by ``xlogy``-style selection).
    """
    probs = log_probs.exp()
    diff = torch.where(probs > 0, log_probs - ref_log_probs, torch.zeros_like(log_probs))
    return (probs * diff).sum(-1)


for _alias, _name in (
    ("mse", "k2"),
    ("k2+", "k2"),
    ("mse+", "k2"),
    ("kl", "k1"),
    ("kl+", "k1+"),
    ("low_var_kl", "k3"),
    ("low_var_kl+", "k3+"),
):
    KL_ESTIMATORS.alias(_alias, _name)


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
    if KL_ESTIMATORS.info(kind).get("full_vocab"):
        raise ValueError(
            f"KL estimator {kind!r} needs whole distributions [..., V], not the sampled tokens' "
            "log-probs the reward is shaped from: use a per-token estimator (k1, k3...)"
        )
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
