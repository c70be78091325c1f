"""Preference losses: the DPO family on pairs, KTO on unpaired examples, and Bradley-Terry.

A pair is one prompt x with a chosen response y_w and a rejected one y_l. The pair losses
(``PREFERENCE_LOSSES``, chosen by ``dpo.loss_type``) take the sequence log-probs (summed over
the response tokens) of both responses under the policy π and, unless the loss is
reference-free, the frozen reference π_ref, and return one loss per pair. Most are functions of
the log-ratios ``ρ_w = log π(y_w|x) - log π_ref(y_w|x)``, ``ρ_l`` likewise, and their
difference ``h = ρ_w - ρ_l``; β is ``dpo.beta``.

Every loss is registered with the facts the driver and ``treadle check`` read:

- ``reference`` (default True): False for ORPO and SimPO, which never see a reference model;
  the DPO driver then builds none and skips the reference phase.
- ``knobs``: the ``dpo.*`` settings the loss reads besides ``beta`` (``label_smoothing``,
  ``discopop_tau``, ``simpo_gamma``, ``f_divergence`` with ``f_alpha``). A setting changed
  from its default that the chosen loss does not read is a start-up error naming the key.
- ``positive``: knobs that must be > 0 (EXO's ε).
- ``nll``: the weight of the chosen responses' token-mean NLL the loss includes (ORPO: 1).
- ``batchwise``: the loss of a pair depends on the other pairs of its micro-batch (AOT sorts
  them): TRL sorts within a device batch, treadle within a micro-batch
  (``actor.micro_batch_size`` pairs), the same thing when one micro-batch holds a rank's
  batch.

Length-normalised losses (``sigmoid_norm``, ``simpo``, ``orpo``) also get the response
lengths in tokens (EOS included) and use ``log π(y|x) / |y|``.

``f_divergence`` (f-DPO, Wang et al., arXiv 2309.16240) replaces each log-ratio ρ by f'(e^ρ)
before the chosen-minus-rejected difference: ``reverse_kl`` ρ (DPO), ``forward_kl``
``1 - e^{-ρ}``, ``js_divergence`` ``log 2 + log σ(ρ)``, ``alpha_divergence``
``(e^{(α-1)ρ} - 1) / (α - 1)`` (α = ``f_alpha``). As in TRL 1.16 it applies only to the losses
built on that difference (``knobs`` lists it).

TRL 1.16's pair losses not registered here: ``sft`` (the chosen NLL alone: ``dpo.nll_coef``
adds it to any loss) and TRL's combinations of several losses (``loss_weights``); its WPO
weighting (``use_weighting``) and LD-DPO (``ld_alpha``) are not implemented.

Unpaired examples (``UNPAIRED_LOSSES``, ``kto.loss_type``) are one prompt and one completion
labelled desirable or not; see :func:`kto_loss`.

``bradley_terry_loss`` trains an explicit reward model r (Bradley & Terry 1952, as in
InstructGPT, arXiv 2203.02155): ``-log σ(r(x, y_w) - r(x, y_l))`` per pair.

All functions are pure, per pair or per example (shape ``[B]`` in and out), so the caller can
sum the losses of micro-batches and divide by the number of pairs of the whole batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from treadle.algorithms.registry import register_preference_loss, register_unpaired_loss

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# exp((α - 1) ρ) overflows past these in low precision; float64 is left alone
_EXP_MAX = {torch.float16: 11.0, torch.bfloat16: 80.0, torch.float32: 80.0}
_SMOOTHING_AND_F = ("label_smoothing", "f_divergence")


def implicit_rewards(policy_logps: Tensor, ref_logps: Tensor, beta: float) -> Tensor:
    """DPO's implicit reward ``β (log π(y|x) - log π_ref(y|x))`` of each response."""
    return beta * (policy_logps - ref_logps)


def length_rewards(policy_logps: Tensor, lengths: Tensor, beta: float) -> Tensor:
    """A reference-free loss's reward ``β log π(y|x) / |y|`` (SimPO's; TRL logs ORPO's so)."""
    return beta * policy_logps / lengths


