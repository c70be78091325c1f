"""PRIME: process rewards from an implicit PRM, learned online from outcome labels.

PRIME (Cui et al., arXiv 2502.01456) trains a causal LM π_φ beside the policy, from the same
weights, and reads a *process* reward off it: the log-ratio to a frozen copy π_ref,

    q_t = log π_φ(y_t | x, y_<t) - log π_ref(y_t | x, y_<t),    r_t = β q_t,

which needs only outcome labels to train (the sequence's β Σ_t q_t is an implicit outcome
reward, fitted to the 0/1 correctness of the response). Here are the pure pieces: the token
rewards, the PRM's two losses, the accuracy metrics and the ``prime`` advantage estimator. The
PRM's worker is :mod:`treadle.workers.prm`, the driver's side :mod:`treadle.trainers.prime`.

The math follows verl's recipe (``recipe/prime``: ``prime_core_algos.py``, ``prime_dp_rm.py``),
with these deliberate differences:

- **The mask is the truth.** Rewards, returns and advantages are 0 where the mask is 0 (verl
  leaves whitened values on padding, which its loss then masks). A row with no valid token
  has an implicit-reward mean of 0 (verl: NaN).
- **Groups come from ids**, not from runs of ``n`` consecutive rows, and may differ in size;
  a group of one sample has no leave-one-out baseline (verl divides by ``n - 1 = 0``).
- **The CE loss** is computed from logits (``binary_cross_entropy_with_logits``), not as
  ``binary_cross_entropy(sigmoid(...))``: the same value where the sigmoid does not saturate,
  and a finite gradient where it does.
- **``batch_norm``** divides by the maximum over the whole batch (verl: over each rank's
  shard), so the rewards do not depend on the number of ranks.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from treadle.algorithms.inputs import EstimatorInputs
from treadle.algorithms.registry import register_adv_estimator
from treadle.algorithms.utils import group_index, group_sum, masked_whiten


def last_valid(response_mask: Tensor) -> Tensor:
    """One-hot ``[B, T]`` of each row's last valid position (all 0 for an empty row)."""
    valid = response_mask.bool()
    positions = torch.arange(valid.shape[-1], device=valid.device).expand(valid.shape)
    last = torch.where(valid, positions, -1).amax(-1, keepdim=True)
    return (positions == last) & valid


def implicit_process_rewards(
    log_ratio: Tensor, response_mask: Tensor, beta: float, norm: str = "batch_norm"
) -> Tensor:
    """PRIME (Cui et al., arXiv 2502.01456): ``r_t = β (log π_φ(y_t) - log π_ref(y_t))``.

    ``log_ratio`` is ``q_t = log π_φ - log π_ref`` per response token. As verl's recipe
    (``prime_granularity=token``) does, each row's last valid token gets no implicit reward:
    it carries the outcome reward alone. ``norm="batch_norm"`` (verl's ``prime_norm``) divides
    by ``max |Σ_{t'≥t} r_t'|`` over the whole batch, plus 1e-6; ``"none"`` leaves ``β q``.
    """
    if norm not in ("batch_norm", "none"):
        raise ValueError(f"unknown PRIME reward norm {norm!r}; valid: batch_norm, none")
    keep = response_mask.bool() & ~last_valid(response_mask)
    rewards = torch.where(keep, beta * log_ratio.float(), 0.0)
    if norm == "batch_norm":
        to_go = rewards.flip(-1).cumsum(-1).flip(-1)
        rewards = rewards / (to_go.abs().max() + 1e-6) if rewards.numel() else rewards
    return rewards


def sequence_log_ratio(log_ratio: Tensor, response_mask: Tensor) -> Tensor:
    """``Q = Σ_t q_t`` over each row's valid tokens ([B]): β Q is the implicit outcome reward."""
    return torch.where(response_mask.bool(), log_ratio, 0.0).sum(-1)


def prime_ce_loss(log_ratio: Tensor, response_mask: Tensor, labels: Tensor, beta: float) -> Tensor:
    """PRIME's PRM loss (Cui et al., arXiv 2502.01456): ``BCE(σ(β Σ_t q_t), y)`` per sample.

    ``labels`` are the outcomes ``y`` in [0, 1] ([B]); returns the per-sample loss [B] (verl's
    ``compute_ce_dpo_loss_rm`` is its mean). Computed from the logit ``β Q``, see the module.
    """
    logits = beta * sequence_log_ratio(log_ratio, response_mask)
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")


def dpo_opponents(seq_q: Tensor, labels: Tensor, group_ids: Sequence[Hashable]) -> Tensor:
    """For PRIME's ``dpo`` loss: each sample's opponents' mean ``Q`` in its group ([B]).

    A sample with label > 0 is compared with the group's samples of a lower label, one with
    label 0 with those of a higher label; no such sample: 0 (verl's ``Q_bc``/``acc_bc``).
    """
    q, y = seq_q.double(), labels.double()
    index = group_index(group_ids, q)
    same = index[:, None] == index[None, :]
    lower = same & (y[None, :] < y[:, None])
    higher = same & (y[None, :] > y[:, None])
    opp = torch.where((y > 0)[:, None], lower, higher)
    count = opp.sum(-1)
    total = torch.where(opp, q[None, :], 0.0).sum(-1)
    return torch.where(count > 0, total / count.clamp(min=1), 0.0).to(seq_q.dtype)


