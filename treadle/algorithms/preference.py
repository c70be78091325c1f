"""Preference losses: the DPO family on pairs, KTO on unpaired examples, and Bradley-Terry.

A pair is one prompt x with a chosen response y_w and a rejected one y_l. The pair losses
(``PREFERENCE_LOSSES``, chosen by ``dpo.loss_type``) are ``fn(inputs: PairInputs, settings)``:
the sequence log-probs (summed over the response tokens) of both responses under the policy π
and, unless the loss is reference-free, the frozen reference π_ref, and return one loss per
pair. Most are functions of
the log-ratios ``ρ_w = log π(y_w|x) - log π_ref(y_w|x)``, ``ρ_l`` likewise, and their
difference ``h = ρ_w - ρ_l``; β is ``dpo.beta``.

Every loss is registered with the facts the driver and ``treadle check`` read:

- ``reference`` (default True): False for ORPO and SimPO, which never see a reference model;
  the DPO driver then builds none and skips the reference phase.
- ``settings``: its settings class (:class:`Beta` and kin), whose fields are ``beta`` and the
  ``dpo.*`` knobs the loss reads (``label_smoothing``, ``discopop_tau``, ``simpo_gamma``,
  ``f_divergence`` with ``f_alpha``): ``PREFERENCE_LOSSES.knobs(name)``. A knob changed from
  its default that the chosen loss does not read is a start-up error naming the key.
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
built on that difference (their settings have it).

TRL 1.16's pair losses not registered here: ``sft`` (the chosen NLL alone: ``dpo.nll_coef``
adds it to any loss) and TRL's combinations of several losses (``loss_weights``); its WPO
weighting (``use_weighting``) and LD-DPO (``ld_alpha``) are not implemented.

Unpaired examples (``UNPAIRED_LOSSES``, ``kto.loss_type``: ``fn(inputs: UnpairedInputs,
settings)``) are one prompt and one completion labelled desirable or not; see :func:`kto_loss`.

``bradley_terry_loss`` trains an explicit reward model r (Bradley & Terry 1952, as in
InstructGPT, arXiv 2203.02155): ``-log σ(r(x, y_w) - r(x, y_l))`` per pair.

All functions are pure, per pair or per example (shape ``[B]`` in and out), so the caller can
sum the losses of micro-batches and divide by the number of pairs of the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from treadle.algorithms.inputs import PairInputs, UnpairedInputs
from treadle.algorithms.registry import register_preference_loss, register_unpaired_loss

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# exp((α - 1) ρ) overflows past these in low precision; float64 is left alone
_EXP_MAX = {torch.float16: 11.0, torch.bfloat16: 80.0, torch.float32: 80.0}


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


@dataclass(frozen=True)
class Beta:
    """``dpo.beta`` (``kto.beta`` for an unpaired loss): every loss of the kind reads it."""

    beta: float


@dataclass(frozen=True)
class Smoothing(Beta):
    """β and the label smoothing ε (``dpo.label_smoothing``)."""

    label_smoothing: float = 0.0


@dataclass(frozen=True)
class FDivergence(Beta):
    """β and the f-divergence of the log-ratios (``dpo.f_divergence``, ``dpo.f_alpha``)."""

    f_divergence: str = "reverse_kl"
    f_alpha: float = 0.5


@dataclass(frozen=True)
class SmoothedF(Smoothing):
    """β, the label smoothing ε and the f-divergence."""

    f_divergence: str = "reverse_kl"
    f_alpha: float = 0.5


def _log_ratios(inputs: PairInputs) -> tuple[Tensor, Tensor]:
    """``ρ_w``, ``ρ_l``: the policy's log-probs minus the reference's."""
    rc, rr = inputs.ref_chosen_logps, inputs.ref_rejected_logps
    if rc is None or rr is None:
        raise ValueError("this loss compares the policy with a reference: pass its log-probs")
    return inputs.policy_chosen_logps - rc, inputs.policy_rejected_logps - rr


def _scores_margin(inputs: PairInputs, settings: FDivergence | SmoothedF) -> Tensor:
    """``f'(ρ_w) - f'(ρ_l)``: h itself for the reverse KL."""
    chosen, rejected = _log_ratios(inputs)
    kind, alpha = settings.f_divergence, settings.f_alpha
    return f_divergence_scores(chosen, kind, alpha) - f_divergence_scores(rejected, kind, alpha)


def _smoothed_sigmoid(logits: Tensor, label_smoothing: float) -> Tensor:
    """``-(1 - ε) log σ(z) - ε log σ(-z)``."""
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def _per_token(inputs: PairInputs, chosen: Tensor, rejected: Tensor) -> tuple[Tensor, Tensor]:
    """``chosen / |y_w|``, ``rejected / |y_l|``: a length-normalised loss's scores."""
    if inputs.chosen_lengths is None or inputs.rejected_lengths is None:
        raise ValueError("this loss is length-normalised: pass chosen_lengths, rejected_lengths")
    return chosen / inputs.chosen_lengths, rejected / inputs.rejected_lengths


