"""What every policy loss is made of: the clamped log-ratio, the weighted aggregation and the
``(loss, metrics)`` result.

Every policy loss has one signature, ``fn(inputs: PolicyLossInputs, settings) -> Result``
(:data:`Result`: the loss and its metrics), and builds it from these parts. Choices:

- Positions where the mask is 0 are replaced by 0 before any arithmetic
  (``inputs.valid_only()``), so padding holding ``-inf`` log-probs cannot produce ``nan`` in
  the loss or its gradient.
- Log importance ratios are clamped to [-20, 20] before ``exp`` (:func:`clamped_log_ratio`).
- ``rollout_is_weights`` (truncated importance weights correcting for a rollout engine whose
  log-probs differ from the trainer's) multiply the per-token loss as constants
  (:func:`weighted_aggregate`).
- Metrics are Python floats: ``pg_clipfrac`` (fraction of valid tokens whose ratio was clipped)
  and ``ppo_kl`` (masked mean of ``old - new`` log-prob) at least (:func:`loss_result`).
"""

from __future__ import annotations

from torch import Tensor

from treadle.algorithms.inputs import PolicyLossInputs
from treadle.algorithms.losses.aggregation import aggregate
from treadle.algorithms.utils import masked_mean

Result = tuple[Tensor, dict[str, float]]
"""What a policy loss returns: the loss and its metrics (Python floats)."""


def clamped_log_ratio(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    """``log π - log π_old``, clamped to [-20, 20] (its ``exp`` stays finite)."""
    return (log_probs - old_log_probs).clamp(-20.0, 20.0)


def token_fraction(flags: Tensor, mask: Tensor) -> float:
    """The fraction of the valid tokens whose flag is set."""
    return masked_mean(flags.float(), mask).item()


def weighted_aggregate(pg_losses: Tensor, inputs: PolicyLossInputs) -> Tensor:
    """The per-token losses times the rollout importance weights (constants), if any,
    aggregated as ``inputs.agg`` says."""
    if inputs.rollout_is_weights is not None:
        pg_losses = pg_losses * inputs.rollout_is_weights.detach()
    return aggregate(pg_losses, inputs.response_mask, inputs.agg)


def loss_result(
    loss: Tensor,
    inputs: PolicyLossInputs,
    kl: Tensor,
    *,
    pg_clipfrac: Tensor | float,
    pg_clipfrac_lower: Tensor | float | None = None,
    pg_cov_frac: Tensor | float | None = None,
) -> Result:
    """``(loss, metrics)``: the fractions given (flags over the tokens, or a number) in this
    order and ``ppo_kl``, the masked mean of ``kl`` (``log π_old - log π``). A loss names each
    metric it reports (a keyword it misspells is an error, not a new metric)."""
    mask = inputs.response_mask
    fractions = {
        "pg_clipfrac": pg_clipfrac,
        "pg_clipfrac_lower": pg_clipfrac_lower,
        "pg_cov_frac": pg_cov_frac,
    }
    metrics = {
        k: v if isinstance(v, float) else token_fraction(v, mask)
        for k, v in fractions.items()
        if v is not None
    }
    metrics["ppo_kl"] = masked_mean(kl.detach(), mask).item()
    return loss, metrics
