"""Actor and critic losses: policy-gradient objectives, loss aggregation, value loss, entropy.

Every policy loss has one signature, so the actor picks one by name from ``POLICY_LOSSES``::

    fn(inputs: PolicyLossInputs, settings) -> (loss, metrics)

``inputs`` (:class:`~treadle.algorithms.inputs.PolicyLossInputs`) holds the tensors and the
aggregation; ``settings`` is the loss's own frozen dataclass, registered with it
(``settings=PPOSettings``), whose fields are the ``algorithm`` settings it reads
(``clip_ratio_low``, ``sapo_tau_pos``, ``dro_beta``...; ``POLICY_LOSSES.knobs(name)``). The
actor builds it from exactly those, so a knob a loss does not read never reaches it, and
``treadle check`` refuses a knob changed from its default that the chosen loss does not read.
A loss registered with ``old="rollout_log_probs"`` (``bypass_mode``) gets the rollout engine's
log-probs as ``old_log_probs``. verl's names resolve too (``vanilla`` is ``ppo``), and
``tests/algorithms/test_losses_parity.py`` holds every loss to verl 0.9.1's.

All tensors are ``[B, T]`` on the response side. A loss builds a per-token loss matrix and hands
it to the aggregation, which turns it into a scalar in one of the registered modes. A loss
registered ``advantage_scaled=True`` is, row by row, the row's advantages times something
finite that reads no other row: a row of zero advantages has zero loss and zero gradient, and
the actor leaves it out of the update (``actor.skip_zero_advantage``). The covariance losses
(``clip_cov``, ``kl_cov``: batch statistics) and ``dro`` (a regulariser apart from the
advantage) are not.

The modules, each importing only those above it:

- :mod:`.aggregation`: ``LOSS_AGG_MODES`` and :func:`agg_loss` / :func:`aggregate`;
- :mod:`.base`: what every policy loss is made of (the clamped log-ratio, the weighted
  aggregation, the ``(loss, metrics)`` result) and its choices;
- :mod:`.clipped`: PPO (``vanilla``), GSPO, CISPO, GMPO (``geo_mean``);
- :mod:`.unclipped`: GPG, SAPO, DRO;
- :mod:`.covariance`: Clip-Cov, KL-Cov;
- :mod:`.trust_region`: DPPO (``dppo_tv``, ``dppo_kl``);
- :mod:`.bypass`: ``bypass_mode`` and its importance weights;
- :mod:`.value`: the critic's value loss and the entropy.

Importing this package registers every one of them; their names are handed on here, where
they were when this was one module.
"""

from __future__ import annotations

from treadle.algorithms.losses.aggregation import (
    agg_loss,
    aggregate,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
    token_sum,
)
from treadle.algorithms.losses.base import Result
from treadle.algorithms.losses.bypass import BypassSettings, bypass_is_weights, bypass_mode
from treadle.algorithms.losses.clipped import (
    CISPOSettings,
    Clip,
    GSPOSettings,
    PPOSettings,
    cispo,
    geo_mean,
    gspo,
    ppo,
)
from treadle.algorithms.losses.covariance import ClipCovSettings, KLCovSettings, clip_cov, kl_cov
from treadle.algorithms.losses.trust_region import DPPOSettings, dppo_kl, dppo_tv
from treadle.algorithms.losses.unclipped import DROSettings, SAPOSettings, dro, gpg, sapo
from treadle.algorithms.losses.value import entropy_from_logits, value_loss

__all__ = [
    "BypassSettings",
    "CISPOSettings",
    "Clip",
    "ClipCovSettings",
    "DPPOSettings",
    "DROSettings",
    "GSPOSettings",
    "KLCovSettings",
    "PPOSettings",
    "Result",
    "SAPOSettings",
    "agg_loss",
    "aggregate",
    "bypass_is_weights",
    "bypass_mode",
    "cispo",
    "clip_cov",
    "dppo_kl",
    "dppo_tv",
    "dro",
    "entropy_from_logits",
    "geo_mean",
    "gpg",
    "gspo",
    "kl_cov",
    "ppo",
    "sapo",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_mean",
    "token_sum",
    "value_loss",
]
