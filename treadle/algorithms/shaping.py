"""Reward shaping and group filtering that DAPO adds on the data side (arXiv 2503.14476).

Pure functions the RL driver applies between scoring and advantages:

- :func:`overlong_penalty`, DAPO's soft over-long punishment (its eq. 13): no penalty up to
  ``max_len - buffer_len`` tokens, then a linear ramp down to ``-factor`` at ``max_len``.
- :func:`varied_groups`, the test of DAPO's dynamic sampling: a group whose rewards are all
  equal has zero advantage under any group baseline and carries no gradient, so it is dropped.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from torch import Tensor

from treadle.algorithms.utils import group_index, group_reduce


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int, factor: float) -> Tensor:
    """Per-response penalty [B] (<= 0) for response lengths ``lengths`` [B].

    ``R(L) = 0`` if ``L <= max_len - buffer_len``; ``((max_len - buffer_len) - L) / buffer_len
    * factor`` if ``max_len - buffer_len < L <= max_len``; ``-factor`` beyond.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got {buffer_len}, {max_len}")
    excess = (lengths.float() - (max_len - buffer_len)).clamp(min=0)
    return (-excess / buffer_len * factor).clamp(min=-factor)


def varied_groups(scores: Tensor, group_ids: Sequence[Hashable]) -> Tensor:
    """Bool [B]: True where the sample's group has at least two different scores (compared
    exactly, lowest against highest: a spread computed from the mean is not 0 for equal scores
    such as 0.1 in float64)."""
    index = group_index(group_ids, scores)
    s = scores.double()
    return (group_reduce(s, index, "amax") != group_reduce(s, index, "amin"))[index]
