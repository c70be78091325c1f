"""RL algorithms as small pure functions over tensors, each registered by name.

- ``advantages``: advantage estimators (``ADV_ESTIMATORS``: grpo, rloo, gae, ...)
- ``losses``: policy losses (``POLICY_LOSSES``), loss aggregation (``LOSS_AGG_MODES``),
  value loss, entropy
- ``kl``: KL estimators (``KL_ESTIMATORS``) and KL-coefficient controllers
- ``preference``: losses on chosen/rejected pairs: the DPO family, ORPO and SimPO
  (``PREFERENCE_LOSSES``: sigmoid, ipo, hinge, ...), on unpaired good/bad examples (KTO,
  ``UNPAIRED_LOSSES``) and the Bradley-Terry reward-model loss
- ``distill``: what a student learns from a frozen teacher (``DISTILL_LOSSES``: reverse_kl,
  gkd, seq_kd): on-policy distillation's advantages, the generalized JSD, the NLL
- ``prime``: PRIME's implicit process rewards, its PRM losses and the ``prime`` estimator
- ``utils``: masked statistics
- ``inputs``: the records the functions take (``PolicyLossInputs``, ``EstimatorInputs``,
  ``PairInputs``, ``UnpairedInputs``, ``Aggregation``); each function's own settings class
  lives beside it
- ``registry``: the ``Registry`` class and the ``register_*`` decorators

Nothing here knows about Ray, models or config objects. ``ADV_ESTIMATORS.get("grpo")`` works
after ``import treadle.algorithms``: the registry's names are imported with the package (its
module needs only the standard library), the others on first use, and a registry imports the
modules that register its built-in functions when it is first asked for one (``registry``), so
importing the package, or asking a registry which names it has, does not import torch (config
validation and ``treadle check`` do only that).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from treadle.algorithms.registry import (
    ADV_ESTIMATORS,
    DISTILL_LOSSES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    UNPAIRED_LOSSES,
    Registry,
    register_adv_estimator,
    register_distill_loss,
    register_kl_estimator,
    register_loss_agg_mode,
    register_policy_loss,
    register_preference_loss,
    register_unpaired_loss,
)

if TYPE_CHECKING:
    from treadle.algorithms import advantages, distill, inputs, kl, losses, preference, prime, utils
    from treadle.algorithms.distill import generalized_jsd, reverse_kl_advantages
    from treadle.algorithms.inputs import (
        Aggregation,
        EstimatorInputs,
        NoSettings,
        PairInputs,
        PolicyLossInputs,
        UnpairedInputs,
    )
    from treadle.algorithms.kl import AdaptiveKLController, FixedKLController, kl_penalty
    from treadle.algorithms.losses import agg_loss, entropy_from_logits, value_loss
    from treadle.algorithms.preference import (
        bradley_terry_loss,
        implicit_rewards,
        kto_kl,
        length_rewards,
        pair_stats,
    )
    from treadle.algorithms.utils import masked_mean, masked_sum, masked_var, masked_whiten

# public name -> the module that defines it (imported on first use)
_LAZY = {
    **dict.fromkeys(["generalized_jsd", "reverse_kl_advantages"], "distill"),
    **dict.fromkeys(
        [
            "Aggregation",
            "EstimatorInputs",
            "NoSettings",
            "PairInputs",
            "PolicyLossInputs",
            "UnpairedInputs",
        ],
        "inputs",
    ),
    **dict.fromkeys(["AdaptiveKLController", "FixedKLController", "kl_penalty"], "kl"),
    **dict.fromkeys(["agg_loss", "entropy_from_logits", "value_loss"], "losses"),
    **dict.fromkeys(
        ["bradley_terry_loss", "implicit_rewards", "kto_kl", "length_rewards", "pair_stats"],
        "preference",
    ),
    **dict.fromkeys(["masked_mean", "masked_sum", "masked_var", "masked_whiten"], "utils"),
}
_SUBMODULES = ("advantages", "distill", "inputs", "kl", "losses", "preference", "prime", "utils")

__all__ = [
    "ADV_ESTIMATORS",
    "DISTILL_LOSSES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "UNPAIRED_LOSSES",
    "AdaptiveKLController",
    "Aggregation",
    "EstimatorInputs",
    "FixedKLController",
    "NoSettings",
    "PairInputs",
    "PolicyLossInputs",
    "Registry",
    "UnpairedInputs",
    "advantages",
    "agg_loss",
    "bradley_terry_loss",
    "distill",
    "entropy_from_logits",
    "generalized_jsd",
    "implicit_rewards",
    "inputs",
    "kl",
    "kl_penalty",
    "kto_kl",
    "length_rewards",
    "losses",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pair_stats",
    "preference",
    "prime",
    "register_adv_estimator",
    "register_distill_loss",
    "register_kl_estimator",
    "register_loss_agg_mode",
    "register_policy_loss",
    "register_preference_loss",
    "register_unpaired_loss",
    "reverse_kl_advantages",
    "utils",
    "value_loss",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
