"""The critic's clipped value loss and the entropy of a softmax (the actor's entropy bonus).

Neither is registered: the critic and the actor call them by name. Choices: the value loss
clips the prediction itself (not ``V_old + clip(V - V_old)``) and is aggregated like a policy
loss (:func:`~treadle.algorithms.losses.aggregation.aggregate`); the entropy is computed from
shifted logits, never from the log of a softmax that underflowed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treadle.algorithms.inputs import Aggregation
from treadle.algorithms.losses.aggregation import aggregate
from treadle.algorithms.losses.base import token_fraction


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    cliprange_value: float,
    agg: Aggregation | None = None,
) -> tuple[Tensor, float]:
    """Clipped value loss: ``½ agg(max((V - R)², (clip(V, V_old - c, V_old + c) - R)²))``.

    ``agg``: the aggregation (mode and mini-batch counts; ``token-mean`` over this call's
    tokens if not given).

    Returns the loss and the fraction of valid tokens where the clipped term was strictly
    larger. The prediction itself is clipped (not ``V_old + clip(V - V_old)``, which differs
    from ``V`` by round-off inside the range and would count ties as clipped); at a bound the
    gradient is shared as ``torch.minimum``/``maximum`` share ties, as in verl.
    """
    valid = mask.bool()
    values, old_values, returns = (
        torch.where(valid, x, torch.zeros_like(x)) for x in (values, old_values, returns)
    )
    clipped_values = torch.maximum(
        torch.minimum(values, old_values + cliprange_value), old_values - cliprange_value
    )
    unclipped_loss = (values - returns).square()
    clipped_loss = (clipped_values - returns).square()
    losses = torch.maximum(unclipped_loss, clipped_loss)
    loss = 0.5 * aggregate(losses, mask, agg or Aggregation())
    return loss, token_fraction(clipped_loss > unclipped_loss, mask)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(z)`` over the last dim: ``logsumexp(z) - Σ softmax(z)·z``.

    No ``log`` of a softmax that underflowed to 0. Both terms are computed on ``z - max z``
    (the entropy is shift-invariant), so large logits do not cancel catastrophically in float32.
    Logits must be finite (``-inf`` vocabulary masking would give ``0·inf``).
    """
    shifted = logits - logits.detach().amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted, dim=-1)
    return torch.logsumexp(shifted, dim=-1) - (probs * shifted).sum(dim=-1)
