"""The learning-signal statistics of a batch against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from treadle.algorithms.diagnostics import (
    equal_reward_frac,
    group_reward_std,
    nonzero_advantage_frac,
)

# Five groups, by uid and not by position: "a" all 1, "b" 0 and 1, "c" all 0.1 (equal, though
# their float64 mean is not 0.1: a spread computed from it is not 0), "d" 0, 0.5, 1, "e" a
# group of one.
SCORES = torch.tensor([1.0, 0.0, 1.0, 0.1, 1.0, 0.1, 0.0, 0.5, 1.0, 0.1, 7.0], dtype=torch.float64)
UIDS = ["a", "b", "a", "c", "b", "c", "d", "d", "d", "c", "e"]


def test_equal_groups_by_hand():
    # groups of two or more: a (equal), b (varied), c (equal), d (varied); e has no baseline
    assert equal_reward_frac(SCORES, UIDS) == 0.5
    assert equal_reward_frac(torch.tensor([3.0, 3.0, 2.0, 2.0]), [0, 1, 0, 1]) == 0.0
    assert equal_reward_frac(torch.full((4,), 0.5), ["x"] * 4) == 1.0
    assert equal_reward_frac(torch.tensor([1.0, 0.0]), ["x", "y"]) is None  # rollout.n=1


def test_within_group_std_by_hand():
    # unbiased std: a 0, b sqrt(0.5), c 0, d 0.5 (mean 0.5, squares 0.5, / 2); e left out
    want = (0 + math.sqrt(0.5) + 0 + 0.5) / 4
    assert group_reward_std(SCORES, UIDS) == pytest.approx(want, rel=1e-12)
    assert group_reward_std(torch.tensor([1.0, 0.0]), ["x", "y"]) is None


def test_nonzero_advantage_tokens_by_hand():
    advantages = torch.tensor([[0.5, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [-1.0, -1.0, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
    # valid tokens: 3 + 2 + 3 = 8, non-zero among them: 3 + 0 + 2 (the 9.0 is padding)
    assert nonzero_advantage_frac(advantages, mask) == 5 / 8
    assert nonzero_advantage_frac(advantages, torch.zeros_like(mask)) == 0.0
