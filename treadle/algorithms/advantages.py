"""Advantage estimators: rewards (and critic values) in, per-token advantages and returns out.

Every estimator has one signature, so the driver can pick one by name from ``ADV_ESTIMATORS``::

    fn(token_level_rewards[B,T], response_mask[B,T], *, group_ids, values=None, gamma=1.0,
       lam=1.0, norm_adv_by_std=True, eps=1e-6, **_) -> (advantages[B,T], returns[B,T])

Choices made here:

- The mask is the truth: a sequence's *score* is the sum of its rewards at valid positions, and
  advantages and returns are exactly 0 where the mask is 0. Token-level recursions (GAE,
  REINFORCE++) skip masked positions (tool output inside a multi-turn response) instead of
  resetting at them, so credit flows across them.
- Groups come from ``group_ids`` (the prompt ``uid`` of each sample), never from positions.
  Group statistics are computed in float64 so that a group of equal rewards gets an advantage
  of exactly (not approximately) 0 even after dividing by a tiny std.
- A group of one sample has no baseline (mean 0, std 1), as in verl.
- Outcome estimators return ``returns == advantages`` (there is no critic to regress).
- Extra keyword arguments are ignored (``**_``) so the driver can pass one set to any estimator.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from treadle.algorithms.registry import register_adv_estimator
from treadle.algorithms.utils import masked_count, masked_sum, masked_whiten


def _scores(token_level_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Outcome score per sequence (float64 [B]): the sum of its rewards at valid positions."""
    return masked_sum(token_level_rewards.double(), response_mask, dim=-1)


def _group_index(group_ids: Sequence[Hashable], scores: Tensor) -> Tensor:
    """Dense group index [B] (0..G-1) of each sample, in order of first appearance."""
    ids = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    if len(ids) != scores.shape[0]:
        raise ValueError(f"group_ids has {len(ids)} entries but the batch has {scores.shape[0]}")
    lookup: dict[Hashable, int] = {}
    index = [lookup.setdefault(g, len(lookup)) for g in ids]
    return torch.tensor(index, dtype=torch.long, device=scores.device)


def _group_sum(x: Tensor, index: Tensor) -> Tensor:
    """For each sample, the sum of ``x`` over the samples of its group ([B] -> [B])."""
    sums = torch.zeros(int(index.max()) + 1, dtype=x.dtype, device=x.device)
    return sums.index_add_(0, index, x)[index]


