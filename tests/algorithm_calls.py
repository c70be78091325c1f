"""Keyword-style calls of the registered algorithm functions, for the tests.

Every registered function takes an inputs record and its own settings record
(:mod:`treadle.algorithms.inputs`). These helpers build both from keywords, so a test reads as
the call it makes: the inputs' names go into the inputs record, every other keyword into the
settings, where a name the function does not take is a ``TypeError``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

from treadle.algorithms import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    UNPAIRED_LOSSES,
    Aggregation,
    EstimatorInputs,
    PairInputs,
    PolicyLossInputs,
    UnpairedInputs,
)

ESTIMATOR_INPUTS = {f.name for f in dataclasses.fields(EstimatorInputs)}


def policy_loss(
    name: str,
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str | None = None,
    agg_kwargs: dict[str, Any] | None = None,
    rollout_is_weights: Tensor | None = None,
    generator: Any = None,
    **knobs: Any,
) -> tuple[Tensor, dict[str, float]]:
    """The policy loss ``name``; without ``loss_agg_mode``, the first mode it is registered
    for (``gspo``, ``geo_mean``: ``seq-mean-token-mean``), else ``token-mean``."""
    mode = loss_agg_mode or POLICY_LOSSES.info(name).get("agg_modes", ("token-mean",))[0]
    inputs = PolicyLossInputs(
        log_probs,
        old_log_probs,
        advantages,
        response_mask,
        Aggregation(mode, **(agg_kwargs or {})),
        rollout_is_weights=rollout_is_weights,
        generator=generator,
    )
    return POLICY_LOSSES.get(name)(inputs, POLICY_LOSSES.settings(name)(**knobs))


def estimate(name: str, rewards: Tensor, mask: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    """The advantage estimator ``name``: ``group_ids`` and the other inputs by name, the rest
    its settings."""
    inputs = {k: v for k, v in kw.items() if k in ESTIMATOR_INPUTS}
    settings = {k: v for k, v in kw.items() if k not in ESTIMATOR_INPUTS}
    return ADV_ESTIMATORS.get(name)(
        EstimatorInputs(rewards, mask, **inputs), ADV_ESTIMATORS.settings(name)(**settings)
    )


def pair_loss(
    name: str,
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor | None,
    ref_rejected: Tensor | None,
    *,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    **settings: Any,
) -> Tensor:
    """The preference loss ``name``; ``settings``: ``beta`` and its knobs."""
    inputs = PairInputs(
        policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_lengths, rejected_lengths
    )
    return PREFERENCE_LOSSES.get(name)(inputs, PREFERENCE_LOSSES.settings(name)(**settings))


def unpaired_loss(
    name: str, policy: Tensor, ref: Tensor, labels: Tensor, kl: Tensor | float, **settings: Any
) -> Tensor:
    """The unpaired loss ``name``; ``settings``: ``beta`` and its knobs."""
    inputs = UnpairedInputs(policy, ref, labels, kl)
    return UNPAIRED_LOSSES.get(name)(inputs, UNPAIRED_LOSSES.settings(name)(**settings))
