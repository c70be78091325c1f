"""Distillation losses: what a student learns from a frozen teacher (``DISTILL_LOSSES``).

``distill.loss`` names one; its registration says what the teacher must supply
(``needs``) and which ``distill`` settings it reads (its settings class: ``knobs``):

- ``reverse_kl`` (on-policy distillation): the student samples, the teacher scores the sampled
  tokens (``needs=("teacher_log_probs",)``), and :func:`reverse_kl_advantages` turns the
  per-token log-ratio into advantages for ``algorithm.policy_loss``. Reads ``coef`` and
  ``task_reward`` (whether the task reward's advantages are added: the driver's business).
- ``gkd`` (generalized knowledge distillation): the student samples a fraction ``lmbda`` of the
  sequences, the dataset holds the rest; the teacher gives its top-k ids and their log-probs at
  every position (``needs=("teacher_topk",)``); the student's logits at those ids
  (:class:`~treadle.engines.heads.LogProbRequest` ``topk_ids``) and the teacher's go into
  :func:`generalized_jsd`, one value a position, token-mean over the sequences' response
  tokens. Reads ``beta``, ``lmbda``, ``temperature``, ``top_k``.
- ``seq_kd`` (sequence-level KD): the teacher generates (``needs=("teacher_samples",)``) and the
  student is trained with the SFT objective on those samples: next-token NLL, token-mean
  (``nll=1.0``). :func:`seq_kd` is that per-token loss; the driver runs the SFT objective.

The functions are pure, over tensors, and know nothing of config objects. Their signatures
differ (one per kind of teacher signal), so the registry's type is ``Callable[..., Tensor]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from treadle.algorithms.inputs import NoSettings
from treadle.algorithms.registry import register_distill_loss


@dataclass(frozen=True)
class ReverseKLSettings:
    """``distill.coef``: the weight of the teacher's per-token advantage; ``distill.task_reward``:
    add the task reward's advantages to it (read by the driver)."""

    coef: float = 1.0
    task_reward: bool = False


@dataclass(frozen=True)
class GKDSettings:
    """GKD's ``distill`` knobs: the JSD's ``beta`` and ``temperature`` (:func:`generalized_jsd`),
    ``lmbda`` (the fraction of sequences the student generates) and ``top_k`` (the teacher's
    ids the divergence is taken over); the last two are read by the driver."""

    beta: float = 0.5
    lmbda: float = 0.5
    temperature: float = 1.0
    top_k: int = 20


@register_distill_loss("reverse_kl", settings=ReverseKLSettings, needs=("teacher_log_probs",))
def reverse_kl_advantages(
    student_log_probs: Tensor, teacher_log_probs: Tensor, mask: Tensor, coef: float
) -> Tensor:
    """On-policy distillation (Lu & Thinking Machines Lab 2025,
    https://thinkingmachines.ai/blog/on-policy-distillation): ``A_t = -coef (log π(y_t) -
    log π_teacher(y_t))`` on the student's own samples y.

    ``[B, R]`` in and out: the student's and the teacher's log-probs of the sampled tokens;
    0 where ``mask`` is 0 (padding holding ``-inf`` gives no ``nan``). The advantage is the
    negative per-token reverse KL estimate ``log π - log π_teacher``: a policy-gradient step on
    it lowers KL(π ‖ π_teacher) (mode-seeking). Returned as it is computed: pass log-probs taken
    without gradients, so the advantages are constants of the policy loss.

    As tinker-cookbook's ``incorporate_kl_penalty``
    (``tinker_cookbook/distillation/train_on_policy.py``: ``reverse_kl = (sampled_logprobs -
    teacher_logprobs[1:]) * mask``; ``kl_advantages = -kl_penalty_coef * mask * reverse_kl``,
    added to the task advantages; its ``kl_discount_factor`` is not implemented) and slime's
    ``apply_opd_kl_to_advantages`` (``slime/backends/megatron_utils/loss.py``:
    ``advantages - opd_kl_coef * (student_log_probs - teacher_log_probs)``, unmasked). tinker
    uses the sampler's log-probs, slime the trainer's (or the rollout's with
    ``--use-rollout-logprobs``): the caller chooses which student log-probs to pass.
    """
    valid = mask.bool()
    log_ratio = student_log_probs - teacher_log_probs
    return coef * -torch.where(valid, log_ratio, torch.zeros_like(log_ratio))


@register_distill_loss("gkd", settings=GKDSettings, needs=("teacher_topk",))
def generalized_jsd(
    student_logits: Tensor, teacher_logits: Tensor, beta: float, temperature: float = 1.0
) -> Tensor:
    """GKD (Agarwal et al., arXiv 2306.13649): ``β KL(p_T ‖ m) + (1-β) KL(p_S ‖ m)``,
    ``m = β p_T + (1-β) p_S``; β = 0: ``KL(p_T ‖ p_S)``, β = 1: ``KL(p_S ‖ p_T)``.

    ``[N, K]`` in (one row a position), ``[N]`` out: the divergence of each position, summed
    over the K axis, for the caller to aggregate with its mask (token-mean: the masked mean of
    these is TRL's ``reduction="batchmean"`` with ``-100`` labels). ``p_S`` and ``p_T`` are
    ``softmax(x / temperature)`` over the K axis of each input, which may be logits or
    log-probs: restricted to the teacher's top-k ids, both are renormalised over those ids
    (K = V: the full distributions). Rows must be finite.

    Computed as TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` computes it (the same
    operations: ``F.kl_div`` with ``log_target``, the mixture by ``logsumexp`` with
    ``log β`` and ``log1p(-β)``, the exact β = 0 and β = 1 cases), minus the reduction.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    student = F.log_softmax(student_logits / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student, teacher, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher, student, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student.dtype, device=student.device)
        mixture = torch.logsumexp(
            torch.stack([student + torch.log1p(-b), teacher + torch.log(b)]), dim=0
        )
        kl_teacher = F.kl_div(mixture, teacher, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture, student, reduction="none", log_target=True)
        jsd = b * kl_teacher + (1 - b) * kl_student
    return jsd.sum(-1)


@register_distill_loss("seq_kd", settings=NoSettings, needs=("teacher_samples",), nll=1.0)
def seq_kd(log_probs: Tensor) -> Tensor:
    """Sequence-level KD (Kim & Rush, arXiv 1606.07947): ``-log π(y_t | x, y_<t)`` of the
    teacher's samples y, token-mean: the SFT loss.

    The driver trains ``seq_kd`` with the SFT objective on the teacher's samples
    (``treadle.workers.objectives.SFT``, which computes this per-token loss itself); this
    function names that loss in the registry and its reference, with nothing of its own.
    """
    return -log_probs
