"""The registry (names, errors, decorators) and the masked statistics."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from treadle.algorithms import (
    ADV_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Registry,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from treadle.algorithms.reference import builtin_names

# --------------------------------------------------------------------------- registry


def test_builtin_names():
    assert builtin_names(ADV_ESTIMATORS) == [
        "dr_grpo",
        "gae",
        "gdpo",
        "gpg",
        "grpo",
        "grpo_passk",
        "grpo_vectorized",
        "opo",
        "optimal_token_baseline",
        "prime",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "rloo",
        "rloo_vectorized",
        "tir_optimal_token_baseline",
    ]
    assert builtin_names(POLICY_LOSSES) == [
        "bypass_mode",
        "cispo",
        "clip_cov",
        "dppo_kl",
        "dppo_tv",
        "dro",
        "geo_mean",
        "gpg",
        "gspo",
        "kl_cov",
        "ppo",
        "sapo",
        "vanilla",
    ]
    assert POLICY_LOSSES.aliases() == {"vanilla": "ppo"}
    assert POLICY_LOSSES.get("vanilla") is POLICY_LOSSES.get("ppo")
    assert builtin_names(LOSS_AGG_MODES) == [
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-mean",
        "token-sum",
    ]


def test_unknown_name_lists_valid_names_and_closest():
    valid = ", ".join(ADV_ESTIMATORS.names())
    with pytest.raises(ValueError) as info:
        ADV_ESTIMATORS.get("grp")
    assert str(info.value) == (
        f"unknown advantage estimator 'grp'; valid: {valid} (did you mean 'grpo'?)"
    )
    with pytest.raises(ValueError, match=r"^unknown policy loss 'zzz'; valid: bypass_mode, cispo,"):
        POLICY_LOSSES.get("zzz")


def test_register_get_and_duplicate():
    reg: Registry = Registry("widget")

    @reg.register("double")
    def double(x: int) -> int:
        return 2 * x

    assert reg.get("double") is double
    assert reg.get("double")(4) == 8
    assert "double" in reg and "triple" not in reg
    assert reg.names() == ["double"]
    with pytest.raises(ValueError, match="widget 'double' is already registered"):
        reg.register("double")(double)


def test_alias_resolves_to_the_registered_function_and_its_facts():
    reg: Registry = Registry("widget")
    reg.register("double", needs=("x",))(lambda x: 2 * x)
    reg.alias("twice", "double")
    reg.alias("two_times", "twice")  # an alias of an alias names the function itself
    assert reg.get("twice") is reg.get("double") and reg.canonical("two_times") == "double"
    assert reg.needs("twice") == ("x",) and "twice" in reg
    assert reg.names() == ["double", "twice", "two_times"]
    with pytest.raises(ValueError, match="widget 'twice' is already registered"):
        reg.register("twice")(lambda x: x)
    with pytest.raises(ValueError, match="widget 'double' is already registered"):
        reg.alias("double", "twice")
    with pytest.raises(ValueError, match="unknown widget 'nope'"):
        reg.alias("other", "nope")


# --------------------------------------------------------------------------- masked statistics

X = torch.tensor([[1.0, 2.0, 3.0, float("inf")], [4.0, float("nan"), 0.0, 0.0]])
M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float32)
VALID = torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_masked_sum_and_mean_ignore_garbage_under_the_mask():
    assert masked_sum(X, M).item() == 10.0
    assert masked_mean(X, M).item() == 2.5
    assert_close(masked_mean(X, M, dim=-1), torch.tensor([2.0, 4.0]))
    assert_close(masked_sum(X, M.bool(), dim=0), torch.tensor([5.0, 2.0, 3.0, 0.0]))


def test_masked_var_matches_torch_var_of_valid_elements():
    assert_close(masked_var(X, M), VALID.var(unbiased=True))
    assert_close(masked_var(X, M, unbiased=False), VALID.var(unbiased=False))


def test_empty_masks_give_zero_not_nan():
    zero = torch.zeros_like(M)
    assert masked_sum(X, zero).item() == 0.0
    assert masked_mean(X, zero).item() == 0.0
    assert_close(masked_mean(X, M, dim=0), torch.tensor([2.5, 2.0, 3.0, 0.0]))
    assert masked_var(X, zero).item() == 0.0
    one = torch.zeros_like(M)
    one[0, 0] = 1
    assert masked_var(X, one).item() == 0.0  # unbiased variance of one element
    assert torch.equal(masked_whiten(X, zero), torch.zeros_like(X))


def test_masked_whiten():
    w = masked_whiten(X, M)
    expected = (VALID - VALID.mean()) / torch.sqrt(VALID.var() + 1e-8)
    assert_close(w[M.bool()], expected)
    assert torch.equal(w[~M.bool()], torch.zeros(4))
    kept = masked_whiten(X, M, shift_mean=False)
    assert_close(kept[M.bool()], expected + 2.5)


def test_the_package_exports_exactly_its_lazy_names():
    """``treadle.algorithms`` lists its names for the tools (``__all__``, a literal) and for
    its lazy imports (``_LAZY``): the two lists agree, and every name resolves."""
    import treadle.algorithms as package

    assert sorted(package.__all__) == sorted([*package._LAZY, *package._SUBMODULES])
    for name in package.__all__:
        assert getattr(package, name) is not None, name
