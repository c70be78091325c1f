"""Rollout-correction bypass: the rollout engine's policy as the old policy.

``bypass_mode`` is registered with ``old="rollout_log_probs"``: the actor passes the rollout
engine's log-probs as ``old_log_probs``, so no separate old-policy pass runs. Its loss is
PPO-clip on ``π_θ/π_rollout`` or REINFORCE with truncated importance weights
(:func:`bypass_is_weights`, per token or per sequence). Choices: verl's defaults apart from the
weights' level (token, where verl's is sequence); ``algorithm.rollout_correction`` cannot be
combined with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from treadle.algorithms.inputs import PolicyLossInputs
from treadle.algorithms.losses.base import Result, loss_result, weighted_aggregate
from treadle.algorithms.losses.clipped import PPOSettings, ppo
from treadle.algorithms.registry import register_policy_loss


def bypass_is_weights(
    log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, level: str, cap: float
) -> Tensor | None:
    """Truncated importance weights ``min(π_θ/π_rollout, cap)`` (constants), per token
    (``token``) or one per sequence, the product of its tokens' ratios (``sequence``); None
    for ``none``. Log-ratios (summed, for ``sequence``) are clamped to ±20 before ``exp``."""
    if level == "none":
        return None
    valid = mask.bool()
    log_ratio = torch.where(valid, log_probs.detach() - rollout_log_probs.detach(), 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"bypass_is {level!r}: valid are none, token, sequence")
    weights = torch.exp(log_ratio.clamp(-20.0, 20.0)).clamp(max=cap)
    return torch.where(valid, weights, 0.0)


@dataclass(frozen=True)
class BypassSettings(PPOSettings):
    """The bypass loss (``ppo_clip`` or ``reinforce``), PPO's clip (dual clip at 3 by default)
    and REINFORCE's importance weights (level, cap)."""

    clip_ratio_c: float | None = 3.0
    bypass_loss_type: str = "ppo_clip"
    bypass_is: str = "token"
    bypass_is_cap: float = 2.0


# the actor passes the rollout engine's log-probs as the old policy (its "old" fact)
@register_policy_loss(
    "bypass_mode", old="rollout_log_probs", settings=BypassSettings, advantage_scaled=True
)
def bypass_mode(inputs: PolicyLossInputs, settings: BypassSettings) -> Result:
    """Rollout-correction bypass (Liu, Li et al., https://richardli.xyz/rl-collapse; verl):
    PPO-clip (or REINFORCE) with ``r = π_θ / π_rollout``: the rollout policy is the old policy.

    ``old_log_probs`` are the *rollout engine's* log-probs (the actor passes them): no
    separate old-policy pass, two policies instead of three. ``bypass_loss_type``:

    - ``ppo_clip``: PPO-clip (dual clip with ``clip_ratio_c``) on ``r = π_θ/π_rollout``; the
      clipped ratio already is the importance correction, so no extra weights;
    - ``reinforce``: ``L = -w·A·log π`` with ``w = min(π_θ/π_rollout, cap)`` detached,
      per token or per sequence (``bypass_is``: token, sequence, none; cap
      ``bypass_is_cap``), verl's defaults apart from the level (verl: sequence).

    verl's rejection sampling (``rollout_rs``), IcePop bounds and batch-normalised weights
    are not implemented; ``algorithm.rollout_correction`` (tis, mis) cannot be combined with it.
    """
    if settings.bypass_loss_type == "ppo_clip":
        clip = PPOSettings(settings.clip_ratio_low, settings.clip_ratio_high, settings.clip_ratio_c)
        return ppo(dataclasses.replace(inputs, rollout_is_weights=None), clip)
    if settings.bypass_loss_type == "reinforce":
        mask = inputs.response_mask
        weights = bypass_is_weights(
            inputs.log_probs, inputs.old_log_probs, mask, settings.bypass_is, settings.bypass_is_cap
        )
        weighted = dataclasses.replace(inputs, rollout_is_weights=weights)
        logp, old, adv = inputs.valid_only()
        return loss_result(
            weighted_aggregate(-adv * logp, weighted), inputs, old - logp, pg_clipfrac=0.0
        )
    raise ValueError(
        f"algorithm.bypass_loss_type={settings.bypass_loss_type!r}: valid are ppo_clip, reinforce"
    )
