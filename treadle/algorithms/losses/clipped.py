"""The clipped-ratio policy losses: PPO (and its dual clip), GSPO, CISPO and GMPO.

Each bounds how far one update moves the policy by clipping the importance ratio
``r = π/π_old``: per token (``ppo``, verl's ``vanilla``), per sequence (``gspo``), on the
weight only, keeping every token's gradient (``cispo``), or in log space around the
geometric mean of a sequence's ratios (``geo_mean``). :class:`Clip` is the clip range their
settings share (and Clip-Cov's, :mod:`.covariance`); :func:`clipped_surrogate` is PPO's
pessimistic ``max(-A·r, -A·clip(r))``. Choices: a sequence-level ratio is aggregated per
sequence (GSPO and GMPO register the aggregation modes they take: per token, a sequence's
weight would grow with its length); each docstring says where a default is not the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from treadle.algorithms.inputs import PolicyLossInputs
from treadle.algorithms.losses.aggregation import aggregate
from treadle.algorithms.losses.base import (
    Result,
    clamped_log_ratio,
    loss_result,
    weighted_aggregate,
)
from treadle.algorithms.registry import POLICY_LOSSES, register_policy_loss
from treadle.algorithms.utils import masked_mean


@dataclass(frozen=True)
class Clip:
    """A clip range ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` on the importance ratio."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2


@dataclass(frozen=True)
class PPOSettings(Clip):
    """PPO-clip; ``clip_ratio_c`` > 1 turns on the dual clip (off by default)."""

    clip_ratio_c: float | None = None


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip: Clip) -> tuple[Tensor, Tensor]:
    """``max(-A·r, -A·clip(r, 1-low, 1+high))`` and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip.clip_ratio_low, 1.0 + clip.clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _dual_clip(pg_losses: Tensor, advantages: Tensor, clip_ratio_c: float) -> tuple[Tensor, Tensor]:
    """For ``A < 0``: ``min(L, -A·c)``, bounding the loss when the ratio is huge."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip clip_ratio_c must be > 1, got {clip_ratio_c}")
    bound = -advantages * clip_ratio_c
    active = (advantages < 0) & (pg_losses > bound)
    return torch.where(active, bound, pg_losses), active


@register_policy_loss("ppo", settings=PPOSettings, advantage_scaled=True)
def ppo(inputs: PolicyLossInputs, settings: PPOSettings) -> Result:
    """PPO-clip (Schulman et al., arXiv 1707.06347): ``L = max(-A·r, -A·clip(r, 1-ε_low,
    1+ε_high))``, with dual clip ``min(L, -A·c)`` for ``A < 0``.

    ``r = π/π_old``, ``L = max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high))``; ``ε_high > ε_low`` is
    DAPO's clip-higher (arXiv 2503.14476). With ``clip_ratio_c = c > 1``, tokens with ``A < 0``
    use ``min(L, -A·c)`` (dual-clip PPO, arXiv 1912.09729). ``pg_clipfrac_lower`` is the
    fraction of valid tokens where that lower bound was active.
    """
    log_probs, old_log_probs, advantages = inputs.valid_only()
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    pg_losses, clipped = clipped_surrogate(torch.exp(log_ratio), advantages, settings)
    lower_clipped = torch.zeros_like(clipped)
    if settings.clip_ratio_c is not None:
        pg_losses, lower_clipped = _dual_clip(pg_losses, advantages, settings.clip_ratio_c)
    return loss_result(
        weighted_aggregate(pg_losses, inputs),
        inputs,
        -log_ratio,
        pg_clipfrac=clipped,
        pg_clipfrac_lower=lower_clipped,
    )


POLICY_LOSSES.alias("vanilla", "ppo")  # verl's name for PPO-clip


@dataclass(frozen=True)
class GSPOSettings(Clip):
    """GSPO's clip range on the sequence ratio: the paper's tiny ε."""

    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4


# a sequence-level ratio: aggregating it per token would weight sequences by their length
@register_policy_loss(
    "gspo",
    agg_modes=("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    settings=GSPOSettings,
    advantage_scaled=True,
)
def gspo(inputs: PolicyLossInputs, settings: GSPOSettings) -> Result:
    """GSPO (Zheng et al., arXiv 2507.18071): ``L = max(-A·s_i, -A·clip(s_i, 1-ε_low,
    1+ε_high))``, ``s_i = exp(mean_t (log π - log π_old))``, a sequence-level ratio.

    ``s_i = exp(mean_t (log π - log π_old))`` over the valid tokens of sequence ``i``. The
    token form ``s_{i,t} = sg(s_i) · π_t / sg(π_t)`` has the value ``s_i`` and the gradient
    ``s_i ∇log π_t``; ``L = max(-A·s_{i,t}, -A·clip(s_{i,t}, 1-ε_low, 1+ε_high))``. With the
    paper's ``seq-mean-token-mean`` aggregation the gradient is the paper's
    ``-(1/G) Σ_i A_i s_i (1/|y_i|) Σ_t ∇log π_{i,t}`` (other modes reweight sequences).
    Defaults are the paper's ε (3e-4, 4e-4); a whole sequence is clipped or not.
    """
    log_probs, old_log_probs, advantages = inputs.valid_only()
    mask = inputs.response_mask
    seq_log_ratio = masked_mean(log_probs - old_log_probs, mask, dim=-1).detach()
    token_log_ratio = log_probs - log_probs.detach() + seq_log_ratio.unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    pg_losses, clipped = clipped_surrogate(ratio, advantages, settings)
    loss = weighted_aggregate(pg_losses, inputs)
    return loss_result(loss, inputs, old_log_probs - log_probs, pg_clipfrac=clipped)


@dataclass(frozen=True)
class CISPOSettings(Clip):
    """CISPO's bounds on the importance weight: no lower bound by default."""

    clip_ratio_low: float = 1.0


@register_policy_loss("cispo", settings=CISPOSettings, advantage_scaled=True)
def cispo(inputs: PolicyLossInputs, settings: CISPOSettings) -> Result:
    """CISPO (MiniMax-M1, arXiv 2506.13585): ``L = -sg(clip(r, 1-ε_low, 1+ε_high)) · A · log π``.

    Clip the importance weight, not the update: every token keeps a gradient
    ``-ŵ A ∇log π``, only its weight is bounded. The default ``ε_low = 1`` leaves no lower
    bound, as in the paper; ``ε_high = 0.2`` is our default, not a value from the paper.
    """
    log_probs, old_log_probs, advantages = inputs.valid_only()
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(1.0 - settings.clip_ratio_low, 1.0 + settings.clip_ratio_high)
    loss = weighted_aggregate(-advantages * weight * log_probs, inputs)
    return loss_result(loss, inputs, -log_ratio, pg_clipfrac=weight != ratio)


# one ratio and one advantage per sequence: the loss is a mean over sequences
@register_policy_loss(
    "geo_mean", agg_modes=("seq-mean-token-mean",), settings=Clip, advantage_scaled=True
)
def geo_mean(inputs: PolicyLossInputs, settings: Clip) -> Result:
    """GMPO (Zhao et al., arXiv 2507.20673): ``L_i = -Â_i · exp(mean_t clip_A(log r_t))``.

    The geometric mean of the token ratios of sequence ``i`` instead of their arithmetic
    mean, so one outlier token moves the objective less. Each token's log-ratio is clipped
    to ``[-ε_low, ε_high]`` on the side the advantage pushes it (PPO's pessimistic min, in
    log space: ``sign(A)·min(sign(A)·x, sign(A)·clip(x))``); ``Â_i`` is the mean advantage of
    the sequence (an outcome advantage). ``clip_ratio_low/high`` are *log-space* bounds here
    (the paper uses 0.4, i.e. ratios in ``(e^-0.4, e^0.4)``). ``L = Σ_i L_i / num_seqs``.
    Rollout importance weights enter as their geometric mean over the sequence.
    verl averages over the micro-batch's rows whatever the mini-batch; treadle divides by
    the mini-batch's ``num_seqs`` so micro-batches add up.
    """
    log_probs, old_log_probs, advantages = inputs.valid_only()
    mask = inputs.response_mask
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    clipped_log_ratio = log_ratio.clamp(-settings.clip_ratio_low, settings.clip_ratio_high)
    sign = torch.sign(advantages)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped_log_ratio)
    seq_ratio = torch.exp(masked_mean(pessimistic, mask, dim=-1))
    seq_adv = masked_mean(advantages, mask, dim=-1)
    seq_losses = -seq_adv * seq_ratio
    if inputs.rollout_is_weights is not None:
        log_w = torch.log(inputs.rollout_is_weights.detach() + 1e-10)
        seq_losses = seq_losses * torch.exp(masked_mean(log_w, mask, dim=-1))
    # every token of sequence i carries L_i; the per-sequence token mean is then L_i
    pg_losses = seq_losses.unsqueeze(-1).expand_as(log_ratio)
    clipped = log_ratio != clipped_log_ratio
    return loss_result(
        aggregate(pg_losses, mask, inputs.agg),
        inputs,
        -log_ratio,
        pg_clipfrac=clipped & (advantages > 0),
        pg_clipfrac_lower=clipped & (advantages < 0),
    )