@register_preference_loss("sigmoid", settings=SmoothedF)
def sigmoid_loss(inputs: PairInputs, settings: SmoothedF) -> Tensor:
    """DPO (Rafailov et al., arXiv 2305.18290): ``-(1 - ε) log σ(β h) - ε log σ(-β h)``

    ε = ``label_smoothing`` is conservative DPO (cDPO: the labels flipped with probability ε);
    ε = 0 is plain DPO, TRL's ``sigmoid``. At π = π_ref, h = 0 and the loss is ln 2.
    """
    h = _scores_margin(inputs, settings)
    return _smoothed_sigmoid(settings.beta * h, settings.label_smoothing)


@register_preference_loss("ipo", settings=FDivergence)
def ipo_loss(inputs: PairInputs, settings: FDivergence) -> Tensor:
    """IPO (Azar et al., arXiv 2310.12036): ``(h - 1/(2β))²``

    Eq. 17, β is the paper's τ: a squared loss that pulls h to a finite target instead of
    pushing it to infinity. Log-probs are summed over tokens as in the paper; TRL averages them
    per token for IPO (``sigmoid_norm`` is that normalisation for DPO), another objective.
    """
    return (_scores_margin(inputs, settings) - 1 / (2 * settings.beta)) ** 2


@register_preference_loss("hinge", settings=FDivergence)
def hinge_loss(inputs: PairInputs, settings: FDivergence) -> Tensor:
    """SLiC (Zhao et al., arXiv 2305.10425): ``max(0, 1 - β h)``

    The calibration hinge loss on the log-ratio margin, as TRL's ``hinge`` (1/β is the margin).
    """
    return torch.relu(1 - settings.beta * _scores_margin(inputs, settings))


@register_preference_loss("robust", settings=SmoothedF)
def robust_loss(inputs: PairInputs, settings: SmoothedF) -> Tensor:
    """Robust DPO (Chowdhury et al., arXiv 2403.00409):
    ``[-(1-ε) log σ(βh) + ε log σ(-βh)] / (1-2ε)``

    An unbiased loss under labels flipped with probability ε = ``label_smoothing`` < 1/2
    (with ε = 0 it is DPO).
    """
    z = settings.beta * _scores_margin(inputs, settings)
    eps = settings.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


@register_preference_loss("exo_pair", settings=SmoothedF, positive=("label_smoothing",))
def exo_pair_loss(inputs: PairInputs, settings: SmoothedF) -> Tensor:
    """EXO (Ji et al., arXiv 2402.00856): ``KL(q || p) = Σ_k q_k (log q_k - log p_k)``

    Eq. 16 with two responses: q = (σ(βh), σ(-βh)) the policy's distribution over the pair and
    p = (1 - ε, ε) the smoothed label, ε = ``label_smoothing`` > 0 (the paper suggests 1e-3).
    """
    eps = settings.label_smoothing
    if eps <= 0:
        raise ValueError("exo_pair needs label_smoothing > 0 (the EXO paper uses 1e-3)")
    z = settings.beta * _scores_margin(inputs, settings)
    win = torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
    lose = torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps))
    return win + lose


