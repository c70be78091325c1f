"""PRIME's pure functions: by hand, and against verl's recipe math (``recipe/prime`` of
volcengine/verl, ``prime_core_algos.py`` and ``prime_dp_rm.py``) transcribed below, since the
verl wheel does not ship its recipes."""

from __future__ import annotations

import math

import pytest
import torch
from algorithm_calls import estimate
from reference import verl_core_algos
from torch.testing import assert_close

from treadle.algorithms import ADV_ESTIMATORS
from treadle.algorithms.prime import (
    dpo_opponents,
    implicit_process_rewards,
    pairwise_accuracy,
    prime_advantages,
    prime_ce_loss,
    prime_dpo_loss,
    sign_accuracy,
)

# --------------------------------------------------------------------------- verl, transcribed


def verl_token_scores(q: torch.Tensor, lengths: list[int], beta: float, norm: bool) -> torch.Tensor:
    """prime_dp_rm.py, lambda=0, prime_granularity=token, then prime_norm."""
    q = q.clone()
    for i, n in enumerate(lengths):
        q[i, n:] = 0
    r = q * beta
    score = torch.zeros_like(q)
    for i, n in enumerate(lengths):
        score[i, : n - 1] = r[i, : n - 1]
    if norm:  # batch_norm
        reverse_cumsum = torch.cumsum(score.flip(dims=[1]), dim=-1).flip(dims=[1])
        score = score / (reverse_cumsum.abs().max() + 1e-6)
    return score