def f_divergence_scores(logratio: Tensor, kind: str = "reverse_kl", alpha: float = 0.5) -> Tensor:
    """f'(e^ρ) of log-ratios ρ for the f-divergence ``kind`` (f-DPO, arXiv 2309.16240)."""
    if kind == "reverse_kl":
        return logratio
    if kind == "forward_kl":
        return 1 - torch.exp(-logratio)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratio)
    if kind == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:  # the limit α -> 1 is the reverse KL
            return logratio
        t = (alpha - 1.0) * logratio
        if t.dtype in _EXP_MAX:
            t = t.clamp(max=_EXP_MAX[t.dtype])
        return (torch.exp(t) - 1.0) / (alpha - 1.0)
    raise ValueError(f"unknown f-divergence {kind!r}; valid: {', '.join(F_DIVERGENCES)}")


def _log_ratios(
    pc: Tensor, pr: Tensor, rc: Tensor | None, rr: Tensor | None
) -> tuple[Tensor, Tensor]:
    if rc is None or rr is None:
        raise ValueError("this loss compares the policy with a reference: pass its log-probs")
    return pc - rc, pr - rr


def _scores_margin(
    pc: Tensor, pr: Tensor, rc: Tensor | None, rr: Tensor | None, f_divergence: str, f_alpha: float
) -> Tensor:
    """``f'(ρ_w) - f'(ρ_l)``: h itself for the reverse KL."""
    chosen, rejected = _log_ratios(pc, pr, rc, rr)
    return f_divergence_scores(chosen, f_divergence, f_alpha) - f_divergence_scores(
        rejected, f_divergence, f_alpha
    )


def _smoothed_sigmoid(logits: Tensor, label_smoothing: float) -> Tensor:
    """``-(1 - ε) log σ(z) - ε log σ(-z)``."""
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def _lengths(lengths: Tensor | None, name: str) -> Tensor:
    if lengths is None:
        raise ValueError(f"this loss is length-normalised: pass {name}")
    return lengths


@register_preference_loss("sigmoid", knobs=_SMOOTHING_AND_F)
def sigmoid_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    **_: Any,
) -> Tensor:
    """DPO (Rafailov et al., arXiv 2305.18290): ``-(1 - ε) log σ(β h) - ε log σ(-β h)``

    ε = ``label_smoothing`` is conservative DPO (cDPO: the labels flipped with probability ε);
    ε = 0 is plain DPO, TRL's ``sigmoid``. At π = π_ref, h = 0 and the loss is ln 2.
    """
    h = _scores_margin(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        f_divergence,
        f_alpha,
    )
    return _smoothed_sigmoid(beta * h, label_smoothing)


@register_preference_loss("ipo", knobs=("f_divergence",))
def ipo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    **_: Any,
) -> Tensor:
    """IPO (Azar et al., arXiv 2310.12036): ``(h - 1/(2β))²``

    Eq. 17, β is the paper's τ: a squared loss that pulls h to a finite target instead of
    pushing it to infinity. Log-probs are summed over tokens as in the paper; TRL averages them
    per token for IPO (``sigmoid_norm`` is that normalisation for DPO), another objective.
    """
    h = _scores_margin(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        f_divergence,
        f_alpha,
    )
    return (h - 1 / (2 * beta)) ** 2


@register_preference_loss("hinge", knobs=("f_divergence",))
def hinge_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    **_: Any,
) -> Tensor:
    """SLiC (Zhao et al., arXiv 2305.10425): ``max(0, 1 - β h)``

    The calibration hinge loss on the log-ratio margin, as TRL's ``hinge`` (1/β is the margin).
    """
    h = _scores_margin(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        f_divergence,
        f_alpha,
    )
    return torch.relu(1 - beta * h)