@register_preference_loss("nca_pair", settings=Beta)
def nca_pair_loss(inputs: PairInputs, settings: Beta) -> Tensor:
    """NCA (Chen et al., arXiv 2402.05369): ``-log σ(βρ_w) - ½ log σ(-βρ_w) - ½ log σ(-βρ_l)``

    Noise-contrastive alignment with two responses: each response's own reward βρ is pushed
    up (chosen) or down (rejected), not only their difference.
    """
    chosen, rejected = _log_ratios(inputs)
    rc, rr = settings.beta * chosen, settings.beta * rejected
    return -F.logsigmoid(rc) - 0.5 * F.logsigmoid(-rc) - 0.5 * F.logsigmoid(-rr)


@register_preference_loss("bco_pair", settings=Beta)
def bco_pair_loss(inputs: PairInputs, settings: Beta) -> Tensor:
    """BCO (Jung et al., arXiv 2404.04656): ``-log σ(βρ_w - δ) - log σ(-(βρ_l - δ))``, δ = 0

    Binary classification of each response's reward. The paper's δ is a running mean of the
    rewards (state kept across steps); TRL 1.16's ``bco_pair`` dropped it (δ = 0, no state)
    and treadle follows TRL 1.16, so the loss is a pure function of the batch.
    """
    chosen, rejected = _log_ratios(inputs)
    return -F.logsigmoid(settings.beta * chosen) - F.logsigmoid(-settings.beta * rejected)


@register_preference_loss("sppo_hard", settings=Beta)
def sppo_hard_loss(inputs: PairInputs, settings: Beta) -> Tensor:
    """SPPO (Wu et al., arXiv 2405.00675): ``(ρ_w - 1/(2β))² + (ρ_l + 1/(2β))²``

    Eq. 4.7 with hard win probabilities (1 for the chosen, 0 for the rejected), as TRL's
    ``sppo_hard``; the paper's soft probabilities come from a preference model.
    """
    chosen, rejected = _log_ratios(inputs)
    return (chosen - 0.5 / settings.beta) ** 2 + (rejected + 0.5 / settings.beta) ** 2


@register_preference_loss("aot", settings=Smoothing, batchwise=True)
def aot_loss(inputs: PairInputs, settings: Smoothing) -> Tensor:
    """AOT (Melnyk et al., arXiv 2406.05882): ``ℓ_ε(β (sort(π_w - π_l) - sort(ref_w - ref_l)))``

    Distributional alignment by optimal transport: the policy's and the reference's chosen -
    rejected log-prob gaps are each sorted over the (micro-)batch and matched by rank, then
    put through the smoothed sigmoid loss ℓ_ε of ``sigmoid``. Loss i belongs to the i-th
    smallest gap, not to pair i.
    """
    rc, rr = inputs.ref_chosen_logps, inputs.ref_rejected_logps
    if rc is None or rr is None:
        raise ValueError("aot compares the policy with a reference: pass its log-probs")
    gaps = inputs.policy_chosen_logps - inputs.policy_rejected_logps
    policy = torch.sort(gaps, dim=0).values
    ref = torch.sort(rc - rr, dim=0).values
    return _smoothed_sigmoid(settings.beta * (policy - ref), settings.label_smoothing)


@register_preference_loss("aot_unpaired", settings=Smoothing, batchwise=True)
def aot_unpaired_loss(inputs: PairInputs, settings: Smoothing) -> Tensor:
    """AOT unpaired (Melnyk et al., arXiv 2406.05882): ``ℓ_ε(β (sort(ρ_w) - sort(ρ_l)))``

    The chosen and the rejected log-ratios are sorted separately over the (micro-)batch and
    matched by rank, so the pairing of the data is not used.
    """
    chosen, rejected = _log_ratios(inputs)
    delta = torch.sort(chosen, dim=0).values - torch.sort(rejected, dim=0).values
    return _smoothed_sigmoid(settings.beta * delta, settings.label_smoothing)


