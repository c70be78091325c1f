"""Every advantage estimator against verl 0.9.1's function of the same name.

Random float64 batches (several seeds): groups of 1 to 5 samples, interleaved in the batch,
responses of varied length with one empty response (all-zero mask), a group whose scores are
all equal and one whose best score is tied. Values are compared at the valid positions to 1e-6
(verl leaves values at masked positions that treadle sets to 0; the contract test in
test_advantages.py checks those zeros). Where treadle differs from verl on purpose, a test
below pins the difference.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from algorithm_calls import estimate
from reference import verl_core_algos
from torch.testing import assert_close

from treadle.algorithms import ADV_ESTIMATORS

SEEDS = [0, 1, 2, 3]
T = 8
# group id -> size; "p0" is a singleton, "p3" holds the empty response, "p4" all-equal scores
GROUPS = {"p0": 1, "p1": 3, "p2": 2, "p3": 5, "p4": 4}


@pytest.fixture(scope="module")
def verl():
    return verl_core_algos()


def make_batch(seed: int, *, holes: bool = False, singletons: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    sizes = {k: n for k, n in GROUPS.items() if singletons or n > 1}
    ids = [k for k, n in sizes.items() for _ in range(n)]
    ids = [ids[i] for i in torch.randperm(len(ids), generator=g)]  # groups are not contiguous
    b = len(ids)
    lengths = torch.randint(1, T + 1, (b,), generator=g)
    lengths[ids.index("p3")] = 0  # an empty response
    mask = (torch.arange(T) < lengths[:, None]).double()
    if holes:  # tool output inside responses: gaps, first and last valid token kept
        for i in range(b):
            if lengths[i] >= 4:
                gap = torch.randint(1, int(lengths[i]) - 1, (2,), generator=g)
                mask[i, gap] = 0.0
    scores = torch.rand(b, generator=g, dtype=torch.float64)
    for i, k in enumerate(ids):
        if k == "p4":
            scores[i] = 0.5  # all equal (0.5 is exact in float32 too)
    p1 = [i for i, k in enumerate(ids) if k == "p1"]
    scores[p1[0]] = scores[p1[1]] = 1.0  # a tie for the best
    outcome = torch.zeros(b, T, dtype=torch.float64)
    for i in range(b):
        if mask[i].any():
            outcome[i, int(mask[i].nonzero().max())] = scores[i]
    probs = torch.rand(b, T, generator=g, dtype=torch.float64) * 0.9 + 0.05
    return {
        "ids": ids,
        "index": np.array(ids, dtype=object),
        "mask": mask,
        "outcome": outcome,
        "token": torch.randn(b, T, generator=g, dtype=torch.float64) * mask,
        "values": torch.randn(b, T, generator=g, dtype=torch.float64),
        "old_log_probs": probs.log(),
        "sum_pi_squared": probs**2 + torch.rand(b, T, generator=g, dtype=torch.float64) * 0.5,
        "is_weights": torch.rand(b, T, generator=g, dtype=torch.float64) * 1.5 + 0.5,
        "baselines": torch.rand(b, generator=g, dtype=torch.float64),
        "components": torch.randn(b, 3, generator=g, dtype=torch.float64),
    }


def treadle(name: str, rewards: torch.Tensor, x: dict, **kw):
    return estimate(name, rewards, x["mask"], group_ids=x["ids"], **kw)


def same_on_valid(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor, atol=1e-6):
    assert ours.dtype == torch.float64
    valid = mask.bool()
    assert_close(ours[valid], theirs.to(ours.dtype)[valid], atol=atol, rtol=1e-6)
    assert torch.equal(ours[~valid], torch.zeros_like(ours[~valid]))


# --------------------------------------------------------------------------- group baselines


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo(verl, seed, norm):
    x = make_batch(seed)
    adv, ret = treadle("grpo", x["outcome"], x, norm_adv_by_std=norm)
    ref, _ = verl.compute_grpo_outcome_advantage(
        x["outcome"], x["mask"], x["index"], norm_adv_by_std_in_grpo=norm
    )
    same_on_valid(adv, ref, x["mask"])
    assert torch.equal(ret, adv)


@pytest.mark.parametrize("seed", SEEDS)
def test_dr_grpo_is_grpo_without_std(verl, seed):
    x = make_batch(seed)
    adv, _ = treadle("dr_grpo", x["outcome"], x)  # no norm_adv_by_std: it never divides
    ref, _ = verl.compute_grpo_outcome_advantage(
        x["outcome"], x["mask"], x["index"], norm_adv_by_std_in_grpo=False
    )
    same_on_valid(adv, ref, x["mask"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_vectorized(verl, seed, norm):
    # verl's vectorized GRPO computes in float32: compared to float32 precision
    x = make_batch(seed)
    adv, _ = treadle("grpo_vectorized", x["outcome"], x, norm_adv_by_std=norm)
    ref, _ = verl.compute_grpo_vectorized_outcome_advantage(
        x["outcome"], x["mask"], x["index"], norm_adv_by_std_in_grpo=norm
    )
    same_on_valid(adv, ref, x["mask"], atol=1e-5)
    assert ADV_ESTIMATORS.get("grpo_vectorized") is ADV_ESTIMATORS.get("grpo")


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo(verl, seed):
    x = make_batch(seed)
    adv, ret = treadle("rloo", x["outcome"], x)
    ref, _ = verl.compute_rloo_outcome_advantage(x["outcome"], x["mask"], x["index"])
    same_on_valid(adv, ref, x["mask"])
    assert torch.equal(ret, adv)


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_vectorized_without_singletons(verl, seed):
    x = make_batch(seed, singletons=False)
    adv, _ = treadle("rloo_vectorized", x["outcome"], x)
    ref, _ = verl.compute_rloo_vectorized_outcome_advantage(x["outcome"], x["mask"], x["index"])
    same_on_valid(adv, ref, x["mask"])


def test_rloo_vectorized_singleton_is_rloo_not_verls_vectorized(verl):
    # verl's two RLOOs disagree on a group of one: rloo gives the score, rloo_vectorized 0.
    # treadle's rloo_vectorized is its rloo.
    x = make_batch(0)
    single = x["ids"].index("p0")
    adv, _ = treadle("rloo_vectorized", x["outcome"], x)
    loop, _ = verl.compute_rloo_outcome_advantage(x["outcome"], x["mask"], x["index"])
    vec, _ = verl.compute_rloo_vectorized_outcome_advantage(x["outcome"], x["mask"], x["index"])
    same_on_valid(adv, loop, x["mask"])
    score = x["outcome"][single].sum()
    assert score != 0 and torch.all(vec[single] == 0)
    assert_close(adv[single][x["mask"][single].bool()], score.expand(int(x["mask"][single].sum())))


@pytest.mark.parametrize("seed", SEEDS)
def test_opo(verl, seed):
    x = make_batch(seed)
    adv, _ = treadle("opo", x["outcome"], x)
    ref, _ = verl.compute_opo_outcome_advantage(x["outcome"], x["mask"], x["index"])
    same_on_valid(adv, ref, x["mask"])


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline(verl, seed):
    x = make_batch(seed)
    adv, _ = treadle("reinforce_plus_plus_baseline", x["outcome"], x)
    ref, _ = verl.compute_reinforce_plus_plus_baseline_outcome_advantage(
        x["outcome"], x["mask"], x["index"]
    )
    same_on_valid(adv, ref, x["mask"])


@pytest.mark.parametrize("seed", SEEDS)
def test_gpg_equal_up_to_alpha(verl, seed):
    # The only difference: α = B / (nonzero advantages) here, B / (nonzero scores) in verl.
    x = make_batch(seed)
    adv, _ = treadle("gpg", x["outcome"], x)
    ref, _ = verl.compute_gpg_outcome_advantage(x["outcome"], x["mask"], x["index"])
    scores, b = x["outcome"].sum(-1), len(x["ids"])
    centered = [  # s_i - mean_g(s), counted for every sample (empty responses too)
        s
        - (
            scores[[j for j, k in enumerate(x["ids"]) if k == g]].mean()
            if x["ids"].count(g) > 1
            else 0
        )
        for s, g in zip(scores, x["ids"], strict=True)
    ]
    nonzero_adv = sum(abs(float(c)) > 1e-6 for c in centered)
    same_on_valid(adv * nonzero_adv / b, ref * int(scores.count_nonzero()) / b, x["mask"])


def test_gpg_alpha_differs_from_verl_on_purpose(verl):
    # one group [1, 0, 0, 0] and one [1, 1]: 3 samples have a nonzero score (verl α = 6/3),
    # 4 a nonzero advantage (α = 6/4; the group of equal rewards has none)
    mask = torch.ones(6, 2, dtype=torch.float64)
    rewards = torch.zeros(6, 2, dtype=torch.float64)
    rewards[[0, 4, 5], 1] = 1.0
    ids = ["a", "a", "a", "a", "b", "b"]
    adv, _ = estimate("gpg", rewards, mask, group_ids=ids)
    ref, _ = verl.compute_gpg_outcome_advantage(rewards, mask, np.array(ids, dtype=object))
    centered = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0], dtype=torch.float64)
    assert_close(adv[:, 0], 6 / 4 * centered)
    assert_close(ref[:, 0], 6 / 3 * centered)


# --------------------------------------------------------------------------- new estimators


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk(verl, seed, norm):
    x = make_batch(seed, singletons=False)
    adv, ret = treadle("grpo_passk", x["outcome"], x, norm_adv_by_std=norm)
    ref, _ = verl.compute_grpo_passk_outcome_advantage(
        x["outcome"], x["mask"], x["index"], config={"norm_adv_by_std_in_grpo": norm}
    )
    same_on_valid(adv, ref, x["mask"])
    assert torch.equal(ret, adv)
    p1 = [i for i, k in enumerate(x["ids"]) if k == "p1"]
    assert torch.all(adv[p1] == 0)  # the best score is tied: no margin


def test_grpo_passk_refuses_a_group_of_one(verl):
    x = make_batch(0)
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        treadle("grpo_passk", x["outcome"], x)
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        verl.compute_grpo_passk_outcome_advantage(
            x["outcome"], x["mask"], x["index"], config={"norm_adv_by_std_in_grpo": True}
        )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("weights", [None, [1.0, 0.5, 2.0]])
def test_gdpo(verl, seed, norm, weights):
    x = make_batch(seed)
    comps = x["components"]
    comps[[i for i, k in enumerate(x["ids"]) if k == "p4"], 1] = 0.25  # an all-equal component
    adv, ret = treadle(
        "gdpo", x["outcome"], x, reward_components=comps, reward_weights=weights,
        norm_adv_by_std=norm,
    )  # fmt: skip
    keys = ["format", "accuracy", "length"]
    prompts = torch.zeros(len(x["ids"]), 3, dtype=torch.long)
    config = {
        "gdpo_reward_keys": keys,
        "gdpo_reward_weights": weights,
        "norm_adv_by_std_in_grpo": norm,
    }
    ref, _ = verl.compute_gdpo_outcome_advantage(
        x["outcome"],
        x["mask"],
        x["index"],
        norm_adv_by_std_in_grpo=norm,
        config=config,
        non_tensor_batch={k: comps[:, j].numpy() for j, k in enumerate(keys)},
        batch={
            "prompts": prompts,
            "attention_mask": torch.cat([torch.ones_like(prompts), x["mask"].long()], -1),
        },
    )
    # verl reads the components as float32
    same_on_valid(adv, ref, x["mask"], atol=1e-5)
    assert torch.equal(ret, adv)


@pytest.mark.parametrize("seed", SEEDS)
def test_gdpo_without_components_is_the_score_alone(verl, seed):
    x = make_batch(seed)
    adv, _ = treadle("gdpo", x["outcome"], x)
    ref, _ = verl.compute_gdpo_outcome_advantage(x["outcome"], x["mask"], x["index"])
    same_on_valid(adv, ref, x["mask"])


OTB = {
    "optimal_token_baseline": "compute_optimal_token_baseline_advantage",
    "tir_optimal_token_baseline": "compute_multi_turn_optimal_token_baseline_advantage",
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(OTB))
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("is_weights", [False, True])
def test_optimal_token_baseline(verl, seed, name, holes, zero_tail, is_weights):
    x = make_batch(seed, holes=holes)
    kw = {
        "old_log_probs": x["old_log_probs"],
        "sum_pi_squared": x["sum_pi_squared"],
        "rollout_is_weights": x["is_weights"] if is_weights else None,
        "handle_zero_tail": zero_tail,
    }
    rewards = x["token"] + x["outcome"]
    adv, ret = treadle(name, rewards, x, **kw)
    ref_adv, ref_ret = getattr(verl, OTB[name])(rewards, x["mask"], x["index"], **kw)
    same_on_valid(adv, ref_adv, x["mask"])
    same_on_valid(ret, ref_ret, x["mask"])


def test_optimal_token_baselines_differ_only_with_gaps():
    x = make_batch(1)
    kw = {"old_log_probs": x["old_log_probs"], "sum_pi_squared": x["sum_pi_squared"]}
    rewards = x["token"] + x["outcome"]
    by_column, _ = treadle("optimal_token_baseline", rewards, x, **kw)
    by_token, _ = treadle("tir_optimal_token_baseline", rewards, x, **kw)
    assert_close(by_column, by_token)
    x = make_batch(1, holes=True)
    by_column, _ = treadle("optimal_token_baseline", rewards * x["mask"], x, **kw)
    by_token, _ = treadle("tir_optimal_token_baseline", rewards * x["mask"], x, **kw)
    assert (by_column - by_token).abs().max() > 1e-3


# --------------------------------------------------------------------------- token-level


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("holes", [False, True])
def test_gae(verl, seed, holes):
    x = make_batch(seed, holes=holes)
    adv, ret = treadle("gae", x["token"], x, values=x["values"], gamma=0.95, lam=0.9)
    ref_adv, ref_ret = verl.compute_gae_advantage_return(
        x["token"], x["values"], x["mask"], gamma=0.95, lam=0.9
    )
    same_on_valid(adv, ref_adv, x["mask"])
    same_on_valid(ret, ref_ret, x["mask"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus(verl, seed, holes):
    x = make_batch(seed, holes=holes)
    adv, ret = treadle("reinforce_plus_plus", x["token"], x, gamma=0.9)
    ref_adv, ref_ret = verl.compute_reinforce_plus_plus_outcome_advantage(
        x["token"], x["mask"], config=types.SimpleNamespace(gamma=0.9)
    )
    same_on_valid(adv, ref_adv, x["mask"])
    same_on_valid(ret, ref_ret, x["mask"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rewards", ["outcome", "token"])
def test_remax(verl, seed, rewards):
    x = make_batch(seed)
    adv, ret = treadle("remax", x[rewards], x, baseline_rewards=x["baselines"])
    ref_adv, ref_ret = verl.compute_remax_outcome_advantage(x[rewards], x["baselines"], x["mask"])
    same_on_valid(adv, ref_adv, x["mask"])
    same_on_valid(ret, ref_ret, x["mask"])


# --------------------------------------------------------------------------- on purpose


def test_rewards_at_masked_positions_count_in_verl_not_here(verl):
    # verl's score is the row's sum; treadle's only counts valid positions
    x = make_batch(2, singletons=False)
    junk = x["outcome"] + 3.0 * (1 - x["mask"]) * torch.rand(x["mask"].shape, dtype=torch.float64)
    adv, _ = treadle("grpo", junk, x)
    clean, _ = treadle("grpo", x["outcome"], x)
    ref, _ = verl.compute_grpo_outcome_advantage(junk, x["mask"], x["index"])
    ref_clean, _ = verl.compute_grpo_outcome_advantage(x["outcome"], x["mask"], x["index"])
    assert torch.equal(adv, clean)
    same_on_valid(adv, ref_clean, x["mask"])
    assert (ref - ref_clean).abs().max() > 1e-2


def test_every_verl_estimator_has_a_counterpart(verl):
    assert set(verl.ADV_ESTIMATOR_REGISTRY) <= set(ADV_ESTIMATORS.names())


@pytest.mark.parametrize("verl_name", ["grpo", "grpo_vectorized"])
def test_equal_float32_rewards_get_exactly_zero_here_not_in_verl(verl, verl_name):
    rewards = torch.zeros(8, 2)
    rewards[:, 1] = 0.3
    mask, ids = torch.ones(8, 2), ["a"] * 8
    ref, _ = verl.ADV_ESTIMATOR_REGISTRY[verl_name](rewards, mask, np.array(ids, dtype=object))
    adv, _ = estimate(verl_name, rewards, mask, group_ids=ids)
    assert ref.abs().max() > 1e-2  # float32 group statistics: 0.3 - mean is not 0
    assert torch.equal(adv, torch.zeros_like(adv))