@register_preference_loss("robust", knobs=_SMOOTHING_AND_F)
def robust_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    **_: Any,
) -> Tensor:
    """Robust DPO (Chowdhury et al., arXiv 2403.00409):
    ``[-(1-ε) log σ(βh) + ε log σ(-βh)] / (1-2ε)``

    An unbiased loss under labels flipped with probability ε = ``label_smoothing`` < 1/2
    (with ε = 0 it is DPO).
    """
    h = _scores_margin(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        f_divergence,
        f_alpha,
    )
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)


@register_preference_loss("exo_pair", knobs=_SMOOTHING_AND_F, positive=("label_smoothing",))
def exo_pair_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    **_: Any,
) -> Tensor:
    """EXO (Ji et al., arXiv 2402.00856): ``KL(q || p) = Σ_k q_k (log q_k - log p_k)``

    Eq. 16 with two responses: q = (σ(βh), σ(-βh)) the policy's distribution over the pair and
    p = (1 - ε, ε) the smoothed label, ε = ``label_smoothing`` > 0 (the paper suggests 1e-3).
    """
    if label_smoothing <= 0:
        raise ValueError("exo_pair needs label_smoothing > 0 (the EXO paper uses 1e-3)")
    h = _scores_margin(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        f_divergence,
        f_alpha,
    )
    z = beta * h
    win = torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-label_smoothing))
    lose = torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(label_smoothing))
    return win + lose


@register_preference_loss("nca_pair")
def nca_pair_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    **_: Any,
) -> Tensor:
    """NCA (Chen et al., arXiv 2402.05369): ``-log σ(βρ_w) - ½ log σ(-βρ_w) - ½ log σ(-βρ_l)``

    Noise-contrastive alignment with two responses: each response's own reward βρ is pushed
    up (chosen) or down (rejected), not only their difference.
    """
    chosen, rejected = _log_ratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    rc, rr = beta * chosen, beta * rejected
    return -F.logsigmoid(rc) - 0.5 * F.logsigmoid(-rc) - 0.5 * F.logsigmoid(-rr)


@register_preference_loss("bco_pair")
def bco_pair_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    **_: Any,
) -> Tensor:
    """BCO (Jung et al., arXiv 2404.04656): ``-log σ(βρ_w - δ) - log σ(-(βρ_l - δ))``, δ = 0

    Binary classification of each response's reward. The paper's δ is a running mean of the
    rewards (state kept across steps); TRL 1.16's ``bco_pair`` dropped it (δ = 0, no state)
    and treadle follows TRL 1.16, so the loss is a pure function of the batch.
    """
    chosen, rejected = _log_ratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)


@register_preference_loss("sppo_hard")
def sppo_hard_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    **_: Any,
) -> Tensor:
    """SPPO (Wu et al., arXiv 2405.00675): ``(ρ_w - 1/(2β))² + (ρ_l + 1/(2β))²``

    Eq. 4.7 with hard win probabilities (1 for the chosen, 0 for the rejected), as TRL's
    ``sppo_hard``; the paper's soft probabilities come from a preference model.
    """
    chosen, rejected = _log_ratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2


@register_preference_loss("aot", knobs=("label_smoothing",), batchwise=True)
def aot_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    **_: Any,
) -> Tensor:
    """AOT (Melnyk et al., arXiv 2406.05882): ``ℓ_ε(β (sort(π_w - π_l) - sort(ref_w - ref_l)))``

    Distributional alignment by optimal transport: the policy's and the reference's chosen -
    rejected log-prob gaps are each sorted over the (micro-)batch and matched by rank, then
    put through the smoothed sigmoid loss ℓ_ε of ``sigmoid``. Loss i belongs to the i-th
    smallest gap, not to pair i.
    """
    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError("aot compares the policy with a reference: pass its log-probs")
    policy = torch.sort(policy_chosen_logps - policy_rejected_logps, dim=0).values
    ref = torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0).values
    return _smoothed_sigmoid(beta * (policy - ref), label_smoothing)