@register_preference_loss("apo_zero", settings=Beta)
def apo_zero_loss(inputs: PairInputs, settings: Beta) -> Tensor:
    """APO-zero (D'Oosterlinck et al., arXiv 2408.06266): ``1 - σ(βρ_w) + σ(βρ_l)``

    Eq. 7: for chosen answers better than the model's own, raise their likelihood and lower the
    rejected ones'.
    """
    chosen, rejected = _log_ratios(inputs)
    return 1 - torch.sigmoid(settings.beta * chosen) + torch.sigmoid(settings.beta * rejected)


@register_preference_loss("apo_down", settings=Beta)
def apo_down_loss(inputs: PairInputs, settings: Beta) -> Tensor:
    """APO-down (D'Oosterlinck et al., arXiv 2408.06266): ``σ(βρ_w) + 1 - σ(β(ρ_w - ρ_l))``

    Eq. 8: for chosen answers worse than the model's own, lower both likelihoods, the
    rejected one's more.
    """
    chosen, rejected = _log_ratios(inputs)
    beta = settings.beta
    return torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(beta * (chosen - rejected))


@dataclass(frozen=True)
class DiscoPOPSettings(FDivergence):
    """β, the f-divergence and DiscoPOP's temperature τ (``dpo.discopop_tau``)."""

    discopop_tau: float = 0.05


@register_preference_loss("discopop", settings=DiscoPOPSettings)
def discopop_loss(inputs: PairInputs, settings: DiscoPOPSettings) -> Tensor:
    """DiscoPOP (Lu et al., arXiv 2406.08414): ``(1 - σ(βh/τ)) (-log σ(βh)) + σ(βh/τ) e^{-βh}``

    Eq. 5, the discovered log-ratio modulated loss: a blend of the logistic and the
    exponential loss, weighted by σ(βh/τ) with τ = ``discopop_tau`` (0.05 in the paper).
    """
    z = settings.beta * _scores_margin(inputs, settings)
    mix = torch.sigmoid(z / settings.discopop_tau)
    return (1 - mix) * -F.logsigmoid(z) + mix * torch.exp(-z)


@register_preference_loss("sigmoid_norm", settings=FDivergence)
def sigmoid_norm_loss(inputs: PairInputs, settings: FDivergence) -> Tensor:
    """Length-normalised DPO (LN-DPO, Meng et al., arXiv 2405.14734):
    ``-log σ(β (ρ_w/|y_w| - ρ_l/|y_l|))``

    DPO on per-token log-ratios (SimPO's ablation with a reference), TRL's ``sigmoid_norm``.
    """
    kind, alpha = settings.f_divergence, settings.f_alpha
    chosen, rejected = (f_divergence_scores(r, kind, alpha) for r in _log_ratios(inputs))
    chosen, rejected = _per_token(inputs, chosen, rejected)
    return -F.logsigmoid(settings.beta * (chosen - rejected))


@dataclass(frozen=True)
class SimPOSettings(Smoothing):
    """β, the label smoothing ε and SimPO's target margin γ (``dpo.simpo_gamma``)."""

    simpo_gamma: float = 0.5


