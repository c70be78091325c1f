"""What a batch gives the update to learn from: the numbers behind the run report's "Is it
learning?" panel (docs/diagnostics.md).

Pure functions the RL driver applies once the advantages are computed:

- :func:`equal_reward_frac`: the share of groups (the samples of one prompt, by ``uid``) whose
  rewards are all equal. Under a group baseline (GRPO, RLOO, Dr. GRPO, ...) their advantages are
  exactly 0: nothing to learn from them (TRL's ``frac_reward_zero_std``).
- :func:`group_reward_std`: the reward's spread within a group, averaged over the groups.
- :func:`nonzero_advantage_frac`: the share of response tokens whose advantage is not 0.

Choices: only groups of two samples or more count (a group of one has no baseline: its advantage
is its score, and "its rewards are equal" says nothing), and both group functions return None
when there is none (``rollout.n=1``). Rewards are compared exactly (lowest == highest), never
through a computed spread, whose rounding is not 0 for equal scores like 0.1. The spread is the
unbiased standard deviation, the one GRPO divides by.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from treadle.algorithms.utils import group_index, group_reduce, masked_mean


def equal_reward_frac(scores: Tensor, group_ids: Sequence[Hashable]) -> float | None:
    """The share of groups of two or more samples whose ``scores`` [B] are all equal; None when
    no group has two samples."""
    index = group_index(group_ids, scores)
    s = scores.double()
    sizes = group_reduce(torch.ones_like(s), index, "sum")
    equal = group_reduce(s, index, "amax") == group_reduce(s, index, "amin")
    several = sizes > 1
    if not several.any():
        return None
    return float(equal[several].double().mean())


def group_reward_std(scores: Tensor, group_ids: Sequence[Hashable]) -> float | None:
    """The unbiased standard deviation of ``scores`` [B] within each group of two or more
    samples, averaged over those groups; None when there is none."""
    index = group_index(group_ids, scores)
    s = scores.double()
    sizes = group_reduce(torch.ones_like(s), index, "sum")
    several = sizes > 1
    if not several.any():
        return None
    mean = group_reduce(s, index, "sum") / sizes
    squares = group_reduce((s - mean[index]) ** 2, index, "sum")
    std = (squares / (sizes - 1).clamp(min=1)).sqrt()
    return float(std[several].mean())


def nonzero_advantage_frac(advantages: Tensor, response_mask: Tensor) -> float:
    """The share of response tokens (``response_mask``) whose advantage is not 0 (0 when there
    is no response token)."""
    return float(masked_mean((advantages != 0).double(), response_mask))