@register_preference_loss("aot_unpaired", knobs=("label_smoothing",), batchwise=True)
def aot_unpaired_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    **_: Any,
) -> Tensor:
    """AOT unpaired (Melnyk et al., arXiv 2406.05882): ``ℓ_ε(β (sort(ρ_w) - sort(ρ_l)))``

    The chosen and the rejected log-ratios are sorted separately over the (micro-)batch and
    matched by rank, so the pairing of the data is not used.
    """
    chosen, rejected = _log_ratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    delta = torch.sort(chosen, dim=0).values - torch.sort(rejected, dim=0).values
    return _smoothed_sigmoid(beta * delta, label_smoothing)


@register_preference_loss("apo_zero")
def apo_zero_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    **_: Any,
) -> Tensor:
    """APO-zero (D'Oosterlinck et al., arXiv 2408.06266): ``1 - σ(βρ_w) + σ(βρ_l)``

    Eq. 7: for chosen answers better than the model's own, raise their likelihood and lower the
    rejected ones'.
    """
    chosen, rejected = _log_ratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    return 1 - torch.sigmoid(beta * chosen) + torch.sigmoid(beta * rejected)


@register_preference_loss("apo_down")
def apo_down_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    **_: Any,
) -> Tensor:
    """APO-down (D'Oosterlinck et al., arXiv 2408.06266): ``σ(βρ_w) + 1 - σ(β(ρ_w - ρ_l))``

    Eq. 8: for chosen answers worse than the model's own, lower both likelihoods, the
    rejected one's more.
    """
    chosen, rejected = _log_ratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    return torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(beta * (chosen - rejected))


@register_preference_loss("discopop", knobs=("discopop_tau", "f_divergence"))
def discopop_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    discopop_tau: float = 0.05,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    **_: Any,
) -> Tensor:
    """DiscoPOP (Lu et al., arXiv 2406.08414): ``(1 - σ(βh/τ)) (-log σ(βh)) + σ(βh/τ) e^{-βh}``

    Eq. 5, the discovered log-ratio modulated loss: a blend of the logistic and the
    exponential loss, weighted by σ(βh/τ) with τ = ``discopop_tau`` (0.05 in the paper).
    """
    h = _scores_margin(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        f_divergence,
        f_alpha,
    )
    z = beta * h
    mix = torch.sigmoid(z / discopop_tau)
    return (1 - mix) * -F.logsigmoid(z) + mix * torch.exp(-z)


@register_preference_loss("sigmoid_norm", knobs=("f_divergence",))
def sigmoid_norm_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    **_: Any,
) -> Tensor:
    """Length-normalised DPO (LN-DPO, Meng et al., arXiv 2405.14734):
    ``-log σ(β (ρ_w/|y_w| - ρ_l/|y_l|))``

    DPO on per-token log-ratios (SimPO's ablation with a reference), TRL's ``sigmoid_norm``.
    """
    chosen, rejected = _log_ratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    chosen = f_divergence_scores(chosen, f_divergence, f_alpha)
    rejected = f_divergence_scores(rejected, f_divergence, f_alpha)
    h = chosen / _lengths(chosen_lengths, "chosen_lengths") - rejected / _lengths(
        rejected_lengths, "rejected_lengths"
    )
    return -F.logsigmoid(beta * h)


