"""Distillation losses: GKD's generalized JSD against TRL 1.16, on-policy distillation's
advantages by hand, and the registry entries the driver reads.

``GKDTrainer.generalized_jsd_loss`` is a static method of TRL's experimental GKD trainer: it
is called on our numbers in float64, ``[B, S, V]`` with ``-100`` labels and
``reduction="batchmean"``; ours takes the ``[N, K]`` rows and returns one value a row, whose
masked token-mean must equal TRL's, values and gradients, to 1e-12.
"""

from __future__ import annotations

import os

import pytest
import torch
from reference import trl_module

from treadle.algorithms import (
    DISTILL_LOSSES,
    generalized_jsd,
    masked_mean,
    reverse_kl_advantages,
)
from treadle.algorithms.distill import GKDSettings, ReverseKLSettings
from treadle.config import DistillConfig

TOL = {"atol": 1e-12, "rtol": 1e-12}
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]
TEMPERATURES = [1.0, 0.7]
B, S, V = 3, 5, 11


def trl_jsd():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    return trl_module("trl.experimental.gkd.gkd_trainer").GKDTrainer.generalized_jsd_loss


def logits(seed: int = 0, v: int = V) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student and teacher logits ``[B, S, v]`` (float64) and TRL labels with -100 padding."""
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(B, S, v, generator=g, dtype=torch.float64) * 2).requires_grad_()
    teacher = torch.randn(B, S, v, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, v, (B, S), generator=g)
    labels[0, 3:] = -100  # right padding
    labels[2, :2] = -100  # prompt positions
    return student, teacher, labels


def ours_token_mean(student, teacher, labels, beta, temperature):
    """Our per-position JSD of the flattened rows, token-mean over the unmasked labels."""
    k = student.shape[-1]
    per_position = generalized_jsd(
        student.reshape(-1, k), teacher.reshape(-1, k), beta, temperature
    )
    return masked_mean(per_position, (labels != -100).reshape(-1))


def value_and_grad(loss, student):
    (grad,) = torch.autograd.grad(loss, student, retain_graph=True)  # graphs may share a gather
    return loss.detach(), grad


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("beta", BETAS)
def test_generalized_jsd_equals_trl_on_full_logits(beta, temperature):
    student, teacher, labels = logits()
    want = trl_jsd()(
        student, teacher, labels=labels, beta=beta, temperature=temperature, reduction="batchmean"
    )
    got = ours_token_mean(student, teacher, labels, beta, temperature)
    got_value, got_grad = value_and_grad(got, student)
    want_value, want_grad = value_and_grad(want, student)
    assert want_value > 0
    torch.testing.assert_close(got_value, want_value, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("beta", BETAS)
def test_generalized_jsd_on_the_teachers_top_k_equals_trl_on_the_same_gathered_logits(
    beta, temperature
):
    """Both distributions restricted to the teacher's 4 most likely ids and renormalised there:
    TRL's loss on the gathered logits is ours on them; gradients reach the full student logits
    through the gather, at the top-k ids only."""
    student, teacher, labels = logits(seed=1)
    ids = teacher.topk(4, dim=-1).indices
    s_k, t_k = student.gather(-1, ids), teacher.gather(-1, ids)
    want = trl_jsd()(s_k, t_k, labels=labels, beta=beta, temperature=temperature)
    got = ours_token_mean(s_k, t_k, labels, beta, temperature)
    got_value, got_grad = value_and_grad(got, student)
    want_value, want_grad = value_and_grad(want, student)
    torch.testing.assert_close(got_value, want_value, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    outside = torch.ones_like(student, dtype=torch.bool).scatter_(-1, ids, False)
    assert got_grad[outside].eq(0).all()


@pytest.mark.parametrize("beta", BETAS)
def test_top_k_with_k_equal_to_the_vocabulary_is_trls_full_vocabulary_loss(beta):
    """K = V: the teacher's ids in its order (a permutation of the vocabulary) give TRL's loss
    on the unpermuted logits (the sums over K reordered: equal to rounding)."""
    student, teacher, labels = logits(seed=2)
    ids = teacher.topk(V, dim=-1).indices
    got = ours_token_mean(student.gather(-1, ids), teacher.gather(-1, ids), labels, beta, 0.7)
    want = trl_jsd()(student, teacher, labels=labels, beta=beta, temperature=0.7)
    got_value, got_grad = value_and_grad(got, student)
    want_value, want_grad = value_and_grad(want, student)
    torch.testing.assert_close(got_value, want_value, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)


def test_log_probs_in_give_what_logits_give():
    """The teacher's top-k as log-probs over the whole vocabulary (what an inference engine
    returns) or as logits: the same divergence, both renormalised over the K ids."""
    student, teacher, _ = logits(seed=3)
    ids = teacher.topk(4, dim=-1).indices
    s_k, t_k = student.gather(-1, ids), teacher.gather(-1, ids)
    t_logp = torch.log_softmax(teacher, -1).gather(-1, ids)
    s_logp = torch.log_softmax(student, -1).gather(-1, ids)
    want = generalized_jsd(s_k.reshape(-1, 4), t_k.reshape(-1, 4), 0.5, 0.7)
    got = generalized_jsd(s_logp.reshape(-1, 4), t_logp.reshape(-1, 4), 0.5, 0.7)
    torch.testing.assert_close(got, want, **TOL)


def test_generalized_jsd_hand_cases():
    """Equal distributions: 0 for every β; β = 0 is KL(teacher ‖ student), β = 1 the reverse,
    against the formula on two ids; a β outside [0, 1] is refused."""
    z = torch.tensor([[0.3, -1.2, 2.0]], dtype=torch.float64)
    for beta in BETAS:
        assert generalized_jsd(z, z, beta).abs().max() < 1e-15
    s = torch.tensor([[0.0, 0.0]], dtype=torch.float64)  # p_S = (1/2, 1/2)
    t = torch.tensor(
        [[0.0, torch.log(torch.tensor(3.0)).item()]], dtype=torch.float64
    )  # (1/4, 3/4)
    forward = 0.25 * torch.log(torch.tensor(0.5)) + 0.75 * torch.log(torch.tensor(1.5))
    reverse = 0.5 * torch.log(torch.tensor(2.0)) + 0.5 * torch.log(torch.tensor(2 / 3))
    torch.testing.assert_close(generalized_jsd(s, t, 0.0)[0].float(), forward)
    torch.testing.assert_close(generalized_jsd(s, t, 1.0)[0].float(), reverse)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(s, t, 1.5)


# ------------------------------------------------------------------ on-policy distillation


def test_reverse_kl_advantages_by_hand():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, float("-inf"), -1.0]])
    teacher = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -2.0, -4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # -coef (student - teacher): row 0: -2 (0.5, -1, 0) = (-1, 2, 0); row 1: -2 (-2) = 4, then 0
    want = torch.tensor([[-1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    got = reverse_kl_advantages(student, teacher, mask, coef=2.0)
    assert torch.equal(got, want)  # no nan from the -inf under the mask
    # the student more likely than the teacher: negative advantage, so the step lowers it
    assert reverse_kl_advantages(student[:1, :1], teacher[:1, :1], mask[:1, :1], 1.0) == -0.5


# ------------------------------------------------------------------ registry


def test_distill_losses_are_registered_with_what_they_read():
    assert DISTILL_LOSSES.names() == ["gkd", "reverse_kl", "seq_kd"]
    assert DISTILL_LOSSES.get("reverse_kl") is reverse_kl_advantages
    assert DISTILL_LOSSES.get("gkd") is generalized_jsd
    assert DISTILL_LOSSES.info("reverse_kl") == {
        "knobs": ("coef", "task_reward"),
        "needs": ("teacher_log_probs",),
    }
    assert DISTILL_LOSSES.info("gkd") == {
        "knobs": ("beta", "lmbda", "temperature", "top_k"),
        "needs": ("teacher_topk",),
    }
    assert DISTILL_LOSSES.info("seq_kd") == {"needs": ("teacher_samples",), "nll": 1.0}
    logp = torch.tensor([[-0.5, -2.0]])
    assert torch.equal(DISTILL_LOSSES.get("seq_kd")(logp), torch.tensor([[0.5, 2.0]]))


def test_distill_settings_are_the_distill_sections_keys_with_its_defaults():
    """Every knob is a ``distill`` key, and the settings built from the default section are
    the settings classes' defaults (the driver builds them with ``settings_from``)."""
    section = DistillConfig()
    for name in DISTILL_LOSSES.names():
        assert set(DISTILL_LOSSES.knobs(name)) <= set(DistillConfig.model_fields)
    assert DISTILL_LOSSES.settings_from("reverse_kl", section) == ReverseKLSettings()
    assert DISTILL_LOSSES.settings_from("gkd", section) == GKDSettings()
    with pytest.raises(ValueError, match="did you mean 'gkd'"):
        DISTILL_LOSSES.get("gdk")
