"""The typed records the algorithm functions take, one inputs record per kind of function.

Every registered function of a kind has the same two parameters:

- a policy loss ``fn(inputs: PolicyLossInputs, settings) -> (loss, metrics)``;
- an advantage estimator ``fn(inputs: EstimatorInputs, settings) -> (advantages, returns)``;
- a preference loss ``fn(inputs: PairInputs, settings) -> [B]``;
- an unpaired (KTO-style) loss ``fn(inputs: UnpairedInputs, settings) -> [B]``.

``inputs`` are the tensors of one call; ``settings`` the function's own knobs, a frozen
dataclass registered with it (``@register_policy_loss("ppo", settings=PPOSettings)``, defaults
in its fields; :class:`NoSettings` when it has none). Both are frozen dataclasses: a name that
is not a field is a ``TypeError`` where the record is built, so a misspelt or renamed input or
knob is an error, never silently ignored (as a ``**kwargs`` catch-all would).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

Count = float | Tensor | None


@dataclass(frozen=True)
class NoSettings:
    """The settings of a function that has no knobs."""


@dataclass(frozen=True)
class Aggregation:
    """How a per-token loss ``[B,T]`` becomes one number: a registered ``mode`` and the counts.

    ``num_tokens`` / ``num_seqs`` are the whole mini-batch's (all micro-batches and
    data-parallel ranks) divided by ``dp_size``, ``norm_constant`` the constant of
    ``seq-mean-token-sum-norm``, so that the micro-batch losses add up to the mini-batch loss;
    ``None`` counts are this call's own (see :func:`treadle.algorithms.losses.agg_loss`).
    """

    mode: str = "token-mean"
    num_tokens: Count = None
    num_seqs: Count = None
    norm_constant: float | None = None
    dp_size: int = 1


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a policy loss reads: response-side ``[B,T]`` tensors and how to aggregate.

    ``old_log_probs`` are the old policy's (the rollout engine's for a loss registered
    ``old="rollout_log_probs"``); ``rollout_is_weights`` truncated importance weights that
    multiply the per-token loss as constants (rollout correction); ``generator`` makes a loss
    that draws tokens at random (``clip_cov``) reproducible.
    """

    log_probs: Tensor
    old_log_probs: Tensor
    advantages: Tensor
    response_mask: Tensor
    agg: Aggregation = field(default_factory=Aggregation)
    rollout_is_weights: Tensor | None = None
    generator: torch.Generator | None = None

    def valid_only(self) -> tuple[Tensor, Tensor, Tensor]:
        """Log-probs, old log-probs and advantages with masked-out positions set to 0 (so
        padding holding ``-inf`` cannot make the loss or its gradient ``nan``)."""
        valid = self.response_mask.bool()
        return (
            torch.where(valid, self.log_probs, torch.zeros_like(self.log_probs)),
            torch.where(valid, self.old_log_probs, torch.zeros_like(self.old_log_probs)),
            torch.where(valid, self.advantages, torch.zeros_like(self.advantages)),
        )


@dataclass(frozen=True)
class EstimatorInputs:
    """What an advantage estimator reads: rewards ``[B,T]``, the mask, each sample's group
    (its prompt ``uid``), and the inputs its registration ``needs`` (None when not given).

    ``values`` [B,T]: a critic's (GAE); ``baseline_rewards`` [B]: the greedy response's score
    (ReMax); ``old_log_probs``, ``sum_pi_squared`` and, under rollout correction,
    ``rollout_is_weights`` [B,T] (optimal token baseline); ``reward_components`` [B,K]
    (GDPO); ``implicit_rewards`` [B,T]: the implicit PRM's token rewards (PRIME).
    ``sample_weights`` [B]: each sample's weight in its group's statistics (1 / the segments of
    its trajectory, :func:`~treadle.algorithms.utils.trajectory_weights`; None: 1 each).
    """

    token_level_rewards: Tensor
    response_mask: Tensor
    group_ids: Sequence[Hashable]
    values: Tensor | None = None
    baseline_rewards: Tensor | None = None
    old_log_probs: Tensor | None = None
    sum_pi_squared: Tensor | None = None
    rollout_is_weights: Tensor | None = None
    reward_components: Tensor | None = None
    implicit_rewards: Tensor | None = None
    sample_weights: Tensor | None = None


@dataclass(frozen=True)
class PairInputs:
    """Sequence log-probs ``[B]`` (summed over response tokens) of preference pairs.

    The reference's are ``None`` for a loss registered ``reference=False``; the lengths
    (response tokens, EOS included) are read by the length-normalised losses.
    """

    policy_chosen_logps: Tensor
    policy_rejected_logps: Tensor
    ref_chosen_logps: Tensor | None = None
    ref_rejected_logps: Tensor | None = None
    chosen_lengths: Tensor | None = None
    rejected_lengths: Tensor | None = None


@dataclass(frozen=True)
class UnpairedInputs:
    """One sequence log-prob per example under the policy and the reference ``[B]``, its label
    (1: desirable) and the batch's reference point ``kl`` (KTO's z0; 0 for a loss registered
    without ``kl=True``)."""

    policy_logps: Tensor
    ref_logps: Tensor
    labels: Tensor
    kl: Tensor | float = 0.0