@register_preference_loss("simpo", settings=SimPOSettings, reference=False)
def simpo_loss(inputs: PairInputs, settings: SimPOSettings) -> Tensor:
    """SimPO (Meng et al., arXiv 2405.14734):
    ``-log σ(β (log π(y_w)/|y_w| - log π(y_l)/|y_l|) - γ)``

    Reference-free: the reward is the policy's average token log-prob, with a target margin
    γ = ``simpo_gamma``; ``label_smoothing`` ε smooths it as cDPO does (TRL's CPO trainer
    with ``loss_type=simpo``). The reference log-probs are ignored. TRL's CPO trainer also adds
    the chosen NLL by default (``cpo_alpha=1``); here that is ``dpo.nll_coef`` (0 by default,
    as in the paper).
    """
    chosen, rejected = _per_token(inputs, inputs.policy_chosen_logps, inputs.policy_rejected_logps)
    logits = settings.beta * (chosen - rejected) - settings.simpo_gamma
    return _smoothed_sigmoid(logits, settings.label_smoothing)


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - e^x)`` for x < 0, accurate on both sides of -ln 2 (Mächler 2012)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@register_preference_loss("orpo", settings=Beta, reference=False, nll=1.0)
def orpo_loss(inputs: PairInputs, settings: Beta) -> Tensor:
    """ORPO (Hong et al., arXiv 2403.07691):
    ``-λ log σ(log odds(y_w) - log odds(y_l))``, odds(y) = p / (1 - p)

    Eqs. 4-7 with p = exp(log π(y|x)/|y|), the per-token average probability, and λ = β.
    Reference-free; the registration's ``nll=1.0`` makes the driver add the chosen responses'
    token-mean NLL (the paper's L_SFT), so the whole loss is L_SFT + λ L_OR as in the paper
    and TRL's ORPO trainer.
    """
    chosen, rejected = _per_token(inputs, inputs.policy_chosen_logps, inputs.policy_rejected_logps)
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return -settings.beta * F.logsigmoid(log_odds)


# ----------------------------------------------------------------------------- unpaired


def kto_kl(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """KTO's reference point z0: ``max(0, mean(log π(y'|x) - log π_ref(y'|x)))``, detached.

    Over mismatched pairs (x, y') of the batch (each prompt with another example's
    completion), a biased estimate of KL(π || π_ref) that no gradient flows through.
    """
    return (policy_kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


@dataclass(frozen=True)
class KTOSettings(Beta):
    """β and the weights λ_D, λ_U of desirable and undesirable examples
    (``kto.desirable_weight``, ``kto.undesirable_weight``)."""

    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


@register_unpaired_loss("kto", kl=True, settings=KTOSettings)
def kto_loss(inputs: UnpairedInputs, settings: KTOSettings) -> Tensor:
    """KTO (Ethayarajh et al., arXiv 2402.01306):
    ``λ_D (1 - σ(β(ρ - z0)))`` if desirable, else ``λ_U (1 - σ(β(z0 - ρ)))``

    Eq. 7 per example: ρ = log π(y|x) - log π_ref(y|x), z0 = :func:`kto_kl` of the batch,
    λ_D / λ_U = ``desirable_weight`` / ``undesirable_weight``. The batch loss is the mean over
    examples (TRL's too), so with unbalanced labels the weights should make
    λ_D n_D / (λ_U n_U) lie in [1, 4/3], as the paper advises.
    """
    ratio, beta, kl = inputs.policy_logps - inputs.ref_logps, settings.beta, inputs.kl
    good = settings.desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    bad = settings.undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(inputs.labels.bool(), good, bad)


@register_unpaired_loss("apo_zero_unpaired", settings=KTOSettings)
def apo_zero_unpaired_loss(inputs: UnpairedInputs, settings: KTOSettings) -> Tensor:
    """APO-zero unpaired (D'Oosterlinck et al., arXiv 2408.06266):
    ``λ_D (1 - σ(βρ))`` if desirable, else ``λ_U σ(βρ)``

    Eq. 7 of APO on single examples (TRL's KTO ``loss_type=apo_zero_unpaired``): no reference
    point, so no mismatched KL pairs are scored (``kl`` is ignored).
    """
    ratio = inputs.policy_logps - inputs.ref_logps
    good = settings.desirable_weight * (1 - torch.sigmoid(settings.beta * ratio))
    bad = settings.undesirable_weight * torch.sigmoid(settings.beta * ratio)
    return torch.where(inputs.labels.bool(), good, bad)


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
