"""The covariance policy losses of Cui et al. (arXiv 2505.22617): Clip-Cov and KL-Cov.

Both single tokens out by ``Cov_t = (A_t - mean A)(log π_t - mean log π)`` (means over the
valid tokens of the call): Clip-Cov gives loss 0 to a random few of those whose ``Cov_t`` lies
in a range, KL-Cov adds a KL penalty to the fraction with the largest ``Cov_t``. Choices: the
covariance is a statistic of the whole call, so neither loss is registered
``advantage_scaled`` (a row's loss depends on the other rows); Clip-Cov's random choice
follows ``inputs.generator``, for reproducible runs.
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
from treadle.algorithms.losses.clipped import Clip, clipped_surrogate
from treadle.algorithms.registry import register_policy_loss
from treadle.algorithms.utils import masked_count, masked_mean


def _token_cov(advantages: Tensor, log_probs: Tensor, mask: Tensor) -> Tensor:
    """``(A_t - mean A)(log π_t - mean log π)`` with means over the valid tokens (detached)."""
    adv, logp = advantages.detach(), log_probs.detach()
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


def _random_subset(candidates: Tensor, k: int, generator: torch.Generator | None) -> Tensor:
    """A bool mask with ``min(k, #candidates)`` of the ``True`` positions, chosen at random."""
    index = candidates.flatten().nonzero().squeeze(-1)
    keep = torch.randperm(index.numel(), generator=generator)[:k].to(index.device)
    chosen = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    chosen[index[keep]] = True
    return chosen.view_as(candidates)


def _top_fraction(scores: Tensor, mask: Tensor, fraction: float) -> Tensor:
    """A bool mask of the ``max(1, ⌊fraction·n⌋)`` valid positions with the largest score."""
    n_valid = int(masked_count(mask).item())
    chosen = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    if n_valid > 0:
        ranked = torch.where(mask.bool(), scores, float("-inf")).flatten()
        chosen[ranked.topk(max(1, int(fraction * n_valid))).indices] = True
    return chosen.view_as(scores)


@dataclass(frozen=True)
class ClipCovSettings(Clip):
    """Clip-Cov: the fraction of tokens dropped and the covariance range they are drawn from."""

    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0


@register_policy_loss("clip_cov", settings=ClipCovSettings)
def clip_cov(inputs: PolicyLossInputs, settings: ClipCovSettings) -> Result:
    """Clip-Cov (Cui et al., arXiv 2505.22617): PPO-clip, with loss 0 on a random ``ratio``
    fraction of the tokens whose ``Cov_t = (A_t - mean A)(log π_t - mean log π)`` is in
    ``(lb, ub)``.

    ``Cov_t = (A_t - mean A)(log π_t - mean log π)`` over the valid tokens of this call. Of the
    tokens not already clipped by PPO whose ``Cov_t`` lies in ``(lb, ub)``, a random
    ``max(1, ⌊ratio·n_valid⌋)`` get loss 0; the others get the PPO-clip loss (as in verl; set
    large clip ratios for the paper's unclipped ``-r·A``). Paper defaults: ratio 2e-4,
    bounds (1, 5). ``inputs.generator`` (a CPU ``torch.Generator``) makes the choice
    reproducible.
    """
    log_probs, old_log_probs, advantages = inputs.valid_only()
    mask = inputs.response_mask
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    pg_losses, clipped = clipped_surrogate(torch.exp(log_ratio), advantages, settings)
    cov = _token_cov(advantages, log_probs, mask)
    lb, ub = settings.clip_cov_lb, settings.clip_cov_ub
    candidates = mask.bool() & ~clipped & (cov > lb) & (cov < ub)
    n_drop = max(1, int(settings.clip_cov_ratio * masked_count(mask).item()))
    dropped = _random_subset(candidates, n_drop, inputs.generator)
    pg_losses = torch.where(dropped, 0.0, pg_losses)
    loss = weighted_aggregate(pg_losses, inputs)
    return loss_result(loss, inputs, -log_ratio, pg_clipfrac=clipped, pg_cov_frac=dropped)


@dataclass(frozen=True)
class KLCovSettings:
    """KL-Cov: the fraction of tokens penalised and the penalty's weight β."""

    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 1.0


@register_policy_loss("kl_cov", settings=KLCovSettings)
def kl_cov(inputs: PolicyLossInputs, settings: KLCovSettings) -> Result:
    """KL-Cov (Cui et al., arXiv 2505.22617): ``L_t = -r_t·A_t + β·|log r_t|`` on the
    ``ratio`` fraction of tokens with the largest ``Cov_t``, ``-r_t·A_t`` elsewhere.

    ``L_t = -r_t·A_t`` (no clipping), plus ``β·|log π_t - log π_old,t|`` on the
    ``max(1, ⌊ratio·n_valid⌋)`` valid tokens with the largest
    ``Cov_t = (A_t - mean A)(log π_t - mean log π)``. ``β = kl_cov_coef``: 1, as in the
    paper's recipe (``ppo_kl_coef=1`` in its scripts; verl's config default is 0.1, its
    function's fallback 1);
    ``kl_cov_ratio`` defaults to verl's 2e-4 (the paper tunes it per model size).
    """
    log_probs, old_log_probs, advantages = inputs.valid_only()
    mask = inputs.response_mask
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    pg_losses = -advantages * torch.exp(log_ratio)
    cov = _token_cov(advantages, log_probs, mask)
    penalised = _top_fraction(cov, mask, settings.kl_cov_ratio)
    penalty = settings.kl_cov_coef * log_ratio.abs()
    pg_losses = torch.where(penalised, pg_losses + penalty, pg_losses)
    loss = weighted_aggregate(pg_losses, inputs)
    return loss_result(loss, inputs, -log_ratio, pg_clipfrac=0.0, pg_cov_frac=penalised)
