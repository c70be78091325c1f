"""Advantage estimators: rewards (and critic values) in, per-token advantages and returns out.

Every estimator has one signature, so the driver can pick one by name from ``ADV_ESTIMATORS``::

    fn(inputs: EstimatorInputs, settings) -> (advantages[B,T], returns[B,T])

``inputs`` (:class:`~treadle.algorithms.inputs.EstimatorInputs`) holds ``token_level_rewards``
and ``response_mask`` [B,T], ``group_ids`` and the inputs the estimator's registration ``needs``
(the driver fills them in): ``values`` (GAE), ``baseline_rewards`` [B] (ReMax),
``old_log_probs`` and ``sum_pi_squared`` [B,T] with ``rollout_is_weights`` [B,T] under rollout
correction (optimal token baseline), ``reward_components`` [B,K] (GDPO). ``settings`` is the
estimator's own frozen dataclass, registered with it (``GRPOSettings``: ``norm_adv_by_std``,
``eps``); the driver sets the fields that are config settings (``gamma``, ``lam``,
``norm_adv_by_std``, GDPO's ``reward_weights``), the others keep their defaults.

Choices made here:

- The mask is the truth: a sequence's *score* is the sum of its rewards at valid positions, and
  advantages and returns are exactly 0 where the mask is 0. Token-level recursions (GAE,
  REINFORCE++) skip masked positions (tool output inside a multi-turn response) instead of
  resetting at them, so credit flows across them.
- Groups come from ``group_ids`` (the prompt ``uid`` of each sample), never from positions.
  Group statistics are computed in float64 so that a group of equal rewards gets an advantage
  of exactly (not approximately) 0 even after dividing by a tiny std.
- A group of one sample has no baseline (mean 0, std 1), as in verl.
- A trajectory split into segments (a black-box agent's session whose prompts stopped
  extending each other) is several samples of one trajectory: ``sample_weights`` (1 / its
  segments) makes it count once in its group's mean, std and count (grpo, dr_grpo, rloo,
  reinforce_plus_plus_baseline, gpg, gdpo); each segment then gets its trajectory's
  advantage. grpo_passk, opo, prime and the optimal token baseline count segments as samples.
- Outcome estimators return ``returns == advantages`` (there is no critic to regress).
- Outputs are float32, or float64 for float64 rewards.

Every verl 0.9.1 estimator has a counterpart of the same name, equal to it where both are
defined the same way (tests/algorithms/test_advantages_parity.py). Where they differ, on purpose:

- verl sums a score over the whole row and leaves values at masked positions (inside a
  response's gaps) in its outputs; here masked positions neither count nor carry values.
- Group statistics are float64 here; verl's GRPO computes them in the rewards' dtype (its
  vectorized GRPO always in float32), so 8 equal float32 rewards of 0.3 get advantages of
  ~0.03 there and exactly 0 here.
- ``grpo_vectorized`` and ``rloo_vectorized`` are ``grpo`` and ``rloo``; verl's vectorized
  RLOO gives a group of one the advantage 0 where its RLOO gives the score (here: the score).
- GAE and REINFORCE++ skip the gaps in a response as verl 0.9.1 does (compared with gaps).
- ``gpg``: verl's ``α = B / (number of nonzero scores)``; here ``α = B / (number of nonzero
  advantages)``, the paper's (see :func:`gpg`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from treadle.algorithms.inputs import EstimatorInputs, NoSettings
from treadle.algorithms.registry import ADV_ESTIMATORS, register_adv_estimator
from treadle.algorithms.utils import (
    group_index,
    group_sum,
    masked_count,
    masked_sum,
    masked_whiten,
)

Result = tuple[Tensor, Tensor]


def _scores(inputs: EstimatorInputs) -> Tensor:
    """Outcome score per sequence (float64 [B]): the sum of its rewards at valid positions."""
    return masked_sum(inputs.token_level_rewards.double(), inputs.response_mask, dim=-1)


def _weights(inputs: EstimatorInputs, scores: Tensor) -> Tensor:
    """Each sample's weight in its group's statistics (float64 [B]): ``sample_weights``, so
    that the segments of one trajectory count once, or 1 each."""
    if inputs.sample_weights is None:
        return torch.ones_like(scores)
    return inputs.sample_weights.to(scores)


def _group_mean_std(
    scores: Tensor, index: Tensor, weights: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per-sample group mean and unbiased std over the group's trajectories (``weights``: each
    sample's share of its trajectory, 1 each by default); a group of one trajectory gets mean
    0, std 1."""
    w = torch.ones_like(scores) if weights is None else weights
    count = group_sum(w, index)  # trajectories
    mean = group_sum(w * scores, index) / count
    var = group_sum(w * (scores - mean) ** 2, index) / (count - 1).clamp(min=1)
    single = count < 1.5
    return torch.where(single, 0.0, mean), torch.where(single, 1.0, var.sqrt())


