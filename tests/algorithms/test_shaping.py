"""DAPO's over-long shaping, the dynamic-sampling group test, and the KL penalty in the reward."""

from __future__ import annotations

import pytest
import torch

from treadle.algorithms.kl import kl_in_reward
from treadle.algorithms.shaping import overlong_penalty, varied_groups


def test_overlong_penalty_by_hand():
    # max 20 tokens, buffer 8: free up to 12, then -1/8 per token (factor 1), -1 at 20.
    lengths = torch.tensor([0, 12, 13, 16, 20, 25])
    got = overlong_penalty(lengths, max_len=20, buffer_len=8, factor=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.5, -1.0, -1.0]))
    half = overlong_penalty(lengths, max_len=20, buffer_len=8, factor=0.5)
    torch.testing.assert_close(half, got * 0.5)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, max_len=20, buffer_len=0, factor=1.0)


def test_varied_groups():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 7.0])
    uids = ["a", "a", "a", "b", "b", "c", "c", "d"]  # d: a group of one never varies
    got = varied_groups(scores, uids)
    assert got.tolist() == [False, False, False, True, True, False, False, False]
    # Groups come from the ids, not from positions.
    assert varied_groups(torch.tensor([0.0, 0.0, 1.0, 1.0]), [1, 2, 1, 2]).tolist() == [True] * 4
    # Equal scores whose mean does not round back to them (0.1 in float64) are equal.
    tenths = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    assert varied_groups(tenths, ["a"] * 3).tolist() == [False] * 3


def test_kl_in_reward_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, seq_kl = kl_in_reward(scores, logp, ref, mask, coef=0.1, kind="k1")
    # k1 = logp - ref: row 0 [0.5, -1, 0], row 1 [1, 0, (masked)]
    want = torch.tensor([[-0.05, 0.1, 1.0], [-0.1, 2.0, 0.0]])
    torch.testing.assert_close(rewards, want)
    torch.testing.assert_close(seq_kl, torch.tensor([-0.5 / 3, 0.5]))
