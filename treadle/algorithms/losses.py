"""Actor and critic losses: policy-gradient objectives, loss aggregation, value loss, entropy.

Every policy loss has one signature, so the actor picks one by name from ``POLICY_LOSSES``::

    fn(inputs: PolicyLossInputs, settings) -> (loss, metrics)

``inputs`` (:class:`~treadle.algorithms.inputs.PolicyLossInputs`) holds the tensors and the
aggregation; ``settings`` is the loss's own frozen dataclass, registered with it
(``settings=PPOSettings``), whose fields are the ``algorithm`` settings it reads
(``clip_ratio_low``, ``sapo_tau_pos``, ``dro_beta``...; ``POLICY_LOSSES.knobs(name)``). The
actor builds it from exactly those, so a knob a loss does not read never reaches it, and
``treadle check`` refuses a knob changed from its default that the chosen loss does not read.
The aggregation ``seq-mean-token-sum-norm`` registers its ``loss_scale_factor`` as a knob. A
loss registered with ``old="rollout_log_probs"`` (``bypass_mode``) gets the rollout engine's
log-probs as ``old_log_probs``. verl's names resolve too (``vanilla`` is ``ppo``), and
``tests/algorithms/test_losses_parity.py`` holds every loss to verl 0.9.1's.

All tensors are ``[B, T]`` on the response side. A loss builds a per-token loss matrix and hands
it to ``agg_loss``, which turns it into a scalar in one of the registered modes. Choices:

- Positions where the mask is 0 are replaced by 0 before any arithmetic, so padding holding
  ``-inf`` log-probs cannot produce ``nan`` in the loss or its gradient.
- Log importance ratios are clamped to [-20, 20] before ``exp``.
- ``rollout_is_weights`` (truncated importance weights correcting for a rollout engine whose
  log-probs differ from the trainer's) multiply the per-token loss as constants.
- ``inputs.agg`` carries ``num_tokens`` / ``num_seqs`` of the whole mini-batch (all
  micro-batches and data-parallel ranks) divided by ``dp_size``, ``dp_size`` itself and
  ``norm_constant``, so that the micro-batch losses add up to the mini-batch loss.
- Metrics are Python floats: ``pg_clipfrac`` (fraction of valid tokens whose ratio was clipped)
  and ``ppo_kl`` (masked mean of ``old - new`` log-prob) at least.
- A loss registered ``advantage_scaled=True`` is, row by row, the row's advantages times
  something finite that reads no other row: a row of zero advantages has zero loss and zero
  gradient, and the actor leaves it out of the update (``actor.skip_zero_advantage``). The
  covariance losses (``clip_cov``, ``kl_cov``: batch statistics) and ``dro`` (a regulariser
  apart from the advantage) are not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from treadle.algorithms.inputs import Aggregation, Count, NoSettings, PolicyLossInputs
from treadle.algorithms.registry import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    register_loss_agg_mode,
    register_policy_loss,
)
from treadle.algorithms.utils import masked_count, masked_mean, masked_sum

# --------------------------------------------------------------------------- aggregation


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
    norm_constant: float | None = None,
    dp_size: int = 1,
) -> Tensor:
    """Reduce a per-token loss ``[B,T]`` to a scalar with the aggregation ``mode``.

    ``num_tokens`` defaults to the number of valid tokens, ``num_seqs`` to the number of rows
    with at least one valid token. Pass the totals of the whole mini-batch divided by
    ``dp_size`` (the data-parallel ranks) instead and the aggregated losses of its
    micro-batches sum to the aggregated loss of the mini-batch, once the ranks' gradients are
    averaged. verl's ``agg_loss(..., dp_size, batch_num_tokens, global_batch_size,
    loss_scale_factor)`` is ``agg_loss(..., num_tokens=batch_num_tokens / dp_size,
    num_seqs=global_batch_size / dp_size, norm_constant=loss_scale_factor, dp_size=dp_size)``.
    """
    return aggregate(
        loss_mat, mask, Aggregation(mode, num_tokens, num_seqs, norm_constant, dp_size)
    )


def aggregate(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """:func:`agg_loss` with its mode and counts in one record."""
    return LOSS_AGG_MODES.get(agg.mode)(loss_mat, mask, agg)


def _divide(total: Tensor, count: Count) -> Tensor:
    """``total / count`` with a zero count treated as 1 (the total is then 0 anyway)."""
    return total / torch.as_tensor(count, dtype=total.dtype, device=total.device).clamp(min=1)


def _seq_count(mask: Tensor, num_seqs: Count) -> Count:
    return (masked_count(mask, dim=-1) > 0).sum() if num_seqs is None else num_seqs


@register_loss_agg_mode("token-mean")
def token_mean(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """token-mean (DAPO, arXiv 2503.14476): ``Σ_{i,t} m·L / num_tokens``, every valid token weighs
    the same."""
    count = masked_count(mask) if agg.num_tokens is None else agg.num_tokens
    return _divide(masked_sum(loss_mat, mask), count)


@register_loss_agg_mode("token-sum")
def token_sum(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """token-sum (verl): ``Σ_{i,t} m·L``, the plain sum over the mini-batch's valid tokens.

    Each rank's sum is multiplied by ``dp_size`` so that the average of the ranks' gradients
    is the gradient of the whole sum. The loss then grows with the batch: scale the learning
    rate to match.
    """
    return masked_sum(loss_mat, mask) * agg.dp_size


@register_loss_agg_mode("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """seq-mean-token-sum (verl): ``Σ_i (Σ_t m·L) / num_seqs``, per-sequence sum, averaged."""
    return _divide(masked_sum(loss_mat, mask), _seq_count(mask, agg.num_seqs))


@register_loss_agg_mode("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """seq-mean-token-mean (GRPO, arXiv 2402.03300): ``Σ_i (Σ_t m·L / Σ_t m) / num_seqs``."""
    seq_means = masked_sum(loss_mat, mask, dim=-1) / masked_count(mask, dim=-1).clamp(min=1)
    return _divide(seq_means.sum(), _seq_count(mask, agg.num_seqs))


@register_loss_agg_mode("seq-mean-token-sum-norm", knobs=("loss_scale_factor",))
def seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """seq-mean-token-sum-norm (Dr. GRPO, arXiv 2503.20783): ``Σ_i (Σ_t m·L / C) / num_seqs``,
    ``C`` a constant (default ``T``).

    Dividing by a constant instead of each sequence's length removes GRPO's length bias
    (arXiv 2503.20783).
    """
    constant = loss_mat.shape[-1] if agg.norm_constant is None else agg.norm_constant
    return _divide(masked_sum(loss_mat, mask) / constant, _seq_count(mask, agg.num_seqs))


# --------------------------------------------------------------------------- policy losses

Result = tuple[Tensor, dict[str, float]]


@dataclass(frozen=True)
class Clip:
    """A clip range ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` on the importance ratio."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2


@dataclass(frozen=True)
class PPOSettings(Clip):
    """PPO-clip; ``clip_ratio_c`` > 1 turns on the dual clip (off by default)."""

    clip_ratio_c: float | None = None


def _log_ratio(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    return (log_probs - old_log_probs).clamp(-20.0, 20.0)


def _fraction(flags: Tensor, mask: Tensor) -> float:
    return masked_mean(flags.float(), mask).item()


def _aggregate(pg_losses: Tensor, inputs: PolicyLossInputs) -> Tensor:
    if inputs.rollout_is_weights is not None:
        pg_losses = pg_losses * inputs.rollout_is_weights.detach()
    return aggregate(pg_losses, inputs.response_mask, inputs.agg)


def _result(
    loss: Tensor, inputs: PolicyLossInputs, kl: Tensor, **fractions: Tensor | float
) -> Result:
    """``(loss, metrics)``: each fraction (flags over the tokens, or a number) and ``ppo_kl``,
    the masked mean of ``kl`` (``log π_old - log π``)."""
    mask = inputs.response_mask
    metrics = {k: v if isinstance(v, float) else _fraction(v, mask) for k, v in fractions.items()}
    metrics["ppo_kl"] = masked_mean(kl.detach(), mask).item()
    return loss, metrics


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, clip: Clip) -> tuple[Tensor, Tensor]:
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
    log_ratio = _log_ratio(log_probs, old_log_probs)
    pg_losses, clipped = _clipped_surrogate(torch.exp(log_ratio), advantages, settings)
    lower_clipped = torch.zeros_like(clipped)
    if settings.clip_ratio_c is not None:
        pg_losses, lower_clipped = _dual_clip(pg_losses, advantages, settings.clip_ratio_c)
    return _result(
        _aggregate(pg_losses, inputs),
        inputs,
        -log_ratio,
        pg_clipfrac=clipped,
        pg_clipfrac_lower=lower_clipped,
    )


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
    pg_losses, clipped = _clipped_surrogate(ratio, advantages, settings)
    loss = _aggregate(pg_losses, inputs)
    return _result(loss, inputs, old_log_probs - log_probs, pg_clipfrac=clipped)


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
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(1.0 - settings.clip_ratio_low, 1.0 + settings.clip_ratio_high)
    loss = _aggregate(-advantages * weight * log_probs, inputs)
    return _result(loss, inputs, -log_ratio, pg_clipfrac=weight != ratio)


@register_policy_loss("gpg", settings=NoSettings, advantage_scaled=True)
def gpg(inputs: PolicyLossInputs, settings: NoSettings) -> Result:
    """GPG (arXiv 2504.02546): plain policy gradient ``L = -A · log π``, no ratio, no clip."""
    log_probs, old_log_probs, advantages = inputs.valid_only()
    loss = _aggregate(-advantages * log_probs, inputs)
    return _result(loss, inputs, old_log_probs - log_probs, pg_clipfrac=0.0)


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
    log_ratio = _log_ratio(log_probs, old_log_probs)
    pg_losses, clipped = _clipped_surrogate(torch.exp(log_ratio), advantages, settings)
    cov = _token_cov(advantages, log_probs, mask)
    lb, ub = settings.clip_cov_lb, settings.clip_cov_ub
    candidates = mask.bool() & ~clipped & (cov > lb) & (cov < ub)
    n_drop = max(1, int(settings.clip_cov_ratio * masked_count(mask).item()))
    dropped = _random_subset(candidates, n_drop, inputs.generator)
    pg_losses = torch.where(dropped, 0.0, pg_losses)
    loss = _aggregate(pg_losses, inputs)
    return _result(loss, inputs, -log_ratio, pg_clipfrac=clipped, pg_cov_frac=dropped)


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
    log_ratio = _log_ratio(log_probs, old_log_probs)
    pg_losses = -advantages * torch.exp(log_ratio)
    cov = _token_cov(advantages, log_probs, mask)
    penalised = _top_fraction(cov, mask, settings.kl_cov_ratio)
    penalty = settings.kl_cov_coef * log_ratio.abs()
    pg_losses = torch.where(penalised, pg_losses + penalty, pg_losses)
    loss = _aggregate(pg_losses, inputs)
    return _result(loss, inputs, -log_ratio, pg_clipfrac=0.0, pg_cov_frac=penalised)


POLICY_LOSSES.alias("vanilla", "ppo")  # verl's name for PPO-clip


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
    log_ratio = _log_ratio(log_probs, old_log_probs)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(log_probs.dtype)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    loss = _aggregate(-gate * advantages, inputs)
    return _result(loss, inputs, -log_ratio, pg_clipfrac=0.0)


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
    log_ratio = _log_ratio(log_probs, old_log_probs)
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
    return _result(
        aggregate(pg_losses, mask, inputs.agg),
        inputs,
        -log_ratio,
        pg_clipfrac=clipped & (advantages > 0),
        pg_clipfrac_lower=clipped & (advantages < 0),
    )


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
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio.detach())
    keep = keep.detach()
    pg_losses = torch.where(keep, -advantages * ratio.clamp(max=cap) * log_probs, 0.0)
    return _result(
        _aggregate(pg_losses, inputs),
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
    return _result(_aggregate(pg_losses, inputs), inputs, -log_ratio, pg_clipfrac=0.0)


def bypass_is_weights(
    log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, level: str, cap: float
) -> Tensor | None:
    """Truncated importance weights ``min(π_θ/π_rollout, cap)`` (constants), per token
    (``token``) or one per sequence, the product of its tokens' ratios (``sequence``); None
    for ``none``. Log-ratios (summed, for ``sequence``) are clamped to ±20 before ``exp``."""
    if level == "none":
        return None
    valid = mask.bool()
    log_ratio = torch.where(valid, log_probs.detach() - rollout_log_probs.detach(), 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"bypass_is {level!r}: valid are none, token, sequence")
    weights = torch.exp(log_ratio.clamp(-20.0, 20.0)).clamp(max=cap)
    return torch.where(valid, weights, 0.0)


@dataclass(frozen=True)
class BypassSettings(PPOSettings):
    """The bypass loss (``ppo_clip`` or ``reinforce``), PPO's clip (dual clip at 3 by default)
    and REINFORCE's importance weights (level, cap)."""

    clip_ratio_c: float | None = 3.0
    bypass_loss_type: str = "ppo_clip"
    bypass_is: str = "token"
    bypass_is_cap: float = 2.0


# the actor passes the rollout engine's log-probs as the old policy (its "old" fact)
@register_policy_loss(
    "bypass_mode", old="rollout_log_probs", settings=BypassSettings, advantage_scaled=True
)
def bypass_mode(inputs: PolicyLossInputs, settings: BypassSettings) -> Result:
    """Rollout-correction bypass (Liu, Li et al., https://richardli.xyz/rl-collapse; verl):
    PPO-clip (or REINFORCE) with ``r = π_θ / π_rollout``: the rollout policy is the old policy.

    ``old_log_probs`` are the *rollout engine's* log-probs (the actor passes them): no
    separate old-policy pass, two policies instead of three. ``bypass_loss_type``:

    - ``ppo_clip``: PPO-clip (dual clip with ``clip_ratio_c``) on ``r = π_θ/π_rollout``; the
      clipped ratio already is the importance correction, so no extra weights;
    - ``reinforce``: ``L = -w·A·log π`` with ``w = min(π_θ/π_rollout, cap)`` detached,
      per token or per sequence (``bypass_is``: token, sequence, none; cap
      ``bypass_is_cap``), verl's defaults apart from the level (verl: sequence).

    verl's rejection sampling (``rollout_rs``), IcePop bounds and batch-normalised weights
    are not implemented; ``algorithm.rollout_correction`` (tis, mis) cannot be combined with it.
    """
    if settings.bypass_loss_type == "ppo_clip":
        clip = PPOSettings(settings.clip_ratio_low, settings.clip_ratio_high, settings.clip_ratio_c)
        return ppo(dataclasses.replace(inputs, rollout_is_weights=None), clip)
    if settings.bypass_loss_type == "reinforce":
        mask = inputs.response_mask
        weights = bypass_is_weights(
            inputs.log_probs, inputs.old_log_probs, mask, settings.bypass_is, settings.bypass_is_cap
        )
        weighted = dataclasses.replace(inputs, rollout_is_weights=weights)
        logp, old, adv = inputs.valid_only()
        return _result(_aggregate(-adv * logp, weighted), inputs, old - logp, pg_clipfrac=0.0)
    raise ValueError(
        f"algorithm.bypass_loss_type={settings.bypass_loss_type!r}: valid are ppo_clip, reinforce"
    )


# --------------------------------------------------------------------------- critic, entropy


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    cliprange_value: float,
    agg: Aggregation | None = None,
) -> tuple[Tensor, float]:
    """Clipped value loss: ``½ agg(max((V - R)², (clip(V, V_old - c, V_old + c) - R)²))``.

    ``agg``: the aggregation (mode and mini-batch counts; ``token-mean`` over this call's
    tokens if not given).

    Returns the loss and the fraction of valid tokens where the clipped term was strictly
    larger. The prediction itself is clipped (not ``V_old + clip(V - V_old)``, which differs
    from ``V`` by round-off inside the range and would count ties as clipped); at a bound the
    gradient is shared as ``torch.minimum``/``maximum`` share ties, as in verl.
    """
    valid = mask.bool()
    values, old_values, returns = (
        torch.where(valid, x, torch.zeros_like(x)) for x in (values, old_values, returns)
    )
    clipped_values = torch.maximum(
        torch.minimum(values, old_values + cliprange_value), old_values - cliprange_value
    )
    unclipped_loss = (values - returns).square()
    clipped_loss = (clipped_values - returns).square()
    losses = torch.maximum(unclipped_loss, clipped_loss)
    loss = 0.5 * aggregate(losses, mask, agg or Aggregation())
    return loss, _fraction(clipped_loss > unclipped_loss, mask)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(z)`` over the last dim: ``logsumexp(z) - Σ softmax(z)·z``.

    No ``log`` of a softmax that underflowed to 0. Both terms are computed on ``z - max z``
    (the entropy is shift-invariant), so large logits do not cancel catastrophically in float32.
    Logits must be finite (``-inf`` vocabulary masking would give ``0·inf``).
    """
    shifted = logits - logits.detach().amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted, dim=-1)
    return torch.logsumexp(shifted, dim=-1) - (probs * shifted).sum(dim=-1)
