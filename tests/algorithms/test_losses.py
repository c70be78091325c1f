"""Loss aggregation, policy losses, value loss and entropy against hand values and loop references.

Gradients are checked where the loss has a subtle one: PPO clipping (zero gradient on clipped
tokens), dual clip, GSPO's sequence-level ratio, CISPO (gradient kept on clipped tokens),
Clip-Cov (dropped tokens) and KL-Cov (penalised tokens).
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from algorithm_calls import policy_loss
from torch.testing import assert_close

from treadle.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Aggregation,
    PolicyLossInputs,
    agg_loss,
    entropy_from_logits,
)
from treadle.algorithms import value_loss as value_loss_fn
from treadle.check import check_algorithm
from treadle.config import AlgorithmConfig, load_config
from treadle.runtime.errors import ConfigError
from treadle.workers.objectives import loss_options

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
N_TOKENS = 9
# ratios π/π_old per token, chosen to land in every PPO case (see test_ppo_gradients)
RATIO = torch.tensor(
    [[1.5, 0.5, 0.5, 1.0], [1.5, 5.0, 1.0, 1.0], [1.25, 0.9, 1.1, 1.05]], dtype=torch.float64
)
ADV = torch.tensor(
    [[1.0, 1.0, -1.0, 0.0], [-1.0, -2.0, 0.0, 0.0], [1.0, 0.5, -0.5, 2.0]], dtype=torch.float64
)
OLD = torch.tensor(
    [[-1.0, -2.0, -0.5, 0.0], [-1.5, -3.0, 0.0, 0.0], [-0.7, -1.2, -2.0, -0.3]],
    dtype=torch.float64,
)


def new_log_probs(ratio: torch.Tensor = RATIO) -> torch.Tensor:
    """log π = log π_old + log r, with ``-inf`` junk where the mask is 0, requiring grad."""
    logp = (OLD + ratio.log()).masked_fill(MASK == 0, float("-inf"))
    return logp.requires_grad_()


def call(name: str, logp: torch.Tensor, adv: torch.Tensor = ADV, mask=MASK, **kw):
    return policy_loss(name, logp, OLD, adv, mask, **kw)


def grad_of(loss: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


def valid(mask=MASK):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]


# --------------------------------------------------------------------------- aggregation


def ref_agg(loss, mask, mode, norm_constant=None):
    rows = [[loss[i][t] for t in range(len(mask[0])) if mask[i][t]] for i in range(len(mask))]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "token-sum":
        return sum(sum(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) / (norm_constant or len(mask[0])) for r in rows) / len(rows)


LOSS_MAT = torch.tensor(
    [[1.0, 2.0, 3.0, 99.0], [4.0, 5.0, 99.0, 99.0], [6.0, 7.0, 8.0, 9.0], [0.5, 0.5, 0.5, 0.5]]
)
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])


def test_agg_modes_by_hand():
    # 3 non-empty rows; the 4th row is empty and is not counted as a sequence
    assert agg_loss(LOSS_MAT, AGG_MASK, "token-mean").item() == pytest.approx(45 / 9)
    assert agg_loss(LOSS_MAT, AGG_MASK, "seq-mean-token-sum").item() == pytest.approx(45 / 3)
    assert agg_loss(LOSS_MAT, AGG_MASK, "seq-mean-token-mean").item() == pytest.approx(
        (2 + 4.5 + 7.5) / 3
    )
    assert agg_loss(LOSS_MAT, AGG_MASK, "seq-mean-token-sum-norm").item() == pytest.approx(
        (6 / 4 + 9 / 4 + 30 / 4) / 3
    )
    assert agg_loss(
        LOSS_MAT, AGG_MASK, "seq-mean-token-sum-norm", norm_constant=10
    ).item() == pytest.approx(45 / 10 / 3)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names())
def test_agg_matches_loop_reference(mode):
    torch.manual_seed(0)
    loss, mask = torch.randn(6, 5), (torch.rand(6, 5) < 0.6).long()
    mask[0, 0] = 1
    expected = ref_agg(loss.tolist(), mask.tolist(), mode)
    assert agg_loss(loss, mask, mode).item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names())
def test_micro_batch_losses_sum_to_the_mini_batch_loss(mode):
    torch.manual_seed(1)
    loss, mask = torch.randn(7, 6), (torch.rand(7, 6) < 0.6).float()
    mask[2] = 0  # an empty response inside a micro-batch
    totals = {"num_tokens": mask.sum(), "num_seqs": (mask.sum(-1) > 0).sum()}
    whole = agg_loss(loss, mask, mode)
    parts = [slice(0, 1), slice(1, 5), slice(5, 7)]  # three uneven micro-batches
    summed = sum(agg_loss(loss[s], mask[s], mode, **totals) for s in parts)
    assert_close(summed, whole)
    local = sum(agg_loss(loss[s], mask[s], mode) for s in parts)
    if mode != "token-sum":  # a plain sum needs no counts
        assert not torch.allclose(local, whole)  # local counts would not add up


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names())
def test_agg_of_empty_mask_is_zero(mode):
    out = agg_loss(LOSS_MAT, torch.zeros_like(AGG_MASK), mode)
    assert out.item() == 0.0


def test_unknown_agg_mode():
    with pytest.raises(
        ValueError, match=r"unknown loss aggregation mode 'token_mean'.*'token-mean'"
    ):
        agg_loss(LOSS_MAT, AGG_MASK, "token_mean")


# --------------------------------------------------------------------------- PPO


def ref_ppo_token(r, a, low, high, c=None):
    loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


def ref_ppo(low, high, c=None, weights=None):
    total = 0.0
    for i, t in valid():
        w = 1.0 if weights is None else weights[i, t].item()
        total += w * ref_ppo_token(RATIO[i, t].item(), ADV[i, t].item(), low, high, c)
    return total / N_TOKENS


@pytest.mark.parametrize("c", [None, 3.0])
def test_ppo_matches_loop_reference(c):
    loss, metrics = call(
        "ppo", new_log_probs(), clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=c
    )
    assert loss.item() == pytest.approx(ref_ppo(0.2, 0.28, c))
    # clipped: (0,0) A>0 r=1.5 > 1.28 and (0,2) A<0 r=.5 < .8; (2,0) r=1.25 is inside clip-higher
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 9)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.0 if c is None else 1 / 9)
    ppo_kl = sum(-math.log(RATIO[i, t].item()) for i, t in valid()) / N_TOKENS
    assert metrics["ppo_kl"] == pytest.approx(ppo_kl)


def test_ppo_gradients():
    logp = new_log_probs()
    loss, _ = call("ppo", logp, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # d(-A r)/d log π = -A r on unclipped tokens, 0 on clipped ones and where the mask is 0
    expected = -ADV * RATIO / N_TOKENS * MASK
    expected[0, 0] = 0.0  # A > 0, r = 1.5 above 1 + ε_high: no push further up
    expected[0, 2] = 0.0  # A < 0, r = 0.5 below 1 - ε_low: no push further down
    grad = grad_of(loss, logp)
    assert_close(grad, expected)
    assert grad[1, 1].item() == pytest.approx(2 * 5 / 9)  # A < 0 with a huge ratio: unbounded


def test_ppo_dual_clip_bounds_negative_advantage_tokens():
    logp = new_log_probs()
    loss, _ = call("ppo", logp, clip_ratio_c=3.0)
    grad = grad_of(loss, logp)
    assert grad[1, 1].item() == 0.0  # -A r = 10 > -A c = 6: loss is the constant 6
    assert grad[1, 0].item() == pytest.approx(1.5 / 9)  # r = 1.5 < c: untouched
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        call("ppo", new_log_probs(), clip_ratio_c=0.9)


def test_rollout_is_weights_multiply_token_losses():
    weights = torch.tensor([[0.5, 1.0, 2.0, 7.0], [1.0, 0.1, 7.0, 7.0], [1.0, 1.0, 1.0, 0.0]])
    logp = new_log_probs()
    loss, _ = call("ppo", logp, rollout_is_weights=weights.double())
    assert loss.item() == pytest.approx(ref_ppo(0.2, 0.2, weights=weights))
    plain_logp = new_log_probs()
    plain_grad = grad_of(call("ppo", plain_logp)[0], plain_logp)
    assert_close(grad_of(loss, logp), plain_grad * weights.double())


def test_policy_loss_micro_batches_sum_to_mini_batch_loss():
    agg = {"num_tokens": MASK.sum()}
    whole, _ = call("ppo", new_log_probs())
    parts = 0.0
    for rows in [slice(0, 1), slice(1, 3)]:
        loss, _ = policy_loss(
            "ppo", new_log_probs()[rows], OLD[rows], ADV[rows], MASK[rows], agg_kwargs=agg
        )
        parts = parts + loss
    assert_close(parts, whole)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_every_policy_loss_is_finite_with_junk_padding(name):
    logp = new_log_probs()  # -inf where the mask is 0
    knobs = {"dro_beta": 0.1} if name == "dro" else {}
    loss, metrics = call(name, logp, **knobs)
    grad = grad_of(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(grad * (1 - MASK), torch.zeros_like(grad))
    assert {"pg_clipfrac", "ppo_kl"} <= metrics.keys()
    assert all(isinstance(v, float) for v in metrics.values())


def test_policy_loss_unknown_name():
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2'; valid: bypass_mode, cispo,"):
        POLICY_LOSSES.get("ppo2")


# --------------------------------------------------------------------------- GSPO

GSPO_LOG_RATIO = torch.tensor(
    [[0.5, 0.3, 0.4, 0.0], [0.1, -0.02, 0.0, 0.0], [0.05, -0.1, 0.2, -0.03]], dtype=torch.float64
)
GSPO_ADV = torch.tensor(
    [[1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, 0.0, 0.0], [0.5, 0.5, 1.5, 1.5]], dtype=torch.float64
)


def test_gspo_sequence_ratio_value_and_gradient():
    logp = new_log_probs(GSPO_LOG_RATIO.exp())
    loss, metrics = call("gspo", logp, GSPO_ADV, clip_ratio_low=0.2, clip_ratio_high=0.2)
    lengths = MASK.sum(-1).double()
    s = torch.exp((GSPO_LOG_RATIO * MASK).sum(-1) / lengths)  # [e^.4, e^.04, e^.03]
    assert s[0] > 1.2 and 0.8 < s[1] < 1.2 and 0.8 < s[2] < 1.2
    # loss: mean over sequences of the mean over tokens of max(-A s, -A clip(s))
    per_token = torch.maximum(-GSPO_ADV * s[:, None], -GSPO_ADV * s.clamp(0.8, 1.2)[:, None])
    expected_loss = ((per_token * MASK).sum(-1) / lengths).mean()
    assert loss.item() == pytest.approx(expected_loss.item())
    # gradient: -A_{i,t} s_i / (|y_i| G) on unclipped sequences, 0 on the clipped one
    expected_grad = -GSPO_ADV * s[:, None] / (lengths[:, None] * 3) * MASK
    expected_grad[0] = 0.0
    assert_close(grad_of(loss, logp), expected_grad)
    assert metrics["pg_clipfrac"] == pytest.approx(3 / 9)


def test_gspo_token_form_equals_sequence_form_gradient():
    # with a constant advantage per sequence, the token form's gradient is that of
    # -(1/G) Σ_i A_i s_i with s_i = exp(mean_t(log π - log π_old)) differentiated through
    adv = torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64)[:, None] * MASK
    log_ratio = GSPO_LOG_RATIO * 0.1
    logp = new_log_probs(log_ratio.exp())
    loss, _ = call("gspo", logp, adv, clip_ratio_low=0.5, clip_ratio_high=0.5)
    logp2 = new_log_probs(log_ratio.exp())
    diff = torch.where(MASK.bool(), logp2 - OLD, 0.0)
    s = torch.exp(diff.sum(-1) / MASK.sum(-1))
    direct = (-adv[:, 0] * s).mean()
    assert loss.item() == pytest.approx(direct.item())
    assert_close(grad_of(loss, logp), grad_of(direct, logp2))


def test_gspo_defaults_are_the_papers_tiny_clip_range():
    logp = new_log_probs(GSPO_LOG_RATIO.exp())
    _, metrics = call("gspo", logp, GSPO_ADV)
    # every sequence ratio is outside [1 - 3e-4, 1 + 4e-4]; seq 1 (A<0, s>1) is not clipped
    assert metrics["pg_clipfrac"] == pytest.approx((3 + 4) / 9)


# --------------------------------------------------------------------------- CISPO, GPG


def test_cispo_keeps_gradient_on_clipped_tokens():
    logp = new_log_probs()
    loss, metrics = call("cispo", logp, clip_ratio_high=0.2)
    weight = RATIO.clamp(max=1.2)  # default: no lower bound
    detached = logp.detach().masked_fill(MASK == 0, 0.0)
    expected = (-ADV * weight * detached * MASK).sum() / N_TOKENS
    assert loss.item() == pytest.approx(expected.item())
    grad = grad_of(loss, logp)
    assert_close(grad, -ADV * weight / N_TOKENS * MASK)
    assert grad[0, 0].item() == pytest.approx(-1.2 / 9)  # PPO would give 0 here
    # ratios above 1.2 among valid tokens: 1.5, 1.5, 5.0, 1.25
    assert metrics["pg_clipfrac"] == pytest.approx(4 / 9)


def test_cispo_lower_bound():
    _, metrics = call("cispo", new_log_probs(), clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert metrics["pg_clipfrac"] == pytest.approx(6 / 9)  # + the two r = 0.5


def test_gpg_loss_is_plain_policy_gradient():
    logp = new_log_probs()
    loss, metrics = call("gpg", logp)
    detached = logp.detach().masked_fill(MASK == 0, 0.0)
    assert loss.item() == pytest.approx(((-ADV * detached * MASK).sum() / N_TOKENS).item())
    assert_close(grad_of(loss, logp), -ADV / N_TOKENS * MASK)
    assert metrics["pg_clipfrac"] == 0.0


# --------------------------------------------------------------------------- Clip-Cov, KL-Cov


def ref_cov(logp):
    """Loop covariance (A - mean A)(log π - mean log π) over the valid tokens."""
    cells = valid()
    mean_a = sum(ADV[i, t].item() for i, t in cells) / len(cells)
    mean_l = sum(logp[i, t].item() for i, t in cells) / len(cells)
    return {(i, t): (ADV[i, t].item() - mean_a) * (logp[i, t].item() - mean_l) for i, t in cells}


def test_clip_cov_drops_candidate_tokens():
    logp = new_log_probs()
    cov = ref_cov(logp.detach())
    ppo_clipped = {(0, 0), (0, 2), (2, 0)}  # ε = 0.2: r = 1.25 with A > 0 is clipped too
    lb, ub = 0.05, 1.0
    candidates = {k for k, v in cov.items() if lb < v < ub and k not in ppo_clipped}
    assert 0 < len(candidates) < 7  # the test data must exercise both sides
    loss, metrics = call("clip_cov", logp, clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub)
    expected_grad = -ADV * RATIO / N_TOKENS * MASK
    for k in ppo_clipped | candidates:
        expected_grad[k] = 0.0
    assert_close(grad_of(loss, logp), expected_grad)
    expected_loss = sum(
        ref_ppo_token(RATIO[k].item(), ADV[k].item(), 0.2, 0.2)
        for k in valid()
        if k not in candidates
    )
    assert loss.item() == pytest.approx(expected_loss / N_TOKENS)
    assert metrics["pg_cov_frac"] == pytest.approx(len(candidates) / 9)


def test_clip_cov_random_choice_is_reproducible():
    kw = {"clip_cov_ratio": 1e-4, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0}
    runs = []
    for _ in range(2):
        logp = new_log_probs()
        loss, metrics = call("clip_cov", logp, generator=torch.Generator().manual_seed(5), **kw)
        assert metrics["pg_cov_frac"] == pytest.approx(1 / 9)  # max(1, ⌊1e-4 · 9⌋) = 1
        runs.append(grad_of(loss, logp))
    assert torch.equal(runs[0], runs[1])


def test_kl_cov_penalises_top_covariance_tokens():
    logp = new_log_probs()
    cov = ref_cov(logp.detach())
    top = sorted(cov, key=cov.get, reverse=True)[:2]  # max(1, ⌊0.25 · 9⌋) = 2
    loss, metrics = call("kl_cov", logp, kl_cov_ratio=0.25, kl_cov_coef=0.5)
    expected_loss = 0.0
    expected_grad = -ADV * RATIO / N_TOKENS * MASK
    for k in valid():
        log_r = math.log(RATIO[k].item())
        expected_loss += -ADV[k].item() * RATIO[k].item() + (0.5 * abs(log_r) if k in top else 0)
        if k in top:
            expected_grad[k] += 0.5 * math.copysign(1.0, log_r) / N_TOKENS
    assert loss.item() == pytest.approx(expected_loss / N_TOKENS)
    assert_close(grad_of(loss, logp), expected_grad)
    assert metrics["pg_cov_frac"] == pytest.approx(2 / 9)


# --------------------------------------------------------------------------- SAPO, GMPO, DPPO, DRO


def per_row(mask=MASK):
    return {i: [t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])}


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_soft_gate_value_and_gradient():
    logp = new_log_probs()
    loss, _ = call("sapo", logp, loss_agg_mode="seq-mean-token-mean")
    want, grad = 0.0, torch.zeros_like(RATIO)
    rows = per_row()
    for i, ts in rows.items():
        for t in ts:
            r, a = RATIO[i, t].item(), ADV[i, t].item()
            tau = 1.0 if a > 0 else 1.05
            s = sigmoid(tau * (r - 1))
            want += -a * s * 4 / tau / len(ts) / len(rows)
            grad[i, t] = -a * 4 * s * (1 - s) * r / len(ts) / len(rows)  # d/dlog π = r d/dr
    assert loss.item() == pytest.approx(want)
    assert_close(grad_of(loss, logp), grad)
    # On-policy the gate has slope 1: SAPO's gradient is the policy gradient -A ∇log π.
    on = OLD.clone().masked_fill(MASK == 0, float("-inf")).requires_grad_()
    loss, _ = call("sapo", on, loss_agg_mode="token-mean", sapo_tau_pos=3.0, sapo_tau_neg=7.0)
    assert_close(grad_of(loss, on), -ADV * MASK / N_TOKENS)


def test_geo_mean_is_a_clipped_geometric_mean_per_sequence():
    logp = new_log_probs()
    adv = torch.tensor([[1.0] * 4, [-2.0] * 4, [0.5] * 4], dtype=torch.float64)
    loss, metrics = call("geo_mean", logp, adv, clip_ratio_low=0.3, clip_ratio_high=0.2)
    want, grad = 0.0, torch.zeros_like(RATIO)
    for i, ts in per_row().items():
        a = adv[i, 0].item()
        logs = [math.log(RATIO[i, t].item()) for t in ts]
        # pessimistic clip in log space: A > 0 caps log r at 0.2, A < 0 floors it at -0.3
        clipped = [min(x, 0.2) if a > 0 else max(x, -0.3) for x in logs]
        ratio = math.exp(sum(clipped) / len(ts))
        want += -a * ratio / 3
        for t, x, c in zip(ts, logs, clipped, strict=True):
            grad[i, t] = -a * ratio / len(ts) / 3 if x == c else 0.0
    assert loss.item() == pytest.approx(want)
    assert_close(grad_of(loss, logp), grad)
    # as verl: log r outside [-0.3, 0.2] on tokens with A > 0, on either side (log 1.5,
    # log 0.5 twice, log 1.25), though only the upper side changes the loss for A > 0
    assert metrics["pg_clipfrac"] == pytest.approx(4 / 9)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(2 / 9)  # log 1.5, log 5 with A < 0


def dppo_expected(keep, cap=20.0):
    grad = torch.zeros_like(RATIO)
    loss = 0.0
    for i, t in valid():
        if (i, t) in keep:
            r, a = RATIO[i, t].item(), ADV[i, t].item()
            logp = OLD[i, t].item() + math.log(r)
            loss += -a * min(r, cap) * logp / N_TOKENS
            grad[i, t] = -a * min(r, cap) / N_TOKENS
    return loss, grad


def test_dppo_tv_drops_tokens_whose_probability_moved_too_far_the_advantages_way():
    logp = new_log_probs()
    loss, metrics = call("dppo_tv", logp, dppo_divergence_low=0.05, dppo_divergence_high=0.1)
    keep = set()
    for i, t in valid():
        p_old = math.exp(OLD[i, t].item())
        moved = p_old * RATIO[i, t].item() - p_old
        ok = moved <= 0.1 if ADV[i, t] > 0 else moved >= -0.05
        if ok:
            keep.add((i, t))
    assert 0 < len(keep) < 9  # both sides exercised
    want, grad = dppo_expected(keep)
    assert loss.item() == pytest.approx(want)
    assert_close(grad_of(loss, logp), grad)
    assert metrics["pg_clipfrac"] == pytest.approx(1 - len(keep) / 9)


def test_dppo_kl_uses_the_binary_kl_and_truncates_the_weight():
    logp = new_log_probs()
    loss, metrics = call("dppo_kl", logp, dppo_divergence_low=0.02, dppo_is_cap=2.0)
    keep = set()
    for i, t in valid():
        q = math.exp(OLD[i, t].item())
        p = q * RATIO[i, t].item()
        kl = q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
        toward_old = p <= q if ADV[i, t] > 0 else p >= q
        if kl <= (0.2 if ADV[i, t] > 0 else 0.02) or toward_old:
            keep.add((i, t))
    assert 0 < len(keep) < 9
    want, grad = dppo_expected(keep, cap=2.0)
    assert loss.item() == pytest.approx(want)
    assert_close(grad_of(loss, logp), grad)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(
        sum(RATIO[k].item() > 2.0 for k in keep) / 9
    )


def test_dro_penalises_the_squared_log_ratio():
    logp = new_log_probs()
    loss, _ = call("dro", logp, dro_beta=0.5)
    want = 0.0
    grad = torch.zeros_like(RATIO)
    for i, t in valid():
        x, a = math.log(RATIO[i, t].item()), ADV[i, t].item()
        want += -(a * (OLD[i, t].item() + x) - 0.25 * x * x) / N_TOKENS
        grad[i, t] = -(a - 0.5 * x) / N_TOKENS
    assert loss.item() == pytest.approx(want)
    assert_close(grad_of(loss, logp), grad)
    with pytest.raises(ValueError, match=r"algorithm.dro_beta must be > 0"):
        call("dro", new_log_probs())


@pytest.mark.parametrize("level", ["token", "sequence", "none"])
def test_bypass_reinforce_weights_by_the_truncated_rollout_ratio(level):
    logp = new_log_probs()  # OLD stands for the rollout's log-probs here
    loss, _ = call(
        "bypass_mode", logp, bypass_loss_type="reinforce", bypass_is=level, bypass_is_cap=1.2
    )
    grad = torch.zeros_like(RATIO)
    for i, ts in per_row().items():
        seq = math.prod(RATIO[i, t].item() for t in ts)
        for t in ts:
            w = {"token": min(RATIO[i, t].item(), 1.2), "sequence": min(seq, 1.2), "none": 1}
            grad[i, t] = -ADV[i, t].item() * w[level] / N_TOKENS
    assert_close(grad_of(loss, logp), grad)


def test_bypass_ppo_clip_is_ppo_against_the_rollout():
    logp = new_log_probs()
    loss, _ = call("bypass_mode", logp, clip_ratio_c=None)
    assert loss.item() == pytest.approx(ref_ppo(0.2, 0.2))
    with pytest.raises(ValueError, match=r"bypass_loss_type='ppo'"):
        call("bypass_mode", new_log_probs(), bypass_loss_type="ppo")


def test_vanilla_is_ppo():
    assert POLICY_LOSSES.get("vanilla") is POLICY_LOSSES.get("ppo")
    assert POLICY_LOSSES.info("geo_mean")["agg_modes"] == ("seq-mean-token-mean",)
    assert POLICY_LOSSES.info("bypass_mode")["old"] == "rollout_log_probs"


# --------------------------------------------------------------------------- knobs


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_a_loss_registers_every_knob_it_reads(name):
    # the actor builds a loss's settings from its registered knobs: one it reads but does not
    # register would silently keep its default
    read = {f.name for f in dataclasses.fields(POLICY_LOSSES.settings(name))}
    assert set(POLICY_LOSSES.knobs(name)) == read
    assert read <= set(AlgorithmConfig.model_fields)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_a_name_a_loss_does_not_take_is_an_error(name):
    with pytest.raises(TypeError, match="some_future_option"):
        call(name, new_log_probs(), some_future_option=1)
    with pytest.raises(TypeError, match="some_future_input"):
        PolicyLossInputs(new_log_probs(), OLD, ADV, MASK, some_future_input=1)  # type: ignore[call-arg]


def test_the_actor_passes_exactly_the_registered_knobs():
    def options(*overrides: str) -> dict:
        return dataclasses.asdict(loss_options(load_config(None, list(overrides))))

    assert options("algorithm.clip_ratio_high=0.28") == {
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0,
    }
    assert options("algorithm.policy_loss=vanilla") == options()  # an alias: its target's
    assert options("algorithm.policy_loss=sapo", "algorithm.sapo_tau_pos=2") == {
        "sapo_tau_pos": 2.0,
        "sapo_tau_neg": 1.05,
    }
    assert options("algorithm.policy_loss=gpg", "algorithm.dro_beta=0.1") == {}


PPO_READS = "(it reads clip_ratio_c, clip_ratio_high, clip_ratio_low)"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.sapo_tau_pos=2"],
            f"algorithm.sapo_tau_pos=2.0 is not read by algorithm.policy_loss=ppo {PPO_READS}: "
            "remove algorithm.sapo_tau_pos",
        ),
        (  # an alias says the name the config gave and reads what its target reads
            ["algorithm.policy_loss=vanilla", "algorithm.kl_cov_ratio=0.01"],
            f"algorithm.kl_cov_ratio=0.01 is not read by algorithm.policy_loss=vanilla {PPO_READS}",
        ),
        (  # clip_ratio_* are shared, but not by every loss; null is a change from 3.0
            ["algorithm.policy_loss=cispo", "algorithm.clip_ratio_c=null"],
            "algorithm.clip_ratio_c=null is not read by algorithm.policy_loss=cispo (it reads "
            "clip_ratio_high, clip_ratio_low): remove algorithm.clip_ratio_c",
        ),
        (
            ["algorithm.policy_loss=dppo_tv", "algorithm.clip_ratio_low=0.1"],
            "algorithm.clip_ratio_low=0.1 is not read by algorithm.policy_loss=dppo_tv (it reads "
            "dppo_divergence_high, dppo_divergence_low, dppo_is_cap)",
        ),
        (
            ["algorithm.policy_loss=gpg", "algorithm.bypass_is=sequence"],
            "algorithm.bypass_is=sequence is not read by algorithm.policy_loss=gpg (it reads no "
            "algorithm knob)",
        ),
        (
            ["algorithm.loss_scale_factor=8"],
            "algorithm.loss_scale_factor=8.0 is not read by algorithm.loss_agg_mode=token-mean",
        ),
    ],
)
def test_a_knob_the_loss_does_not_read_is_an_error(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        check_algorithm(load_config(None, overrides), "train")
    assert len(str(e.value).splitlines()) == 1


def test_every_foreign_knob_is_listed():
    overrides = ["algorithm.policy_loss=sapo", "algorithm.dro_beta=0.1", "algorithm.clip_cov_lb=2"]
    with pytest.raises(ConfigError) as e:
        check_algorithm(load_config(None, overrides), "train")
    lines = str(e.value).splitlines()
    assert [line.split("=")[0] for line in lines] == ["algorithm.clip_cov_lb", "algorithm.dro_beta"]
    assert all("(it reads sapo_tau_neg, sapo_tau_pos)" in line for line in lines)


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.clip_ratio_high=0.28", "algorithm.clip_ratio_c=null"],
        ["algorithm.policy_loss=vanilla", "algorithm.clip_ratio_low=0.1"],
        ["algorithm.policy_loss=sapo", "algorithm.sapo_tau_pos=2", "algorithm.sapo_tau_neg=3"],
        ["algorithm.policy_loss=dro", "algorithm.dro_beta=0.1"],
        [
            "algorithm.policy_loss=clip_cov",
            "algorithm.clip_cov_lb=2",
            "algorithm.clip_ratio_low=0.1",
        ],
        [
            "algorithm.policy_loss=bypass_mode",
            "algorithm.bypass_loss_type=reinforce",
            "algorithm.bypass_is=sequence",
            "algorithm.clip_ratio_c=null",
        ],
        ["algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.loss_scale_factor=8"],
        ["algorithm.policy_loss=gpg", "algorithm.sapo_tau_pos=1.0"],  # the default: no change
    ],
)
def test_a_knob_the_loss_reads_passes(overrides):
    check_algorithm(load_config(None, overrides), "train")


def test_token_sum_is_the_plain_sum_times_the_ranks():
    assert agg_loss(LOSS_MAT, AGG_MASK, "token-sum").item() == pytest.approx(45.0)
    two_ranks = agg_loss(LOSS_MAT, AGG_MASK, "token-sum", dp_size=2)
    assert two_ranks.item() == pytest.approx(90.0)  # ranks' gradients are averaged


# --------------------------------------------------------------------------- value loss, entropy


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 2.0, 50.0]], requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, clipfrac = value_loss_fn(values, old, returns, mask, cliprange_value=0.2)
    # token 0: clipped prediction 0.7 -> max((1-2)², (0.7-2)²) = 1.69; token 1: 1
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert clipfrac == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(loss, values)
    assert_close(grad, torch.tensor([[0.0, 0.5 * 2 * (2.0 - 1.0) / 2, 0.0]]))


def test_value_clip_fraction_does_not_count_ties():
    """Inside the clip range the clipped prediction is the prediction itself: equal losses,
    not clipped. ``V_old + clip(V - V_old)`` differs from ``V`` by round-off there (0.3 +
    (0.05 - 0.22) = 0.05000000000000002) and used to count such ties as clipped."""
    values = torch.tensor([[0.05, 0.04, -0.05, 2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.22, -0.06, 0.1, 1.0]], dtype=torch.float64)
    returns = torch.tensor([[0.0, 0.0, 0.0, 3.0]], dtype=torch.float64)
    # the old formula moved the first three away from the returns: "clipped" by round-off
    old_way = old + (values.detach() - old).clamp(-0.25, 0.25)
    assert ((old_way - returns).abs() > (values.detach() - returns).abs())[0, :3].all()
    loss, clipfrac = value_loss_fn(values, old, returns, torch.ones(1, 4), cliprange_value=0.25)
    assert clipfrac == 0.25  # only the last token: 1.25 is further from 3 than 2 is
    # ½ mean of (0.05², 0.04², 0.05², (1.25 - 3)²); the clipped token has no gradient
    assert loss.item() == pytest.approx(0.5 * (0.0025 + 0.0016 + 0.0025 + 3.0625) / 4)
    grad = torch.tensor([[0.05, 0.04, -0.05, 0.0]], dtype=torch.float64) / 4
    assert_close(grad_of(loss, values), grad)


def test_value_loss_aggregation_mode():
    values = torch.tensor([[1.0, 1.0, 1.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, _ = value_loss_fn(
        values, values, torch.zeros(2, 3), mask, 0.2, Aggregation("seq-mean-token-mean")
    )
    assert loss.item() == pytest.approx(0.5 * (1.0 + 9.0) / 2)


def test_entropy_from_logits():
    torch.manual_seed(2)
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    probs = logits.softmax(-1)
    assert_close(entropy_from_logits(logits), -(probs * probs.log()).sum(-1))
    assert_close(entropy_from_logits(torch.zeros(2, 7)), torch.full((2,), math.log(7)))
    big = entropy_from_logits(torch.tensor([[1e4, 0.0, 0.0], [1e4, 1e4, -1e4]]))
    assert torch.isfinite(big).all()
    assert_close(big, torch.tensor([0.0, math.log(2)]))
