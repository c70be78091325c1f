"""The registry (names, errors, decorators) and the masked statistics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


def test_the_facts_file_is_what_the_builtin_modules_register():
    """(In a process of its own: tests here register functions of their own.)"""
    from treadle.algorithms.registry import FACTS_FILE

    live = "import json, treadle.algorithms.registry as r; print(json.dumps(r.live_record()))"
    proc = subprocess.run([sys.executable, "-c", live], check=True, capture_output=True, text=True)
    kept = json.loads(FACTS_FILE.read_text(encoding="utf-8"))
    assert kept == json.loads(proc.stdout), "run `make facts` to write it again"


_CHECK_ALGORITHM = """
import sys
from treadle.config import load_config
from treadle.config.rules import check_algorithm
from treadle.runtime.errors import ConfigError
check_algorithm(load_config("examples/arithmetic/ppo.yaml", []), "train")
try:
    bad = load_config("examples/arithmetic/grpo.yaml", ["algorithm.kl_estimator=k4"])
    check_algorithm(bad, "train")
except ConfigError as e:
    print(e)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_the_algorithm_checks_import_no_torch(tmp_path):
    """`treadle check`'s algorithm rules read the facts file, not the modules (which import
    torch, seconds), whatever the cache of kept answers holds (here: nothing)."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK_ALGORITHM],
        check=True, capture_output=True, text=True,
        env={**os.environ, "TREADLE_CHECK_CACHE": str(tmp_path)},
    )  # fmt: skip
    error, imported = proc.stdout.strip().splitlines()
    assert error.startswith("algorithm.kl_estimator: unknown name 'k4'; valid: abs, abs+, full,")
    assert imported == "[]"


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


def test_the_package_exports_exactly_its_lazy_and_registry_names():
    """``treadle.algorithms`` lists its names for the tools (``__all__``, a literal), for its
    lazy imports (``_LAZY``) and imports the registry's with itself: the lists agree, and every
    name resolves."""
    import treadle.algorithms as package
    from treadle.algorithms import registry

    eager = [name for name in package.__all__ if getattr(registry, name, None) is not None]
    assert eager  # the registries and their decorators
    assert sorted(package.__all__) == sorted([*package._LAZY, *package._SUBMODULES, *eager])
    for name in package.__all__:
        assert getattr(package, name) is not None, name
