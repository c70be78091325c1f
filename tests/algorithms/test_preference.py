"""Preference losses (DPO sigmoid, IPO, Bradley-Terry) against plain implementations."""

from __future__ import annotations

import math
import re

import pytest
import torch
from algorithm_calls import pair_loss

from treadle.algorithms import PREFERENCE_LOSSES, bradley_terry_loss, implicit_rewards, pair_stats
from treadle.check import check_algorithm
from treadle.config import load_config
from treadle.runtime.errors import ConfigError


def plain_sigmoid_dpo(pc, pr, rc, rr, beta, eps=0.0):  # type: ignore[no-untyped-def]
    """DPO / cDPO for one pair, in Python floats."""
    h = (pc - rc) - (pr - rr)

    def log_sigmoid(x: float) -> float:
        return -math.log1p(math.exp(-x))

    return -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h)


def plain_ipo(pc, pr, rc, rr, beta):  # type: ignore[no-untyped-def]
    h = (pc - rc) - (pr - rr)
    return (h - 1 / (2 * beta)) ** 2


def sequence_logps(n: int = 6, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [-(torch.rand(n, generator=g, dtype=torch.float64) * 30) for _ in range(4)]


@pytest.mark.parametrize(("beta", "eps"), [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2)])
def test_sigmoid_loss_and_gradient_match_plain_dpo(beta: float, eps: float):
    pc, pr, rc, rr = sequence_logps()
    expected = [
        plain_sigmoid_dpo(*(float(t[i]) for t in (pc, pr, rc, rr)), beta, eps) for i in range(6)
    ]
    pc.requires_grad_(True)
    pr.requires_grad_(True)
    losses = pair_loss("sigmoid", pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    torch.testing.assert_close(losses, torch.tensor(expected, dtype=torch.float64))
    losses.sum().backward()
    # d/d log pi(y_w) of -(1-e) log s(b h) - e log s(-b h) = -b [(1-e) s(-b h) - e s(b h)]
    h = ((pc - rc) - (pr - rr)).detach()
    grad = -beta * ((1 - eps) * torch.sigmoid(-beta * h) - eps * torch.sigmoid(beta * h))
    torch.testing.assert_close(pc.grad, grad)
    torch.testing.assert_close(pr.grad, -grad)


def test_ipo_loss_and_gradient_match_the_paper():
    pc, pr, rc, rr = sequence_logps(seed=1)
    expected = [plain_ipo(*(float(t[i]) for t in (pc, pr, rc, rr)), 0.25) for i in range(6)]
    pc.requires_grad_(True)
    losses = pair_loss("ipo", pc, pr, rc, rr, beta=0.25)
    torch.testing.assert_close(losses, torch.tensor(expected, dtype=torch.float64))
    losses.sum().backward()
    h = ((pc - rc) - (pr - rr)).detach()
    torch.testing.assert_close(pc.grad, 2 * (h - 2.0))  # 1 / (2 beta) = 2
    # ipo does not read label smoothing (a config setting it fails at start-up, below)
    with pytest.raises(TypeError, match="label_smoothing"):
        pair_loss("ipo", pc, pr, rc, rr, beta=0.25, label_smoothing=0.1)


def test_dpo_loss_is_ln2_when_policy_equals_reference():
    logps = torch.tensor([-12.5, -3.0, -40.0])
    other = torch.tensor([-7.0, -9.5, -1.0])
    losses = pair_loss("sigmoid", logps, other, logps, other, beta=0.3)
    torch.testing.assert_close(losses, torch.full((3,), math.log(2)))
    # IPO at the same point: (0 - 1/(2 beta))^2
    ipo = pair_loss("ipo", logps, other, logps, other, beta=0.5)
    torch.testing.assert_close(ipo, torch.ones(3))


def test_bradley_terry_loss_by_hand():
    chosen = torch.tensor([2.0, 0.0, -1.0])
    rejected = torch.tensor([0.5, 0.0, 1.0])
    # -log sigmoid(d) = log(1 + e^-d): d = 1.5, 0, -2
    expected = torch.tensor([math.log(1 + math.exp(-1.5)), math.log(2), math.log(1 + math.exp(2))])
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected), expected)
    assert expected[0].item() == pytest.approx(0.2014133, abs=1e-6)


def test_implicit_rewards_and_pair_stats():
    rewards = implicit_rewards(torch.tensor([-1.0, -5.0]), torch.tensor([-2.0, -4.0]), 0.5)
    torch.testing.assert_close(rewards, torch.tensor([0.5, -0.5]))
    stats = pair_stats(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 3.0]))
    assert stats == {"accuracy": 1.0, "margin": 0.0, "chosen": 3.0, "rejected": 3.0}


def test_names_and_config_rules():
    assert {"ipo", "sigmoid", "orpo", "simpo"} <= set(PREFERENCE_LOSSES.names())
    with pytest.raises(ValueError, match=r"valid: aot, .*sigmoid.*did you mean 'sigmoid'"):
        PREFERENCE_LOSSES.get("sigmod")
    with pytest.raises(ConfigError, match=r"dpo\.beta"):
        load_config(None, ["dpo.beta=0"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], "dpo.label_smoothing=0.1 is not read"),
        (["dpo.loss_type=hinge", "dpo.simpo_gamma=1"], "dpo.simpo_gamma=1.0 is not read"),
        (["dpo.loss_type=simpo", "dpo.f_divergence=js_divergence"], "dpo.f_divergence="),
        (["dpo.loss_type=nca_pair", "dpo.f_alpha=0.3"], "dpo.f_alpha=0.3 is not read"),
        (["dpo.loss_type=exo_pair"], "needs dpo.label_smoothing > 0"),
        (["dpo.loss_type=orpo", "dpo.nll_coef=1"], "set dpo.nll_coef=0"),
        (["dpo.loss_type=simpoo"], "did you mean 'simpo'"),
    ],
)
def test_dpo_knobs_a_loss_does_not_read_are_errors(overrides, message):  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_algorithm(load_config(None, overrides), "dpo")


@pytest.mark.parametrize(
    "overrides",
    [
        ["dpo.loss_type=sigmoid", "dpo.label_smoothing=0.1", "dpo.f_divergence=alpha_divergence"],
        ["dpo.loss_type=discopop", "dpo.discopop_tau=0.2", "dpo.f_alpha=0.3"],
        ["dpo.loss_type=simpo", "dpo.simpo_gamma=1", "dpo.label_smoothing=0.1"],
        ["dpo.loss_type=exo_pair", "dpo.label_smoothing=0.001"],
    ],
)
def test_dpo_knobs_a_loss_reads_pass(overrides):  # type: ignore[no-untyped-def]
    check_algorithm(load_config(None, overrides), "dpo")


def test_kto_rules():
    mini = "actor.ppo_mini_batch_size=1"
    check_algorithm(load_config(None, ["data.batch_size=2", mini]), "kto")
    with pytest.raises(ConfigError, match=r"kto\.loss_type: unknown name 'ktoo'.*'kto'"):
        check_algorithm(load_config(None, ["kto.loss_type=ktoo"]), "kto")
    with pytest.raises(ConfigError, match=r"data\.batch_size=1: KTO"):
        check_algorithm(load_config(None, ["data.batch_size=1", mini]), "kto")
