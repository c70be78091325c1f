"""Policy losses without a hard clip on the ratio: GPG, SAPO and DRO.

``gpg`` is the plain policy gradient ``-A·log π`` (no ratio at all); ``sapo`` replaces the
clip by a soft gate that fades a token's gradient as its ratio leaves 1; ``dro`` pulls each
token back toward the old policy by a quadratic regulariser instead of cutting it off.
Choices: no token's gradient is cut to zero at a threshold (``pg_clipfrac`` is 0); the
regulariser of ``dro`` is not a multiple of the advantage, so it alone is not registered
``advantage_scaled``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treadle.algorithms.inputs import NoSettings, PolicyLossInputs
from treadle.algorithms.losses.base import (
    Result,
    clamped_log_ratio,
    loss_result,
    weighted_aggregate,
)
from treadle.algorithms.registry import register_policy_loss


@register_policy_loss("gpg", settings=NoSettings, advantage_scaled=True)
def gpg(inputs: PolicyLossInputs, settings: NoSettings) -> Result:
    """GPG (arXiv 2504.02546): plain policy gradient ``L = -A · log π``, no ratio, no clip."""
    log_probs, old_log_probs, advantages = inputs.valid_only()
    loss = weighted_aggregate(-advantages * log_probs, inputs)
    return loss_result(loss, inputs, old_log_probs - log_probs, pg_clipfrac=0.0)


@dataclass(frozen=True)
class SAPOSettings:
    """SAPO's gate temperatures for positive and other advantages (the paper's)."""

    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05


@register_policy_loss("sapo", settings=SAPOSettings, advantage_scaled=True)
def sapo(inputs: PolicyLossInputs, settings: SAPOSettings) -> Result:
    """SAPO (Gao et al., Qwen, arXiv 2511.20347): ``L = -f_τ(r)·A``, ``f_τ(r) = σ(τ(r-1))·4/τ``.

    A soft gate instead of a hard clip: ``f`` has slope 1 at ``r = 1`` (the PPO gradient
    on-policy) and fades smoothly as the ratio leaves 1, so no token's gradient is cut to
    zero at a threshold. ``τ = sapo_tau_pos`` for ``A > 0``, ``sapo_tau_neg`` otherwise; the
    defaults (1.0, 1.05) are the paper's. verl always aggregates SAPO with
    ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says; treadle uses the configured
    mode (the paper's objective is ``seq-mean-token-mean``: set it for the paper's loss).
    """
    tau_pos, tau_neg = settings.sapo_tau_pos, settings.sapo_tau_neg
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0, got {tau_pos}, {tau_neg}")
    log_probs, old_log_probs, advantages = inputs.valid_only()
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(log_probs.dtype)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    loss = weighted_aggregate(-gate * advantages, inputs)
    return loss_result(loss, inputs, -log_ratio, pg_clipfrac=0.0)


@dataclass(frozen=True)
class DROSettings:
    """DRO's regulariser weight β: no default (the paper tunes it); must be > 0."""

    dro_beta: float | None = None


@register_policy_loss("dro", settings=DROSettings)
def dro(inputs: PolicyLossInputs, settings: DROSettings) -> Result:
    """DRO (Richemond et al., arXiv 2405.19107): ``L = -(A·log π - ½β(log π - log π_old)²)``.

    Direct Reward Optimization's policy term, with the old policy as the regulariser's
    anchor (as in verl): the gradient ``-(A - β log r)∇log π`` pulls each token back toward
    the old policy in proportion to how far it moved, instead of clipping. ``β = dro_beta``
    has no default (the paper tunes it); it must be > 0.
    """
    beta = settings.dro_beta
    if beta is None or beta <= 0:
        raise ValueError(f"algorithm.dro_beta must be > 0 for the dro policy loss, got {beta}")
    log_probs, old_log_probs, advantages = inputs.valid_only()
    log_ratio = log_probs - old_log_probs
    pg_losses = -(advantages * log_probs - 0.5 * beta * log_ratio.square())
    return loss_result(weighted_aggregate(pg_losses, inputs), inputs, -log_ratio, pg_clipfrac=0.0)