def prime_dpo_loss(
    log_ratio: Tensor, response_mask: Tensor, labels: Tensor, opponents: Tensor, beta: float
) -> Tensor:
    """PRIME's pairwise PRM loss (verl ``loss_type=dpo``): ``-log σ(s β (Q - Q_opp))``, per
    sample ([B]).

    ``s = +1`` for a label > 0, else ``-1``; ``Q_opp`` is :func:`dpo_opponents` of the ``Q``
    the PRM gave before this update (a constant, as verl's "detached" loss).
    """
    q = sequence_log_ratio(log_ratio, response_mask)
    sign = torch.where(labels > 0, 1.0, -1.0).to(q.dtype)
    return -F.logsigmoid(sign * beta * (q - opponents.to(q.dtype)))


def pairwise_accuracy(scores: Tensor, labels: Tensor, group_ids: Sequence[Hashable]) -> float:
    """verl's ``dpo_acc``: how often the PRM orders a group's pairs as their labels do.

    Per group: over pairs (i < j) of different labels, ``[(s_i > s_j) == (y_i > y_j)]``
    weighted by ``|y_i - y_j|``; a group whose labels are all equal counts 0.5. Mean over
    groups (in order of first appearance).
    """
    s, y = scores.double(), labels.double()
    index = group_index(group_ids, s)
    per_group = []
    for g in range(int(index.max()) + 1 if len(index) else 0):
        rows = (index == g).nonzero().flatten()
        i, j = torch.triu_indices(len(rows), len(rows), offset=1)
        ds, dy = s[rows[i]] - s[rows[j]], y[rows[i]] - y[rows[j]]
        weight = dy.abs().sum()
        agree = ((ds > 0) == (dy > 0)).double()
        per_group.append(float((agree * dy.abs()).sum() / weight) if weight > 0 else 0.5)
    return sum(per_group) / len(per_group) if per_group else 0.5


def sign_accuracy(scores: Tensor, labels: Tensor) -> float:
    """verl's ``dpo_acc_abs``: the fraction of samples with ``sign(s) == sign(2y - 1)``."""
    return float((torch.sign(scores) == torch.sign(2 * labels.to(scores) - 1)).float().mean())


def _leave_one_out(values: Tensor, per_sample: Tensor, index: Tensor, valid: Tensor) -> Tensor:
    """verl's ``masked_rloo``: ``v n/(n-1) - Σ_g m / (n-1)`` at valid positions, ``m`` the
    per-sample means; a group of one keeps ``v``."""
    n = group_sum(torch.ones_like(per_sample), index)
    baseline = (group_sum(per_sample, index) / (n - 1).clamp(min=1))[:, None]
    scaled = (n / (n - 1).clamp(min=1))[:, None]
    out = torch.where((n > 1)[:, None], values * scaled - baseline, values)
    return torch.where(valid, out, 0.0)


@dataclass(frozen=True)
class PrimeSettings:
    """The weights of the two reward sources (``prime.reward_gt_coef``,
    ``prime.reward_dpo_coef``); 0 drops a source."""

    reward_gt_coef: float = 5.0
    reward_dpo_coef: float = 5.0


@register_adv_estimator("prime", needs=("implicit_rewards",), groups=True, settings=PrimeSettings)
def prime_advantages(inputs: EstimatorInputs, settings: PrimeSettings) -> tuple[Tensor, Tensor]:
    """PRIME (Cui et al., arXiv 2502.01456): ``A = whiten(Σ_{t'≥t} c_gt RLOO(s) + c_dpo RLOO(r))``.

    Two reward sources, each with its own leave-one-out baseline over the group (verl's
    ``compute_rloo_advantage_return``), then summed with their coefficients:

    - outcome: the sequence score ``s_i`` (the sum of ``token_level_rewards``), ``s_i -
      mean_{j≠i} s_j`` on the row's last valid token;
    - implicit: ``r_t n/(n-1) - Σ_{j∈g} mean_t(r_j)/(n-1)`` on every valid token, ``r`` the
      implicit PRM's token rewards (:func:`implicit_process_rewards`).

    Returns are the rewards to go (γ = 1), advantages the returns whitened over the batch's
    valid tokens. A coefficient of 0 drops its source. ``token_level_rewards`` with KL in the
    reward shaped in (``algorithm.kl_reward_coef``) enter through their sum; verl's recipe
    ignores that penalty.
    """
    if inputs.implicit_rewards is None:
        raise ValueError("the prime estimator needs implicit_rewards (the implicit PRM's)")
    mask, gt_coef, dpo_coef = (
        inputs.response_mask,
        settings.reward_gt_coef,
        settings.reward_dpo_coef,
    )
    valid = mask.bool()
    scores = torch.where(valid, inputs.token_level_rewards.double(), 0.0).sum(-1)
    index = group_index(inputs.group_ids, scores)
    total = torch.zeros(valid.shape, dtype=torch.float64, device=valid.device)
    if gt_coef:
        last = last_valid(mask)
        outcome = torch.where(last, scores[:, None], 0.0)
        total += gt_coef * _leave_one_out(outcome, scores, index, last)
    if dpo_coef:
        r = torch.where(valid, inputs.implicit_rewards.double(), 0.0)
        count = valid.sum(-1)
        means = torch.where(count > 0, r.sum(-1) / count.clamp(min=1), 0.0)
        total += dpo_coef * _leave_one_out(r, means, index, valid)
    returns = torch.where(valid, total.flip(-1).cumsum(-1).flip(-1), 0.0)
    advantages = masked_whiten(returns, mask)
    return advantages.float(), returns.float()
