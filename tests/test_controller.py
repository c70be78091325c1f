"""Dispatch and collect: how the driver's call is spread over ranks and gathered back."""

from __future__ import annotations

import pytest
import torch

from treadle.controller import Collect, Dispatch, collect_results, dispatch_args
from treadle.protocol import Batch


def numbered(n: int) -> Batch:
    return Batch.from_dict(tensors={"x": torch.arange(n)}, objects={"uid": list("abcdef")[:n]})


def test_dp_cuts_batches_and_broadcasts_the_rest():
    parts = dispatch_args(Dispatch.DP, 3, (numbered(6), "params"), {"flag": True})
    assert [p[0][0]["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [list(p[0][0]["uid"]) for p in parts] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert all(p[0][1] == "params" and p[1] == {"flag": True} for p in parts)


def test_dp_refuses_uneven_batches():
    with pytest.raises(ValueError, match="5 samples cannot be split evenly over 2 ranks"):
        dispatch_args(Dispatch.DP, 2, (numbered(5),), {})


def test_all_sends_the_same_arguments():
    b = numbered(2)
    parts = dispatch_args(Dispatch.ALL, 2, (b,), {})
    assert parts[0][0][0] is b and parts[1][0][0] is b


def test_collect_modes():
    assert collect_results(Collect.RANK0, [1, 2]) == 1
    assert collect_results(Collect.LIST, [1, 2]) == [1, 2]
    assert collect_results(Collect.MEAN, [{"a": 1.0, "b": 4}, {"a": 3.0, "b": 0}]) == {
        "a": 2.0,
        "b": 2.0,
    }
    cat = collect_results(Collect.CONCAT, numbered(4).chunk(2))
    assert cat["x"].tolist() == [0, 1, 2, 3]
