"""DPPO's policy losses (Qi et al., arXiv 2602.04879): a trust region on the divergence.

Instead of clipping the ratio, a token stops pushing once the policy's divergence from the
old one at that token (of the binary distribution {token, rest}) passes a bound in the
advantage's direction: the total variation (``dppo_tv``) or the KL divergence (``dppo_kl``).
Choices: the gradient of the tokens kept is importance-weighted by the ratio truncated at
``dppo_is_cap``; the bounds and the cap have keys of their own (``dppo_divergence_low/high``,
``dppo_is_cap``), where verl reads them from the clip ratios.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from treadle.algorithms.inputs import PolicyLossInputs
from treadle.algorithms.losses.base import (
    Result,
    clamped_log_ratio,
    loss_result,
    weighted_aggregate,
)
from treadle.algorithms.registry import register_policy_loss


@dataclass(frozen=True)
class DPPOSettings:
    """DPPO's divergence bounds δ (for ``A ≤ 0`` and ``A > 0``) and its importance-weight cap."""

    dppo_divergence_low: float = 0.2
    dppo_divergence_high: float = 0.2
    dppo_is_cap: float = 20.0


def _dppo(
    inputs: PolicyLossInputs, keep: Tensor, cap: float, valid: tuple[Tensor, Tensor, Tensor]
) -> Result:
    """``L = -A · sg(min(r, cap)) · log π`` on the tokens ``keep`` lets through, 0 elsewhere."""
    log_probs, old_log_probs, advantages = valid
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio.detach())
    keep = keep.detach()
    pg_losses = torch.where(keep, -advantages * ratio.clamp(max=cap) * log_probs, 0.0)
    return loss_result(
        weighted_aggregate(pg_losses, inputs),
        inputs,
        -log_ratio,
        pg_clipfrac=~keep,
        pg_clipfrac_lower=(ratio > cap) & keep,
    )


def _away_from_old(advantages: Tensor, prob: Tensor, old_prob: Tensor) -> Tensor:
    """Tokens whose probability moved the way the advantage pushes it (up for ``A > 0``)."""
    return torch.where(advantages > 0, prob > old_prob, prob < old_prob)


@register_policy_loss("dppo_tv", settings=DPPOSettings, advantage_scaled=True)
def dppo_tv(inputs: PolicyLossInputs, settings: DPPOSettings) -> Result:
    """DPPO-Binary-TV (Qi et al., arXiv 2602.04879): ``L = -A·sg(min(r, c))·log π·1[trusted]``.

    A trust region on the policy's divergence, not on the ratio: a token stops pushing once
    its probability moved past ``π - π_old > δ_high`` (``A > 0``) or ``π - π_old < -δ_low``
    (``A ≤ 0``) in the advantage's direction (the total-variation distance of the binary
    distribution {token, rest}). The gradient is importance-weighted by the ratio truncated
    at ``c = dppo_is_cap`` (the paper recommends a large cap, its Section 5.4). verl reads
    δ from ``clip_ratio_low/high`` and ``c`` from ``clip_ratio_c`` (3.0 by default there);
    treadle gives them keys of their own, defaults δ = 0.2 (verl's) and c = 20.
    """
    valid = inputs.valid_only()
    log_probs, old_log_probs, advantages = valid
    moved = torch.exp(log_probs) - torch.exp(old_log_probs)
    keep = torch.where(
        advantages > 0,
        moved <= settings.dppo_divergence_high,
        moved >= -settings.dppo_divergence_low,
    )
    return _dppo(inputs, keep, settings.dppo_is_cap, valid)


@register_policy_loss("dppo_kl", settings=DPPOSettings, advantage_scaled=True)
def dppo_kl(inputs: PolicyLossInputs, settings: DPPOSettings) -> Result:
    """DPPO-Binary-KL (Qi et al., arXiv 2602.04879): ``L = -A·sg(min(r, c))·log π·1[trusted]``.

    As ``dppo_tv`` with the KL divergence of the binary distribution {token, rest}:
    ``D = p_old log(p_old/p) + (1-p_old) log((1-p_old)/(1-p))`` (1e-8 added inside the second
    log, as verl). A token is dropped when ``D`` exceeds ``δ_high`` (``A > 0``) or ``δ_low``
    (``A ≤ 0``) *and* its probability moved in the advantage's direction; moving back toward
    the old policy is always allowed.
    """
    valid = inputs.valid_only()
    log_probs, old_log_probs, advantages = valid
    prob, old_prob = torch.exp(log_probs), torch.exp(old_log_probs)
    binary_kl = old_prob * (old_log_probs - log_probs) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    bound = torch.where(advantages > 0, settings.dppo_divergence_high, settings.dppo_divergence_low)
    keep = (binary_kl <= bound) | ~_away_from_old(advantages, prob, old_prob)
    return _dppo(inputs, keep, settings.dppo_is_cap, valid)