@register_preference_loss("simpo", knobs=("label_smoothing", "simpo_gamma"), reference=False)
def simpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    **_: Any,
) -> Tensor:
    """SimPO (Meng et al., arXiv 2405.14734):
    ``-log σ(β (log π(y_w)/|y_w| - log π(y_l)/|y_l|) - γ)``

    Reference-free: the reward is the policy's average token log-prob, with a target margin
    γ = ``simpo_gamma``; ``label_smoothing`` ε smooths it as cDPO does (TRL's CPO trainer
    with ``loss_type=simpo``). The reference log-probs are ignored. TRL's CPO trainer also adds
    the chosen NLL by default (``cpo_alpha=1``); here that is ``dpo.nll_coef`` (0 by default,
    as in the paper).
    """
    chosen = policy_chosen_logps / _lengths(chosen_lengths, "chosen_lengths")
    rejected = policy_rejected_logps / _lengths(rejected_lengths, "rejected_lengths")
    return _smoothed_sigmoid(beta * (chosen - rejected) - simpo_gamma, label_smoothing)


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - e^x)`` for x < 0, accurate on both sides of -ln 2 (Mächler 2012)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@register_preference_loss("orpo", reference=False, nll=1.0)
def orpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    **_: Any,
) -> Tensor:
    """ORPO (Hong et al., arXiv 2403.07691):
    ``-λ log σ(log odds(y_w) - log odds(y_l))``, odds(y) = p / (1 - p)

    Eqs. 4-7 with p = exp(log π(y|x)/|y|), the per-token average probability, and λ = β.
    Reference-free; the registration's ``nll=1.0`` makes the driver add the chosen responses'
    token-mean NLL (the paper's L_SFT), so the whole loss is L_SFT + λ L_OR as in the paper
    and TRL's ORPO trainer.
    """
    chosen = policy_chosen_logps / _lengths(chosen_lengths, "chosen_lengths")
    rejected = policy_rejected_logps / _lengths(rejected_lengths, "rejected_lengths")
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return -beta * F.logsigmoid(log_odds)


# ----------------------------------------------------------------------------- unpaired


def kto_kl(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """KTO's reference point z0: ``max(0, mean(log π(y'|x) - log π_ref(y'|x)))``, detached.

    Over mismatched pairs (x, y') of the batch (each prompt with another example's
    completion), a biased estimate of KL(π || π_ref) that no gradient flows through.
    """
    return (policy_kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


@register_unpaired_loss("kto", kl=True)
def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    kl: Tensor | float,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    **_: Any,
) -> Tensor:
    """KTO (Ethayarajh et al., arXiv 2402.01306):
    ``λ_D (1 - σ(β(ρ - z0)))`` if desirable, else ``λ_U (1 - σ(β(z0 - ρ)))``

    Eq. 7 per example: ρ = log π(y|x) - log π_ref(y|x), z0 = :func:`kto_kl` of the batch,
    λ_D / λ_U = ``desirable_weight`` / ``undesirable_weight``. The batch loss is the mean over
    examples (TRL's too), so with unbalanced labels the weights should make
    λ_D n_D / (λ_U n_U) lie in [1, 4/3], as the paper advises.
    """
    ratio = policy_logps - ref_logps
    good = desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(labels.bool(), good, bad)


@register_unpaired_loss("apo_zero_unpaired")
def apo_zero_unpaired_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    kl: Tensor | float,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    **_: Any,
) -> Tensor:
    """APO-zero unpaired (D'Oosterlinck et al., arXiv 2408.06266):
    ``λ_D (1 - σ(βρ))`` if desirable, else ``λ_U σ(βρ)``

    Eq. 7 of APO on single examples (TRL's KTO ``loss_type=apo_zero_unpaired``): no reference
    point, so no mismatched KL pairs are scored (``kl`` is ignored).
    """
    ratio = policy_logps - ref_logps
    good = desirable_weight * (1 - torch.sigmoid(beta * ratio))
    bad = undesirable_weight * torch.sigmoid(beta * ratio)
    return torch.where(labels.bool(), good, bad)


def bradley_terry_loss(chosen_scores: Tensor, rejected_scores: Tensor) -> Tensor:
    """Reward-model loss ``-log σ(r_c - r_r)`` per pair."""
    return -F.logsigmoid(chosen_scores - rejected_scores)


def pair_stats(chosen: Tensor, rejected: Tensor) -> dict[str, float]:
    """Sums over pairs (for exact averages across micro-batches and ranks) of the usual metrics.

    ``accuracy``: chosen strictly above rejected; ``margin``: chosen - rejected; the two
    scores themselves.
    """
    chosen, rejected = chosen.detach().float(), rejected.detach().float()
    return {
        "accuracy": float((chosen > rejected).float().sum()),
        "margin": float((chosen - rejected).sum()),
        "chosen": float(chosen.sum()),
        "rejected": float(rejected.sum()),
    }
