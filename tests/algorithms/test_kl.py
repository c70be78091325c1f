"""KL estimators against hand values and exact expectations; KL controllers and their resume."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from treadle.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
)
from treadle.algorithms.kl import kl_in_reward

LOG2 = math.log(2.0)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", LOG2),
        ("k2", 0.5 * LOG2**2),
        ("mse", 0.5 * LOG2**2),
        ("k3", 0.5 + LOG2 - 1.0),  # exp(-x) + x - 1 with x = log 2
        ("abs", LOG2),
    ],
)
def test_estimators_by_hand(kind, expected):
    # π = 0.5, π_ref = 0.25 at the sampled token: x = log π - log π_ref = log 2
    logp = torch.full((2, 3), math.log(0.5))
    ref = torch.full((2, 3), math.log(0.25))
    assert_close(kl_penalty(logp, ref, kind), torch.full((2, 3), expected))


def test_abs_is_symmetric_and_k1_is_signed():
    logp, ref = torch.tensor([[-1.0, -3.0]]), torch.tensor([[-3.0, -1.0]])
    assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[2.0, -2.0]]))
    assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([[2.0, 2.0]]))


def test_k1_and_k3_are_unbiased():
    # exact expectation under tokens sampled from π: Σ_y π(y) k(y) = KL(π || π_ref)
    p = torch.tensor([0.5, 0.2, 0.2, 0.05, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1], dtype=torch.float64)
    true_kl = (p * (p / q).log()).sum()
    for kind in ["k1", "k3"]:
        per_token = kl_penalty(p.log()[None], q.log()[None], kind)[0]
        assert_close((p * per_token).sum(), true_kl)
    assert (kl_penalty(p.log()[None], q.log()[None], "k3") >= 0).all()


def test_k3_is_clamped():
    logp, ref = torch.tensor([[-60.0, 0.0]]), torch.tensor([[0.0, -60.0]])
    out = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(out).all()
    assert out[0, 0].item() == 10.0  # exp(20) - 20 - 1 clamped
    assert_close(out[0, 1], torch.tensor(math.exp(-20.0) + 20.0 - 1.0).clamp(max=10.0))


def test_unknown_kind_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; valid: abs, abs\+, full,"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    assert KL_ESTIMATORS.names() == [
        "abs",
        "abs+",
        "full",
        "k1",
        "k1+",
        "k2",
        "k2+",
        "k3",
        "k3+",
        "kl",
        "kl+",
        "low_var_kl",
        "low_var_kl+",
        "mse",
        "mse+",
    ]


@pytest.mark.parametrize(
    ("kind", "value"),
    [("k1+", LOG2), ("kl+", LOG2), ("k3+", 0.5 + LOG2 - 1.0), ("abs+", LOG2), ("k2+", LOG2**2 / 2)],
)
def test_plus_forms_have_the_base_value_and_the_k2_gradient(kind, value):
    logp = torch.tensor([[0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-LOG2, -1.0]], dtype=torch.float64)  # x = log 2, then a tie (x = 0)
    kl = kl_penalty(logp, ref, kind)
    assert kl[0, 0].item() == pytest.approx(value) and kl[0, 1].item() == 0.0
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    assert_close(grad, torch.tensor([[LOG2, 0.0]], dtype=torch.float64))  # d(½x²)/dx = x


def test_verl_names_are_aliases():
    for alias, name in (("kl", "k1"), ("low_var_kl", "k3"), ("low_var_kl+", "k3+"), ("mse", "k2")):
        assert KL_ESTIMATORS.get(alias) is KL_ESTIMATORS.get(name)
    assert KL_ESTIMATORS.info("full") == {"full_vocab": True}


def test_full_kl_by_hand():
    """Two-token vocabulary: π = (3/4, 1/4), π_ref = (1/2, 1/2)."""
    logp = torch.tensor([[[math.log(0.75), math.log(0.25)]]], requires_grad=True)
    ref = torch.tensor([[[-LOG2, -LOG2]]])
    kl = kl_penalty(logp, ref, "full")
    want = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert kl.shape == (1, 1) and kl.item() == pytest.approx(want)
    # a token with probability 0 under π adds nothing, even where π_ref has none either
    zero = torch.tensor([[0.0, float("-inf")]])
    assert kl_penalty(zero, torch.tensor([[0.0, float("-inf")]]), "full").item() == 0.0
    # the reward's KL is shaped from sampled-token log-probs: [B,T] would be read as [B,V]
    square = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"KL estimator 'full' needs whole distributions"):
        kl_in_reward(square, square, square, torch.ones(2, 2), 0.1, "full")


def test_fixed_controller_never_moves_and_resumes():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


@pytest.mark.parametrize(
    ("current_kl", "error"),
    [(9.0, 0.2), (6.6, 0.1), (6.0, 0.0), (3.0, -0.2)],  # 9/6-1 = .5 and 3/6-1 = -.5 clip to ±.2
)
def test_adaptive_controller_update(current_kl, error):
    ctl = AdaptiveKLController(init_coef=0.1, target_kl=6.0, horizon=10000)
    ctl.update(current_kl, n_steps=256)
    assert ctl.value == pytest.approx(0.1 * (1 + error * 256 / 10000))


def test_adaptive_controller_resumes_identically():
    a = AdaptiveKLController(init_coef=0.2, target_kl=1.0, horizon=100)
    for kl in [3.0, 0.5, 1.1]:
        a.update(kl, n_steps=10)
    b = AdaptiveKLController(init_coef=0.2, target_kl=1.0, horizon=100)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value != 0.2
    a.update(0.1, n_steps=10)
    b.update(0.1, n_steps=10)
    assert a.value == b.value


def test_adaptive_controller_rejects_bad_settings():
    with pytest.raises(ValueError, match="target_kl > 0"):
        AdaptiveKLController(init_coef=0.1, target_kl=0.0, horizon=10)
