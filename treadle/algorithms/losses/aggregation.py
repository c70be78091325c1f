"""Loss aggregation: a per-token loss ``[B, T]`` to one number, in a mode registered by name.

A loss builds a per-token loss matrix and hands it to :func:`aggregate` (or
:func:`agg_loss`), which reduces it in the mode ``algorithm.loss_agg_mode`` names
(``LOSS_AGG_MODES``: token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean,
seq-mean-token-sum-norm). Choices:

- ``inputs.agg`` (an :class:`~treadle.algorithms.inputs.Aggregation`) carries ``num_tokens`` /
  ``num_seqs`` of the whole mini-batch (all micro-batches and data-parallel ranks) divided by
  ``dp_size``, ``dp_size`` itself and ``norm_constant``, so that the micro-batch losses add up
  to the mini-batch loss. ``None`` counts are the call's own.
- A zero count is taken as 1 (the total is then 0 anyway): an all-padding micro-batch gives 0,
  not ``nan``.
- The aggregation ``seq-mean-token-sum-norm`` registers its ``loss_scale_factor`` as a knob.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treadle.algorithms.inputs import Aggregation, Count
from treadle.algorithms.registry import LOSS_AGG_MODES, register_loss_agg_mode
from treadle.algorithms.utils import masked_count, masked_sum


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
    norm_constant: float | None = None,
    dp_size: int = 1,
) -> Tensor:
    """Reduce a per-token loss ``[B,T]`` to a scalar with the aggregation ``mode``.

    ``num_tokens`` defaults to the number of valid tokens, ``num_seqs`` to the number of rows
    with at least one valid token. Pass the totals of the whole mini-batch divided by
    ``dp_size`` (the data-parallel ranks) instead and the aggregated losses of its
    micro-batches sum to the aggregated loss of the mini-batch, once the ranks' gradients are
    averaged. verl's ``agg_loss(..., dp_size, batch_num_tokens, global_batch_size,
    loss_scale_factor)`` is ``agg_loss(..., num_tokens=batch_num_tokens / dp_size,
    num_seqs=global_batch_size / dp_size, norm_constant=loss_scale_factor, dp_size=dp_size)``.
    """
    return aggregate(
        loss_mat, mask, Aggregation(mode, num_tokens, num_seqs, norm_constant, dp_size)
    )


def aggregate(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """:func:`agg_loss` with its mode and counts in one record."""
    return LOSS_AGG_MODES.get(agg.mode)(loss_mat, mask, agg)


def _divide(total: Tensor, count: Count) -> Tensor:
    """``total / count`` with a zero count treated as 1 (the total is then 0 anyway)."""
    return total / torch.as_tensor(count, dtype=total.dtype, device=total.device).clamp(min=1)


def _seq_count(mask: Tensor, num_seqs: Count) -> Count:
    return (masked_count(mask, dim=-1) > 0).sum() if num_seqs is None else num_seqs


@register_loss_agg_mode("token-mean")
def token_mean(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """token-mean (DAPO, arXiv 2503.14476): ``Σ_{i,t} m·L / num_tokens``, every valid token weighs
    the same."""
    count = masked_count(mask) if agg.num_tokens is None else agg.num_tokens
    return _divide(masked_sum(loss_mat, mask), count)


@register_loss_agg_mode("token-sum")
def token_sum(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """token-sum (verl): ``Σ_{i,t} m·L``, the plain sum over the mini-batch's valid tokens.

    Each rank's sum is multiplied by ``dp_size`` so that the average of the ranks' gradients
    is the gradient of the whole sum. The loss then grows with the batch: scale the learning
    rate to match.
    """
    return masked_sum(loss_mat, mask) * agg.dp_size


@register_loss_agg_mode("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """seq-mean-token-sum (verl): ``Σ_i (Σ_t m·L) / num_seqs``, per-sequence sum, averaged."""
    return _divide(masked_sum(loss_mat, mask), _seq_count(mask, agg.num_seqs))


@register_loss_agg_mode("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """seq-mean-token-mean (GRPO, arXiv 2402.03300): ``Σ_i (Σ_t m·L / Σ_t m) / num_seqs``."""
    seq_means = masked_sum(loss_mat, mask, dim=-1) / masked_count(mask, dim=-1).clamp(min=1)
    return _divide(seq_means.sum(), _seq_count(mask, agg.num_seqs))


@register_loss_agg_mode("seq-mean-token-sum-norm", knobs=("loss_scale_factor",))
def seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """seq-mean-token-sum-norm (Dr. GRPO, arXiv 2503.20783): ``Σ_i (Σ_t m·L / C) / num_seqs``,
    ``C`` a constant (default ``T``).

    Dividing by a constant instead of each sequence's length removes GRPO's length bias
    (arXiv 2503.20783).
    """
    constant = loss_mat.shape[-1] if agg.norm_constant is None else agg.norm_constant
    return _divide(masked_sum(loss_mat, mask) / constant, _seq_count(mask, agg.num_seqs))