def _group_mean_std(scores: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample group mean and unbiased std; a single-sample group gets mean 0, std 1."""
    count = _group_sum(torch.ones_like(scores), index)
    mean = _group_sum(scores, index) / count
    var = _group_sum((scores - mean) ** 2, index) / (count - 1).clamp(min=1)
    single = count == 1
    return torch.where(single, 0.0, mean), torch.where(single, 1.0, var.sqrt())


def _broadcast(per_seq: Tensor, response_mask: Tensor) -> Tensor:
    """Spread a per-sequence value [B] over the valid tokens of its row (float32 [B,T])."""
    spread = per_seq.float().unsqueeze(-1).expand(response_mask.shape)
    return torch.where(response_mask.bool(), spread, 0.0)


def _discounted_returns(rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + γ G_{next valid t}`` over valid positions; 0 where the mask is 0."""
    valid = response_mask.bool()
    running = torch.zeros_like(rewards[:, 0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, 0.0)
    return returns


@register_adv_estimator("grpo", groups=True)
def grpo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """GRPO (DeepSeekMath, arXiv 2402.03300): ``A_i = (s_i - mean_g(s)) / (std_g(s) + eps)``.

    ``s_i`` is the sequence score, ``mean_g``/``std_g`` (unbiased) run over the samples with the
    same group id; every valid token of sequence ``i`` gets ``A_i``. With
    ``norm_adv_by_std=False`` there is no division (Dr. GRPO, arXiv 2503.20783).
    """
    scores = _scores(token_level_rewards, response_mask)
    mean, std = _group_mean_std(scores, _group_index(group_ids, scores))
    adv = scores - mean
    if norm_adv_by_std:
        adv = adv / (std + eps)
    advantages = _broadcast(adv, response_mask)
    return advantages, advantages


@register_adv_estimator("dr_grpo", groups=True)
def dr_grpo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """Dr. GRPO (arXiv 2503.20783): ``A_i = s_i - mean_g(s)``, i.e. GRPO without the std.

    Pair it with the ``seq-mean-token-sum-norm`` loss aggregation to remove the length bias too.
    """
    return grpo(token_level_rewards, response_mask, group_ids=group_ids, norm_adv_by_std=False)


@register_adv_estimator("rloo", groups=True)
def rloo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al., arXiv 2402.14740): leave-one-out baseline.

    ``A_i = s_i - (1/(n-1)) Σ_{j≠i} s_j = (n s_i - Σ_j s_j) / (n - 1)`` over the n samples of the
    group; a single-sample group has no baseline (``A_i = s_i``).
    """
    scores = _scores(token_level_rewards, response_mask)
    index = _group_index(group_ids, scores)
    n = _group_sum(torch.ones_like(scores), index)
    loo = (n * scores - _group_sum(scores, index)) / (n - 1).clamp(min=1)
    advantages = _broadcast(torch.where(n > 1, loo, scores), response_mask)
    return advantages, advantages


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    gamma: float = 1.0,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu, arXiv 2501.03262): discounted return, whitened over the batch.

    ``G_t = r_t + γ G_{t+1}`` (over valid positions), ``A = whiten(G)`` with the mean and std of
    all valid tokens of the batch. Returns are the un-whitened ``G``. ``group_ids`` is unused.
    """
    returns = _discounted_returns(token_level_rewards.float(), response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@register_adv_estimator("reinforce_plus_plus_baseline", groups=True)
def reinforce_plus_plus_baseline(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (arXiv 2501.03262): ``A = whiten_batch(s_i - mean_g(s))``.

    The group mean is subtracted per sequence, spread over its valid tokens, then whitened with
    the mean and std of all valid tokens of the batch (token-weighted, as in verl).
    """
    scores = _scores(token_level_rewards, response_mask)
    mean, _std = _group_mean_std(scores, _group_index(group_ids, scores))
    advantages = masked_whiten(_broadcast(scores - mean, response_mask), response_mask)
    return advantages, advantages


@register_adv_estimator("remax", needs=("baseline_rewards",))
def remax(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    baseline_rewards: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al., arXiv 2310.10505): ``A_i = s_i - s(greedy response to prompt i)``.

    ``baseline_rewards`` [B] is the score of the greedy response to each sample's prompt.
    Returns are the scores ``s_i`` on the valid tokens.
    """
    if baseline_rewards is None:
        raise ValueError(
            "remax needs baseline_rewards: the score [B] of the greedy response to each prompt"
        )
    scores = _scores(token_level_rewards, response_mask)
    adv = scores - baseline_rewards.to(scores).reshape(scores.shape)
    return _broadcast(adv, response_mask), _broadcast(scores, response_mask)


@register_adv_estimator("gae", needs=("values",))
def gae(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al., arXiv 1506.02438), over the valid positions of each row.

    ``δ_t = r_t + γ V_{t+1} - V_t``, ``A_t = δ_t + γλ A_{t+1}`` where ``t+1`` is the next valid
    position (``V = A = 0`` past the last one). Returns ``R_t = A_t + V_t`` (the critic's
    target), then advantages are whitened over the valid tokens of the batch.
    """
    if values is None:
        raise ValueError("gae needs values from a critic (pass values=[B,T])")
    rewards, values = token_level_rewards.float(), values.detach().float()
    valid = response_mask.bool()
    next_value = last_adv = torch.zeros_like(rewards[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * last_adv
        last_adv = torch.where(valid[:, t], adv_t, last_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(valid[:, t], adv_t, 0.0)
    returns = torch.where(valid, advantages + values, 0.0)
    return masked_whiten(advantages, response_mask), returns


@register_adv_estimator("opo")
def opo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """OPO (Hao et al., arXiv 2505.23585): length-weighted optimal baseline.

    ``A_i = s_i - Σ_j l_j s_j / Σ_j l_j`` over the group, ``l_j`` = number of valid tokens of
    response ``j``; a single-sample group has no baseline.
    """
    scores = _scores(token_level_rewards, response_mask)
    lengths = masked_count(response_mask, dim=-1).double()
    index = _group_index(group_ids, scores)
    n = _group_sum(torch.ones_like(scores), index)
    baseline = _group_sum(lengths * scores, index) / _group_sum(lengths, index).clamp(min=1)
    advantages = _broadcast(scores - torch.where(n > 1, baseline, 0.0), response_mask)
    return advantages, advantages


@register_adv_estimator("gpg")
def gpg(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    eps: float = 1e-6,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """GPG (Chu et al., arXiv 2504.02546): group-mean baseline, no std, bias-corrected.

    ``A_i = α (s_i - mean_g(s))`` with ``α = B / (B - M)``: ``B`` samples in the batch, ``M`` of
    them with zero advantage (``|s_i - mean_g| <= eps``). Those samples carry no gradient, so the
    batch-mean loss would shrink the gradient by ``(B - M) / B``; ``α`` undoes that. With 0/1
    rewards the zero-advantage samples are exactly the groups whose rewards are all equal, the
    case the paper describes. ``norm_adv_by_std`` is ignored: this is the paper's
    ``F_norm = 1`` variant (its optional std normalisation is left out).
    """
    scores = _scores(token_level_rewards, response_mask)
    mean, _std = _group_mean_std(scores, _group_index(group_ids, scores))
    centered = scores - mean
    n_valid = (centered.abs() > eps).sum().clamp(min=1)
    advantages = _broadcast(centered * scores.shape[0] / n_valid, response_mask)
    return advantages, advantages
