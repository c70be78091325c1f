"""Sampled evaluation's metrics: equal to verl 0.9.1's own functions on random samples, and
pass@k equal to its definition counted over every subset."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from reference import verl_module

from treadle.algorithms.sampled import (
    PromptSamples,
    bootstrap,
    pass_at_k,
    sampled_metrics,
    sizes,
)


@pytest.fixture(scope="module")
def verl():
    return verl_module("verl.trainer.ppo.metric_utils")


def random_prompts(rng: random.Random, prompts: int, n: int) -> list[PromptSamples]:
    """Samples with few distinct answers (so votes tie and differ), right when the answer is "7"
    (or, now and then, a right answer written another way)."""
    out = []
    for _ in range(prompts):
        preds = [rng.choice(["7", "8", "9", "", "07"]) for _ in range(n)]
        acc = [1.0 if p in ("7", "07") else 0.0 for p in preds]
        scores = [a + rng.random() * 0.1 for a in acc]
        out.append(PromptSamples(scores, acc, preds))
    return out


def verl_flat(prompts: list[PromptSamples], sources: list[str]):
    """verl's inputs: one entry per sample (data source, uid, {acc, pred})."""
    data_sources, uids, acc, preds = [], [], [], []
    for i, (p, source) in enumerate(zip(prompts, sources, strict=True)):
        for a, pred in zip(p.acc, p.preds, strict=True):
            data_sources.append(source)
            uids.append(f"u{i}")
            acc.append(a)
            preds.append(pred)
    return data_sources, uids, {"acc": acc, "pred": preds}


@pytest.mark.parametrize(("n", "seed"), [(2, 42), (5, 42), (8, 7), (16, 123)])
def test_equal_to_verl_process_validation_metrics(verl, n, seed):
    rng = random.Random(n * 1000 + seed)
    prompts = random_prompts(rng, 9, n)
    sources = [rng.choice(["gsm", "math"]) for _ in prompts]
    ours = sampled_metrics(prompts, sources, seed=seed)
    theirs = verl.process_validation_metrics(*verl_flat(prompts, sources), seed=seed)
    for source in ("gsm", "math"):
        reported = theirs[source]["acc"]
        # verl's names -> ours: best@k/mean is best@k, the rest alike
        assert reported, source
        for name, value in reported.items():
            assert ours[f"{source}/{name.removesuffix('/mean')}"] == value, (source, name)
        ks = sizes(n)
        expected = {f"mean@{n}", f"std@{n}"} | {
            f"{m}@{k}{s}" for m in ("best", "worst", "maj") for k in ks for s in ("", "/std")
        }
        assert {name.removesuffix("/mean") for name in reported} == expected
    # over every prompt: verl with one data source
    everything = verl.process_validation_metrics(
        *verl_flat(prompts, ["all"] * len(prompts)), seed=seed
    )["all"]["acc"]
    for name, value in everything.items():
        assert ours[name.removesuffix("/mean")] == value, name
    assert ours["accuracy"] == everything[f"mean@{n}"]


def test_bootstrap_equal_to_verl_bootstrap_metric_and_calc_maj_val(verl):
    from functools import partial

    rng = random.Random(3)
    for k in (1, 2, 3, 6):
        preds = [rng.choice("abc") for _ in range(6)]
        acc = [float(rng.random() < 0.5) for _ in preds]
        ours = bootstrap(acc, preds, k, seed=11, n_bootstrap=200)
        best, worst = verl.bootstrap_metric(acc, k, [np.max, np.min], n_bootstrap=200, seed=11)
        votes = [{"pred": p, "val": a} for p, a in zip(preds, acc, strict=True)]
        (maj,) = verl.bootstrap_metric(
            votes, k, [partial(verl.calc_maj_val, vote_key="pred", val_key="val")], 200, 11
        )
        assert ours == {"best": best, "worst": worst, "maj": maj}


def test_pass_at_k_is_the_chance_that_k_drawn_without_replacement_hold_a_right_one():
    for n in range(1, 8):
        for c in range(n + 1):
            right = [i < c for i in range(n)]
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(right, k))
                counted = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(counted, abs=1e-12)
    # Chen et al.'s numerically stable form gives the same numbers
    n, c, k = 200, 13, 10
    stable = 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
    assert pass_at_k(n, c, k) == pytest.approx(stable, rel=1e-12)
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(4, 5, 2)


def test_greedy_is_accuracy_and_reward_only():
    prompts = [PromptSamples([1.0], [1.0], ["7"]), PromptSamples([0.25], [0.0], ["8"])]
    # one of two right: the binomial standard error sqrt(0.5 * 0.5 / 2)
    want = {"accuracy": 0.5, "reward": 0.625, "accuracy/stderr": math.sqrt(0.125)}
    assert sampled_metrics(prompts) == pytest.approx(want, rel=1e-12)
    assert sizes(1) == [] and sizes(4) == [2, 4] and sizes(6) == [2, 4, 6]


def test_pass_at_k_of_a_set_by_hand():
    # 2 right of 4 and 0 of 4: pass@2 = mean(1 - C(2,2)/C(4,2), 0) = (5/6) / 2
    prompts = [
        PromptSamples([1, 1, 0, 0], [1.0, 1.0, 0.0, 0.0], ["1", "1", "2", "3"]),
        PromptSamples([0, 0, 0, 0], [0.0] * 4, ["2", "2", "2", "2"]),
    ]
    m = sampled_metrics(prompts)
    assert m["pass@2"] == pytest.approx(5 / 12)
    assert m["pass@4"] == 0.5 and m["mean@4"] == m["accuracy"] == 0.25
    assert math.isclose(m["std@4"], 0.25)  # (0.5 + 0) / 2
    # over the prompts, not the samples: accuracies 0.5 and 0, std 0.25, over sqrt(2)
    assert m["accuracy/stderr"] == pytest.approx(0.25 / math.sqrt(2))
    assert m["best@4/std"] > 0 and m["maj@4"] < 0.5  # drawn with replacement
