"""Losses on preference pairs: DPO and its variants, and the Bradley-Terry reward-model loss.

A pair is one prompt x with a chosen response y_w and a rejected one y_l. The DPO family
(``PREFERENCE_LOSSES``, chosen by ``dpo.loss_type``) take the sequence log-probs (summed over
the response tokens) of both responses under the policy π and the frozen reference π_ref, and
return one loss per pair. With the log-ratio difference

    h = [log π(y_w|x) - log π_ref(y_w|x)] - [log π(y_l|x) - log π_ref(y_l|x)]

- ``sigmoid`` (DPO, Rafailov et al., arXiv 2305.18290): ``-log σ(β h)``; with label smoothing
  ε (conservative DPO, the labels flipped with probability ε):
  ``-(1 - ε) log σ(β h) - ε log σ(-β h)``. At π = π_ref, h = 0 and the loss is ln 2.
- ``ipo`` (IPO, Azar et al., arXiv 2310.12036, eq. 17): ``(h - 1/(2β))²``, a squared loss that
  pulls h to a finite target instead of pushing it to infinity. Log-probs are summed over
  tokens as in the paper (TRL averages them per token for IPO; that is another objective).

``β (log π - log π_ref)`` is DPO's implicit reward of a response (:func:`implicit_rewards`);
its accuracy on pairs (chosen above rejected) and margin are the usual DPO metrics.

``bradley_terry_loss`` trains an explicit reward model r (Bradley & Terry 1952, as in
InstructGPT, arXiv 2203.02155): ``-log σ(r(x, y_w) - r(x, y_l))`` per pair.

All functions are pure, per pair (shape ``[B]`` in and out), so the caller can sum the losses
of micro-batches and divide by the number of pairs of the whole batch.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from treadle.algorithms.registry import register_preference_loss


def log_ratio_margin(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
) -> Tensor:
    """``h = (π_c - ref_c) - (π_r - ref_r)`` per pair, from sequence log-probs."""
    return (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)


def implicit_rewards(policy_logps: Tensor, ref_logps: Tensor, beta: float) -> Tensor:
    """DPO's implicit reward ``β (log π(y|x) - log π_ref(y|x))`` of each response."""
    return beta * (policy_logps - ref_logps)


@register_preference_loss("sigmoid")
def sigmoid_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> Tensor:
    """DPO: ``-(1 - ε) log σ(β h) - ε log σ(-β h)`` per pair (ε = 0: plain DPO)."""
    h = log_ratio_margin(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(
        -beta * h
    )


@register_preference_loss("ipo")
def ipo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> Tensor:
    """IPO: ``(h - 1/(2β))²`` per pair; β is the paper's τ. Label smoothing does not apply."""
    if label_smoothing:
        raise ValueError("ipo has no label smoothing: set it to 0")
    h = log_ratio_margin(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    return (h - 1 / (2 * beta)) ** 2


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