def verl_rloo_advantage(acc, rm_scores, mask, n, gt_coef, dpo_coef):
    """prime_core_algos.py::compute_rloo_advantage_return (contiguous groups of n)."""

    def masked_rloo(reward_original, m):
        reward = reward_original.clone()
        reward[~m] = 0
        for start in range(0, reward.shape[0], n):
            means = torch.cat(
                [
                    reward[p : p + 1][m[p : p + 1]].mean(dim=0, keepdim=True)
                    for p in range(start, start + n)
                ]
            )
            baseline = means.sum() / (n - 1)
            block, bm = reward[start : start + n], m[start : start + n]
            block[bm] = block[bm] * (n / (n - 1)) - baseline
        return reward

    terms = [masked_rloo(rm_scores, mask.bool()) * dpo_coef]
    length = mask.sum(-1).long()
    rows = torch.arange(len(length))
    gt = torch.zeros_like(mask, dtype=acc.dtype)
    gt_mask = torch.zeros_like(mask, dtype=torch.bool)
    gt_mask[rows, length - 1] = True
    gt[rows, length - 1] = acc
    terms.append(masked_rloo(gt, gt_mask) * gt_coef)
    final = sum(terms)
    returns = (final * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    verl_core_algos()  # imports verl.utils.torch_functional with its stand-ins
    import verl.utils.torch_functional as verl_F

    return verl_F.masked_whiten(returns.clone(), mask), returns


def verl_ce_loss(q, acc, mask, beta):
    scores = ((q * mask).sum(dim=1) * beta).sigmoid()
    return torch.nn.functional.binary_cross_entropy(scores, acc)


def verl_dpo_loss(q, acc, q_bc, acc_bc, mask, beta):
    cur_q = (q * mask).sum(dim=1) * beta
    other = torch.zeros_like(cur_q)
    for i in range(q.shape[0]):
        chosen = q_bc[i][acc_bc[i] < acc[i]] if acc[i] > 0 else q_bc[i][acc_bc[i] > acc[i]]
        other[i] = chosen.mean() * beta if len(chosen) > 0 else 0
    return (-torch.log(torch.sigmoid((cur_q - other) * ((acc > 0).float() * 2 - 1)))).mean()


def verl_dpo_accuracy(scores, acc, mask, n):
    out = []
    for start in range(0, scores.shape[0], n):
        cur = (scores[start : start + n] * mask[start : start + n]).sum(dim=1)

        def upper(x):
            diff = x.unsqueeze(1) - x.unsqueeze(0)
            return diff[torch.triu(torch.ones_like(diff).bool(), diagonal=1)]

        acc_diff, score_diff = upper(acc[start : start + n]), upper(cur)
        if acc_diff.abs().sum() == 0:
            out.append(0.5)
        else:
            agree = ((score_diff > 0) == (acc_diff > 0)).float() * acc_diff.abs()
            out.append(float(agree.sum() / acc_diff.abs().sum()))
    return sum(out) / len(out)


def random_batch(groups: int, n: int, width: int, seed: int):
    """Right-padded responses of random lengths 1..width, 0/1 outcomes, random log-ratios."""
    g = torch.Generator().manual_seed(seed)
    b = groups * n
    lengths = torch.randint(1, width + 1, (b,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).double()
    q = torch.randn(b, width, generator=g, dtype=torch.float64)
    acc = torch.randint(0, 2, (b,), generator=g).double()
    ids = [k // n for k in range(b)]
    return q, mask, acc, ids, lengths.tolist()


# --------------------------------------------------------------------------- by hand


def test_implicit_rewards_by_hand():
    q = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 4.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    raw = implicit_process_rewards(q, mask, beta=0.5, norm="none")
    # β q on valid tokens but each row's last valid one (it carries the outcome only)
    assert_close(raw, torch.tensor([[0.5, 1.0, 0.0], [-0.5, 0.0, 0.0]]))
    # batch_norm: rewards to go are [1.5, 1, 0] and [-0.5, 0, 0]: divide by 1.5 (+1e-6)
    normed = implicit_process_rewards(q, mask, beta=0.5)
    assert_close(normed, raw / (1.5 + 1e-6))
    empty = implicit_process_rewards(q, torch.zeros(2, 3), beta=0.5)
    assert torch.equal(empty, torch.zeros(2, 3))  # no valid token: nothing, and no NaN


def test_ce_and_dpo_losses_by_hand():
    q = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 4.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # Q = [6, 3], β Q = [3, 1.5]; labels 1, 0: -log σ(3), -log(1 - σ(1.5))
    ce = prime_ce_loss(q, mask, torch.tensor([1.0, 0.0]), beta=0.5)
    assert_close(ce, torch.tensor([math.log1p(math.exp(-3)), math.log1p(math.exp(1.5))]))
    # one group: sample 0 (label 1) against sample 1's Q = 3, sample 1 (label 0) against 6
    opp = dpo_opponents(torch.tensor([6.0, 3.0]), torch.tensor([1.0, 0.0]), ["g", "g"])
    assert_close(opp, torch.tensor([3.0, 6.0]))
    dpo = prime_dpo_loss(q, mask, torch.tensor([1.0, 0.0]), opp, beta=0.5)
    # +(0.5 (6 - 3)) and -(0.5 (3 - 6)): both -log σ(1.5)
    assert_close(dpo, torch.full((2,), math.log1p(math.exp(-1.5))))
    # no opponent in the group (equal labels, or a group of one): compared with 0
    assert torch.equal(
        dpo_opponents(torch.tensor([6.0, 3.0, 2.0]), torch.tensor([1.0, 1.0, 0.0]), [0, 0, 1]),
        torch.zeros(3),
    )


def test_prime_advantages_by_hand():
    """Group "a" of two samples, group "b" of one; c_gt = 2, c_dpo = 1."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    outcome = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    implicit = torch.tensor([[0.2, 0.0, 0.0], [0.4, -0.2, 0.0], [0.0, 0.0, 0.0]])
    adv, returns = estimate(
        "prime",
        outcome,
        mask,
        group_ids=["a", "a", "b"],
        implicit_rewards=implicit,
        reward_gt_coef=2.0,
        reward_dpo_coef=1.0,
    )
    # outcome RLOO: 1 - 0 = 1 (row 0, last token), 0 - 1 = -1 (row 1), singleton keeps 1
    # implicit RLOO: means 0.1 and 0.2/3, baseline (0.1 + 0.2/3) / 1, tokens scaled by 2/1
    b = 0.1 + 0.2 / 3
    total = torch.tensor(
        [
            [0.4 - b, -b + 2 * 1.0, 0.0],
            [0.8 - b, -0.4 - b, -b + 2 * -1.0],
            [2 * 1.0, 0.0, 0.0],
        ],
        dtype=torch.float64,
    )
    want_returns = total.flip(-1).cumsum(-1).flip(-1) * mask
    assert_close(returns, want_returns.float())
    valid = want_returns[mask.bool()]
    whitened = (want_returns - valid.mean()) / (valid.var() + 1e-8).sqrt() * mask
    assert_close(adv, whitened.float())
    # a coefficient of 0 drops its source: outcome only is RLOO of the scores to go
    _, ret0 = estimate(
        "prime",
        outcome,
        mask,
        group_ids=["a", "a", "b"],
        implicit_rewards=implicit,
        reward_dpo_coef=0.0,
    )
    assert_close(ret0, 5.0 * torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0], [1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="needs implicit_rewards"):
        estimate("prime", outcome, mask, group_ids=[0, 0, 1])


def test_prime_is_registered_and_needs_the_prm():
    assert ADV_ESTIMATORS.get("prime") is prime_advantages
    assert ADV_ESTIMATORS.needs("prime") == ("implicit_rewards",)
    assert ADV_ESTIMATORS.info("prime")["groups"] is True


def test_empty_rows_and_equal_groups_give_zeros_not_nans():
    mask = torch.tensor([[1, 1], [0, 0], [1, 0], [1, 0]])
    outcome = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    implicit = torch.tensor([[0.3, 0.0], [5.0, 5.0], [0.0, 0.0], [0.0, 0.0]])
    adv, returns = estimate(
        "prime", outcome, mask, group_ids=[0, 0, 1, 1], implicit_rewards=implicit
    )
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()
    assert torch.equal(adv[1], torch.zeros(2)) and torch.equal(returns[1], torch.zeros(2))
    # group 1: equal outcomes, no implicit reward: nothing to learn
    assert torch.equal(returns[2:], torch.zeros(2, 2))


def test_accuracies_by_hand():
    scores = torch.tensor([2.0, -1.0, 0.5, 0.3])
    labels = torch.tensor([1.0, 0.0, 1.0, 1.0])
    # group 0: the one pair ordered right -> 1; group 1: equal labels -> 0.5
    assert pairwise_accuracy(scores, labels, [0, 0, 1, 1]) == pytest.approx(0.75)
    # sign(s) vs sign(2y - 1): +,-,+,+ against +,-,+,+
    assert sign_accuracy(scores, labels) == 1.0
    assert sign_accuracy(-scores, labels) == 0.0


# --------------------------------------------------------------------------- against verl


@pytest.mark.parametrize("norm", [True, False])
def test_implicit_rewards_match_verl(norm):
    q, mask, _, _, lengths = random_batch(3, 4, 7, seed=1)
    ours = implicit_process_rewards(q, mask, 0.05, "batch_norm" if norm else "none")
    assert_close(ours.double(), verl_token_scores(q, lengths, 0.05, norm), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("gt", "dpo"), [(5.0, 5.0), (1.0, 0.3), (0.0, 2.0), (2.0, 0.0)])
def test_prime_advantages_match_verl(gt, dpo):
    q, mask, acc, ids, lengths = random_batch(4, 4, 6, seed=2)
    rm_scores = verl_token_scores(q, lengths, 0.05, True)
    outcome = torch.zeros_like(mask)
    outcome[torch.arange(len(acc)), torch.tensor(lengths) - 1] = acc
    adv, returns = estimate(
        "prime",
        outcome,
        mask,
        group_ids=ids,
        implicit_rewards=rm_scores,
        reward_gt_coef=gt,
        reward_dpo_coef=dpo,
    )
    want_adv, want_returns = verl_rloo_advantage(acc, rm_scores, mask, 4, gt, dpo)
    assert_close(returns.double(), want_returns, rtol=1e-6, atol=1e-6)
    valid = mask.bool()  # verl leaves whitened values on padding; treadle 0 there
    assert_close(adv.double()[valid], want_adv[valid], rtol=1e-5, atol=1e-6)
    assert torch.equal(adv[~valid], torch.zeros_like(adv[~valid]))


def test_ce_loss_and_gradient_match_verl():
    q, mask, acc, _, _ = random_batch(3, 4, 5, seed=3)
    q = (q * 5).requires_grad_()  # β Q spans both sides, away from saturation
    ours = prime_ce_loss(q, mask, acc, beta=0.05).mean()
    theirs = verl_ce_loss(q, acc, mask, 0.05)
    assert_close(ours, theirs, rtol=1e-6, atol=1e-8)
    (g1,) = torch.autograd.grad(ours, q)
    (g2,) = torch.autograd.grad(theirs, q)
    assert_close(g1, g2, rtol=1e-6, atol=1e-10)
    assert torch.equal(g1[mask == 0], torch.zeros_like(g1[mask == 0]))


def test_dpo_loss_and_gradient_match_verl():
    n = 4
    q, mask, acc, ids, _ = random_batch(3, n, 5, seed=4)
    acc[4:8] = 1.0  # a group of equal labels: no opponents
    q = (q * 5).requires_grad_()
    seq = (q.detach() * mask).sum(-1)
    # verl's "reverse" update broadcasts each group's Q and labels to its members
    q_bc = seq.view(-1, n).unsqueeze(1).expand(-1, n, -1).reshape(-1, n)
    acc_bc = acc.view(-1, n).unsqueeze(1).expand(-1, n, -1).reshape(-1, n)
    theirs = verl_dpo_loss(q, acc, q_bc, acc_bc, mask, 0.05)
    ours = prime_dpo_loss(q, mask, acc, dpo_opponents(seq, acc, ids), beta=0.05).mean()
    assert_close(ours, theirs, rtol=1e-6, atol=1e-8)
    (g1,) = torch.autograd.grad(ours, q)
    (g2,) = torch.autograd.grad(theirs, q)
    assert_close(g1, g2, rtol=1e-6, atol=1e-10)


def test_accuracies_match_verl():
    n = 4
    scores, mask, acc, ids, _ = random_batch(5, n, 4, seed=5)
    acc[0:4] = 0.0  # an all-equal group counts 0.5
    seq = (scores * mask).sum(-1)
    assert pairwise_accuracy(seq, acc, ids) == pytest.approx(
        verl_dpo_accuracy(scores, acc, mask, n)
    )
    abs_acc = (torch.sign(seq) == torch.sign(acc * 2 - 1)).float().mean()
    assert sign_accuracy(seq, acc) == pytest.approx(float(abs_acc))