def _real(x: Tensor) -> Tensor:
    """``x`` in its own floating dtype, at least float32 (float64 inputs stay float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _broadcast(per_seq: Tensor, inputs: EstimatorInputs) -> Tensor:
    """Spread a per-sequence value [B] over the valid tokens of its row ([B,T], in the dtype
    of the rewards: float32, or float64 for float64 rewards)."""
    mask = inputs.response_mask
    spread = per_seq.to(_real(inputs.token_level_rewards).dtype).unsqueeze(-1).expand(mask.shape)
    return torch.where(mask.bool(), spread, 0.0)


def _outcome(per_seq: Tensor, inputs: EstimatorInputs) -> Result:
    """An outcome estimator's result: ``per_seq`` on every valid token, as advantages and
    returns."""
    advantages = _broadcast(per_seq, inputs)
    return advantages, advantages


def _whitened_outcome(per_seq: Tensor, inputs: EstimatorInputs) -> Result:
    """``per_seq`` on every valid token, whitened over the batch's valid tokens."""
    advantages = masked_whiten(_broadcast(per_seq, inputs), inputs.response_mask)
    return advantages, advantages


def _discounted_returns(rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + γ G_{next valid t}`` over valid positions; 0 where the mask is 0."""
    valid = response_mask.bool()
    running = torch.zeros_like(rewards[:, 0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, 0.0)
    return returns


@dataclass(frozen=True)
class GRPOSettings:
    """Divide by the group's std (``algorithm.norm_adv_by_std``), plus ``eps``."""

    norm_adv_by_std: bool = True
    eps: float = 1e-6


@dataclass(frozen=True)
class GammaSettings:
    """The discount ``algorithm.gamma``."""

    gamma: float = 1.0


@dataclass(frozen=True)
class GAESettings(GammaSettings):
    """The discount ``algorithm.gamma`` and GAE's ``algorithm.lam``."""

    lam: float = 1.0


@dataclass(frozen=True)
class EpsSettings:
    """``eps``: how far from 0 an advantage counts as nonzero."""

    eps: float = 1e-6


@register_adv_estimator("grpo", groups=True, settings=GRPOSettings)
def grpo(inputs: EstimatorInputs, settings: GRPOSettings) -> Result:
    """GRPO (DeepSeekMath, arXiv 2402.03300): ``A_i = (s_i - mean_g(s)) / (std_g(s) + eps)``.

    ``s_i`` is the sequence score, ``mean_g``/``std_g`` (unbiased) run over the samples with the
    same group id; every valid token of sequence ``i`` gets ``A_i``. With
    ``norm_adv_by_std=False`` there is no division (Dr. GRPO, arXiv 2503.20783).
    """
    scores = _scores(inputs)
    index = group_index(inputs.group_ids, scores)
    mean, std = _group_mean_std(scores, index, _weights(inputs, scores))
    adv = scores - mean
    if settings.norm_adv_by_std:
        adv = adv / (std + settings.eps)
    return _outcome(adv, inputs)


@register_adv_estimator("dr_grpo", groups=True, settings=NoSettings)
def dr_grpo(inputs: EstimatorInputs, settings: NoSettings) -> Result:
    """Dr. GRPO (arXiv 2503.20783): ``A_i = s_i - mean_g(s)``, i.e. GRPO without the std.

    Pair it with the ``seq-mean-token-sum-norm`` loss aggregation to remove the length bias too.
    """
    return grpo(inputs, GRPOSettings(norm_adv_by_std=False))


@register_adv_estimator("rloo", groups=True, settings=NoSettings)
def rloo(inputs: EstimatorInputs, settings: NoSettings) -> Result:
    """RLOO (Ahmadian et al., arXiv 2402.14740): ``A_i = s_i - (1/(n-1)) Σ_{j≠i} s_j``.

    The leave-one-out baseline, ``(n s_i - Σ_j s_j) / (n - 1)`` over the n samples of the
    group; a single-sample group has no baseline (``A_i = s_i``).
    """
    scores = _scores(inputs)
    index, w = group_index(inputs.group_ids, scores), _weights(inputs, scores)
    n = group_sum(w, index)  # trajectories
    loo = (n * scores - group_sum(w * scores, index)) / (n - 1).clamp(min=1)
    return _outcome(torch.where(n > 1.5, loo, scores), inputs)


@register_adv_estimator("reinforce_plus_plus", settings=GammaSettings)
def reinforce_plus_plus(inputs: EstimatorInputs, settings: GammaSettings) -> Result:
    """REINFORCE++ (Hu, arXiv 2501.03262): ``G_t = r_t + γ G_{t+1}``, ``A = whiten_batch(G)``.

    The discounted return over valid positions, whitened with the mean and std of
    all valid tokens of the batch. Returns are the un-whitened ``G``. ``group_ids`` is unused.
    """
    mask = inputs.response_mask
    returns = _discounted_returns(_real(inputs.token_level_rewards), mask, settings.gamma)
    return masked_whiten(returns, mask), returns


@register_adv_estimator("reinforce_plus_plus_baseline", groups=True, settings=NoSettings)
def reinforce_plus_plus_baseline(inputs: EstimatorInputs, settings: NoSettings) -> Result:
    """REINFORCE++-baseline (arXiv 2501.03262): ``A = whiten_batch(s_i - mean_g(s))``.

    The group mean is subtracted per sequence, spread over its valid tokens, then whitened with
    the mean and std of all valid tokens of the batch (token-weighted, as in verl).
    """
    scores = _scores(inputs)
    index = group_index(inputs.group_ids, scores)
    mean, _std = _group_mean_std(scores, index, _weights(inputs, scores))
    return _whitened_outcome(scores - mean, inputs)


@register_adv_estimator("remax", needs=("baseline_rewards",), settings=NoSettings)
def remax(inputs: EstimatorInputs, settings: NoSettings) -> Result:
    """ReMax (Li et al., arXiv 2310.10505): ``A_t = G_t - s(greedy response to the prompt)``.

    ``G_t = Σ_{t' >= t} r_t'`` is the reward-to-go over valid positions (the returns), which is
    the score ``s_i`` at every token when the reward is an outcome on the last token;
    ``baseline_rewards`` [B] is the score of the greedy response to each sample's prompt. As in
    verl, a per-token reward (KL in the reward) gives each token its own reward-to-go.
    """
    if inputs.baseline_rewards is None:
        raise ValueError(
            "remax needs baseline_rewards: the score [B] of the greedy response to each prompt"
        )
    mask = inputs.response_mask
    returns = _discounted_returns(_real(inputs.token_level_rewards), mask, 1.0)
    baseline = inputs.baseline_rewards.to(returns).reshape(-1, 1)
    advantages = torch.where(mask.bool(), returns - baseline, 0.0)
    return advantages, returns


@register_adv_estimator("gae", needs=("values",), settings=GAESettings)
def gae(inputs: EstimatorInputs, settings: GAESettings) -> Result:
    """GAE (Schulman et al., arXiv 1506.02438): ``δ_t = r_t + γ V_{t+1} - V_t``,
    ``A_t = δ_t + γλ A_{t+1}``, returns ``A_t + V_t``; A whitened over the batch.

    Over the valid positions of each row: ``t+1`` is the next valid
    position (``V = A = 0`` past the last one). Returns ``R_t = A_t + V_t`` (the critic's
    target), then advantages are whitened over the valid tokens of the batch.
    """
    if inputs.values is None:
        raise ValueError("gae needs values from a critic (pass values=[B,T])")
    gamma, lam = settings.gamma, settings.lam
    rewards = _real(inputs.token_level_rewards)
    values = inputs.values.detach().to(rewards.dtype)
    valid = inputs.response_mask.bool()
    next_value = last_adv = torch.zeros_like(rewards[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * last_adv
        last_adv = torch.where(valid[:, t], adv_t, last_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(valid[:, t], adv_t, 0.0)
    returns = torch.where(valid, advantages + values, 0.0)
    return masked_whiten(advantages, inputs.response_mask), returns


@register_adv_estimator("opo", groups=True, settings=NoSettings)
def opo(inputs: EstimatorInputs, settings: NoSettings) -> Result:
    """OPO (Hao et al., arXiv 2505.23585): ``A_i = s_i - Σ_j l_j s_j / Σ_j l_j``.

    A length-weighted optimal baseline over the group, ``l_j`` = number of valid tokens of
    response ``j``; a single-sample group has no baseline.
    """
    scores = _scores(inputs)
    lengths = masked_count(inputs.response_mask, dim=-1).double()
    index = group_index(inputs.group_ids, scores)
    n = group_sum(torch.ones_like(scores), index)
    baseline = group_sum(lengths * scores, index) / group_sum(lengths, index).clamp(min=1)
    return _outcome(scores - torch.where(n > 1, baseline, 0.0), inputs)


@register_adv_estimator("gpg", groups=True, settings=EpsSettings)
def gpg(inputs: EstimatorInputs, settings: EpsSettings) -> Result:
    """GPG (Chu et al., arXiv 2504.02546): ``A_i = α (s_i - mean_g(s))``, ``α = B / (B - M)``.

    A group-mean baseline, no std, bias-corrected by ``α``: ``B`` samples in the batch, ``M`` of
    them with zero advantage (``|s_i - mean_g| <= eps``). Those samples carry no gradient, so the
    batch-mean loss would shrink the gradient by ``(B - M) / B``; ``α`` undoes that. With 0/1
    rewards the zero-advantage samples are exactly the groups whose rewards are all equal, the
    case the paper describes. ``norm_adv_by_std`` is not read: this is the paper's
    ``F_norm = 1`` variant (its optional std normalisation is left out).
    """
    scores = _scores(inputs)
    index = group_index(inputs.group_ids, scores)
    mean, _std = _group_mean_std(scores, index, _weights(inputs, scores))
    centered = scores - mean
    n_valid = (centered.abs() > settings.eps).sum().clamp(min=1)
    return _outcome(centered * scores.shape[0] / n_valid, inputs)


ADV_ESTIMATORS.alias("grpo_vectorized", "grpo")
ADV_ESTIMATORS.alias("rloo_vectorized", "rloo")


@register_adv_estimator("grpo_passk", groups=True, settings=GRPOSettings)
def grpo_passk(inputs: EstimatorInputs, settings: GRPOSettings) -> Result:
    """Pass@k (Tang et al., arXiv 2503.19595): ``A_best = (s_(1) - s_(2)) / (std_g(s) + eps)``.

    The objective is the best score of the group (``k`` = the group size, ``rollout.n``); its
    leave-one-out baseline for a sample is the best score of the others, which is the group's
    best for every sample but the best one. So only the best sample of each group gets an
    advantage, its margin over the second best (divided by the group's unbiased std unless
    ``norm_adv_by_std=False``); every other sample gets 0, and a tie for the best gives 0 to
    all. A group of one has no second best: a ``ValueError``, as in verl.
    """
    scores = _scores(inputs)
    index = group_index(inputs.group_ids, scores)
    adv = torch.zeros_like(scores)
    for g in range(int(index.max()) + 1 if len(index) else 0):
        members = (index == g).nonzero().flatten()
        if len(members) < 2:
            raise ValueError(
                f"grpo_passk needs at least 2 samples per group; group {g} (the group of "
                f"sample {int(members[0])}) has 1"
            )
        group = scores[members]
        top, where = group.topk(2)
        margin = top[0] - top[1]
        norm = settings.norm_adv_by_std
        adv[members[where[0]]] = margin / (group.std() + settings.eps) if norm else margin
    return _outcome(adv, inputs)


@dataclass(frozen=True)
class GDPOSettings(GRPOSettings):
    """GRPO's settings, and the weight of each reward component
    (``algorithm.gdpo_reward_weights``; 1 each if not given)."""

    reward_weights: Sequence[float] | None = None


@register_adv_estimator("gdpo", groups=True, needs=("reward_components",), settings=GDPOSettings)
def gdpo(inputs: EstimatorInputs, settings: GDPOSettings) -> Result:
    """GDPO (Liu et al., arXiv 2601.05242): ``A = whiten(Σ_k w_k (c_k - μ_g c_k) / (σ_g c_k + ε))``.

    Group reward-decoupled normalization: each reward component ``c_k`` (``reward_components``
    [B, K], e.g. format and accuracy, as the reward function returns them) is normalized
    within its group as GRPO normalizes the score, so a component with a large spread cannot
    drown out the others; the normalized components are summed with ``reward_weights`` (1 each
    if not given), spread over the valid tokens and whitened over the batch (token-weighted).
    Without components the score is the only one (GRPO followed by whitening), as in verl.
    The components are the reward function's own numbers: the KL penalty in the reward and the
    over-long penalty, which shape the token-level rewards, do not enter.
    """
    scores = _scores(inputs)
    components = inputs.reward_components
    comps = scores[:, None] if components is None else components.double()
    if comps.ndim != 2 or comps.shape[0] != scores.shape[0]:
        raise ValueError(
            f"gdpo: reward_components must be [B, K] with B={scores.shape[0]}, got "
            f"{list(comps.shape)}"
        )
    k, reward_weights = comps.shape[1], settings.reward_weights
    if reward_weights is not None and len(reward_weights) != k:
        raise ValueError(f"gdpo: {len(reward_weights)} reward_weights for {k} components")
    weights = comps.new_tensor(
        [1.0] * k if reward_weights is None else list(reward_weights), dtype=torch.float64
    )
    index = group_index(inputs.group_ids, scores)
    total = torch.zeros_like(scores)
    for j in range(k):
        mean, std = _group_mean_std(comps[:, j], index, _weights(inputs, scores))
        centered = comps[:, j] - mean
        scaled = centered / (std + settings.eps) if settings.norm_adv_by_std else centered
        total = total + weights[j] * scaled
    return _whitened_outcome(total, inputs)


@dataclass(frozen=True)
class OTBSettings:
    """The optimal token baseline's ``handle_zero_tail`` and the ``eps`` of its division."""

    handle_zero_tail: bool = True
    eps: float = 1e-8


# both variants read the actor's old log-probs and Σπ², and compare within a group
_register_otb = partial(
    register_adv_estimator,
    groups=True,
    needs=("old_log_probs", "sum_pi_squared"),
    settings=OTBSettings,
)


def _optimal_token_baseline(
    inputs: EstimatorInputs, settings: OTBSettings, *, by_valid_index: bool, name: str
) -> Result:
    """The optimal token baseline, time aligned by column or by valid-token index."""
    old_log_probs, sum_pi_squared = inputs.old_log_probs, inputs.sum_pi_squared
    if old_log_probs is None or sum_pi_squared is None:
        raise ValueError(
            f"{name} needs old_log_probs and sum_pi_squared [B,T] (the actor's log-prob of each "
            "response token and Σ_v π(v)² of its distribution there)"
        )
    rewards, mask = inputs.token_level_rewards, inputs.response_mask
    dtype = _real(rewards).dtype
    valid = mask.bool()
    returns = _discounted_returns(rewards.to(dtype), mask, 1.0)
    w = 1 - 2 * old_log_probs.to(dtype).exp() + sum_pi_squared.to(dtype)
    if inputs.rollout_is_weights is not None:
        w = w * inputs.rollout_is_weights.to(dtype) ** 2
    cum_w = torch.where(valid, w, 0.0).cumsum(-1)
    # position of each valid token on the group's shared time axis
    rows, cols = valid.nonzero(as_tuple=True)
    pos = (valid.long().cumsum(-1) - 1)[rows, cols] if by_valid_index else cols
    aligned_g, aligned_w, aligned_m = (
        torch.zeros(mask.shape, dtype=dtype, device=mask.device) for _ in range(3)
    )
    aligned_g[rows, pos] = returns[rows, cols]
    aligned_w[rows, pos] = cum_w[rows, cols]
    aligned_m[rows, pos] = 1.0
    lengths = valid.sum(-1)
    index = group_index(inputs.group_ids, returns[:, 0])
    baseline = torch.zeros_like(aligned_g)
    for g in range(int(index.max()) + 1 if len(index) else 0):
        members = (index == g).nonzero().flatten()
        if by_valid_index:  # verl's TIR variant leaves empty responses out of the group
            members = members[lengths[members] > 0]
        if len(members) < 2:  # no baseline for a single trajectory
            continue
        wm = aligned_w[members] * aligned_m[members]
        b = (aligned_g[members] * wm).sum(0) / (wm.sum(0) + settings.eps)
        baseline[members] = b
        if settings.handle_zero_tail:  # the unique longest trajectory's tail has no other
            length = lengths[members]
            top = length.topk(2).values
            longest = (length == top[0]).nonzero().flatten()
            if len(longest) == 1 and top[0] > top[1]:
                baseline[members[longest[0]], int(top[1]) :] = 0.0
    advantages = torch.zeros_like(returns)
    advantages[rows, cols] = aligned_g[rows, pos] - baseline[rows, pos]
    return advantages, returns


@_register_otb("optimal_token_baseline")
def optimal_token_baseline(inputs: EstimatorInputs, settings: OTBSettings) -> Result:
    """Optimal token baseline (verl): ``A_t = G_t - Σ_g G_t W_t / (Σ_g W_t + eps)``.

    A baseline per time step ``t`` (the column of the response), shared by the group:
    ``G_t`` is the reward-to-go, ``W_t = Σ_{j <= t} w_j`` the cumulative path-variance proxy
    with ``w_j = ||∇ log π(y_j)||²`` (over the logits) ``= 1 - 2 π(y_j) + Σ_v π(v)²``, from the
    actor's ``old_log_probs`` and ``sum_pi_squared``. With ``rollout_is_weights`` ρ (rollout
    correction), ``w_j`` is scaled by ``ρ_j²``. A single trajectory has no baseline; with
    ``handle_zero_tail`` the part of the unique longest response past the second longest gets
    no baseline either (it would be its own return, an advantage of 0). Returns are ``G_t``.
    Responses whose mask has gaps (tool output) are aligned by column here; see
    ``tir_optimal_token_baseline`` for alignment by the model's own tokens.
    """
    return _optimal_token_baseline(
        inputs, settings, by_valid_index=False, name="optimal_token_baseline"
    )


@_register_otb("tir_optimal_token_baseline")
def tir_optimal_token_baseline(inputs: EstimatorInputs, settings: OTBSettings) -> Result:
    """Multi-turn optimal token baseline (verl): ``A_t = G_t - Σ_g G_t W_t / (Σ_g W_t + eps)``
    with ``t`` counted in the model's own tokens.

    As ``optimal_token_baseline``, but the ``t``-th step of a trajectory is its ``t``-th valid
    token: tool output between turns (mask 0) is skipped, so the baseline compares the
    trajectories of a group token for token of what the model wrote (tool-integrated reasoning).
    Empty responses are left out of their group. On responses without gaps both are the same.
    """
    return _optimal_token_baseline(
        inputs, settings, by_valid_index=True, name="tir_optimal_token_baseline"
    )
