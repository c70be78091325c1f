"""Advantage estimators against hand-computed values and plain-Python loop references.

The shared batch has uneven response lengths, a three-sample group with distinct scores
("a"), a single-sample group ("b") and a group whose rewards are all equal ("c").
"""

from __future__ import annotations

import math

import pytest
import torch
from algorithm_calls import estimate as estimator
from torch.testing import assert_close

from treadle.algorithms import ADV_ESTIMATORS, EstimatorInputs
from treadle.algorithms.utils import trajectory_weights

MASK = torch.tensor(
    [
        [1, 1, 1, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 1],
        [1, 0, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 0, 0],
    ],
    dtype=torch.float32,
)
GROUPS = ["a", "a", "a", "b", "c", "c"]
SCORES = [1.0, 0.0, 0.5, 0.7, 0.3, 0.3]


def outcome_rewards(scores: list[float] = SCORES, mask: torch.Tensor = MASK) -> torch.Tensor:
    """Each score placed on the last valid token of its row (as a reward manager does)."""
    rewards = torch.zeros(mask.shape)
    for i, s in enumerate(scores):
        rewards[i, int(mask[i].nonzero().max())] = s
    return rewards


def spread(per_seq: list[float], mask: torch.Tensor = MASK) -> torch.Tensor:
    return torch.tensor(per_seq, dtype=torch.float32).unsqueeze(-1) * mask


def estimate(name: str, rewards: torch.Tensor | None = None, mask: torch.Tensor = MASK, **kw):
    rewards = outcome_rewards() if rewards is None else rewards
    return estimator(name, rewards, mask, group_ids=kw.pop("group_ids", GROUPS), **kw)


# --------------------------------------------------------------------------- references


def ref_group_baseline(scores, ids, norm_by_std, eps=1e-6):
    """GRPO as a loop: single-sample group -> mean 0, std 1."""
    out = []
    for i, s in enumerate(scores):
        group = [scores[j] for j in range(len(scores)) if ids[j] == ids[i]]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        out.append((s - mean) / (std + eps) if norm_by_std else s - mean)
    return out


def ref_whiten(mat, mask):
    vals = [mat[i][t] for i in range(len(mat)) for t in range(len(mat[0])) if mask[i][t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [
        [
            (mat[i][t] - mean) / math.sqrt(var + 1e-8) if mask[i][t] else 0.0
            for t in range(len(mat[0]))
        ]
        for i in range(len(mat))
    ]


def ref_gae(rewards, values, mask, gamma, lam):
    """GAE row by row over the list of valid positions only."""
    adv = [[0.0] * len(rewards[0]) for _ in rewards]
    for i in range(len(rewards)):
        positions = [t for t in range(len(rewards[0])) if mask[i][t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(positions):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            next_adv = delta + gamma * lam * next_adv
            adv[i][t] = next_adv
            next_value = values[i][t]
    return adv


def ref_discounted(rewards, mask, gamma):
    out = [[0.0] * len(rewards[0]) for _ in rewards]
    for i in range(len(rewards)):
        running = 0.0
        for t in reversed(range(len(rewards[0]))):
            if mask[i][t]:
                running = rewards[i][t] + gamma * running
                out[i][t] = running
    return out


# --------------------------------------------------------------------------- GRPO family


def test_grpo_hand_values():
    adv, returns = estimate("grpo")
    # group a: mean 0.5, unbiased std 0.5; b: single (mean 0, std 1); c: all equal
    eps = 1e-6
    expected = [0.5 / (0.5 + eps), -0.5 / (0.5 + eps), 0.0, 0.7 / (1 + eps), 0.0, 0.0]
    assert_close(adv, spread(expected))
    assert_close(returns, adv)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_loop_reference(norm):
    torch.manual_seed(0)
    mask = (torch.rand(12, 7) < 0.7).float()
    mask[:, 0] = 1
    scores = torch.rand(12).tolist()
    ids = [0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 4, 4]
    rewards = outcome_rewards(scores, mask)
    adv, _ = estimate("grpo", rewards, mask, group_ids=ids, norm_adv_by_std=norm)
    assert_close(adv, spread(ref_group_baseline(scores, ids, norm), mask))


def test_equal_rewards_give_exactly_zero_advantage_even_after_std():
    # 0.3 is not representable: a float32 mean could differ from 0.3 by an ulp and dividing
    # by the (then tiny, nonzero) std would blow that ulp up to O(1e-2).
    rewards = outcome_rewards([0.3] * 6)
    for name in ["grpo", "dr_grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"]:
        adv, _ = estimate(name, rewards, group_ids=["x"] * 6)
        assert adv.abs().max().item() < 1e-6, name


def test_dr_grpo_never_divides_by_std():
    adv, _ = estimate("dr_grpo")
    assert_close(adv, spread([0.5, -0.5, 0.0, 0.7, 0.0, 0.0]))
    with pytest.raises(TypeError, match="norm_adv_by_std"):  # not a knob of dr_grpo
        estimate("dr_grpo", norm_adv_by_std=True)


def test_group_ids_may_be_a_tensor():
    ids = torch.tensor([7, 7, 7, 8, 9, 9])  # 0-d tensors hash by identity; must not split groups
    assert_close(estimate("grpo", group_ids=ids)[0], estimate("grpo")[0])


def test_group_ids_length_must_match_batch():
    with pytest.raises(ValueError, match="group_ids has 2 entries but the batch has 6"):
        estimate("grpo", group_ids=["a", "b"])


def test_rloo_hand_values():
    adv, _ = estimate("rloo")
    # a: 1 - (0 + .5)/2, 0 - (1 + .5)/2, .5 - (1 + 0)/2; b: no baseline; c: equal
    assert_close(adv, spread([0.75, -0.75, 0.0, 0.7, 0.0, 0.0]))


def test_rloo_matches_loop_reference():
    torch.manual_seed(1)
    scores = torch.rand(9).tolist()
    ids = [0, 0, 0, 0, 1, 1, 2, 2, 2]
    mask = torch.ones(9, 3)
    adv, _ = estimate("rloo", outcome_rewards(scores, mask), mask, group_ids=ids)
    expected = []
    for i, s in enumerate(scores):
        others = [scores[j] for j in range(9) if ids[j] == ids[i] and j != i]
        expected.append(s - sum(others) / len(others))
    assert_close(adv, spread(expected, mask))


def test_opo_length_weighted_baseline():
    adv, _ = estimate("opo")
    # group a: lengths 3, 2, 4 -> baseline (3*1 + 2*0 + 4*.5) / 9 = 5/9
    b = 5 / 9
    assert_close(adv, spread([1 - b, -b, 0.5 - b, 0.7, 0.0, 0.0]))


def test_gpg_bias_correction():
    adv, _ = estimate("gpg")
    # zero advantage: row 2 (score = group mean) and rows 4, 5 (equal group): M = 3, B = 6
    alpha = 6 / 3
    assert_close(adv, spread([alpha * 0.5, -alpha * 0.5, 0.0, alpha * 0.7, 0.0, 0.0]))


def test_gpg_all_zero_advantages_is_zero_not_nan():
    adv, _ = estimate("gpg", outcome_rewards([1.0] * 6), group_ids=["x"] * 6)
    assert torch.equal(adv, torch.zeros_like(adv))


# --------------------------------------------------------------------------- REINFORCE++ / ReMax


def test_reinforce_plus_plus_discounts_over_valid_positions():
    # row 0 has a hole at t=2 (tool output, mask 0) that must be skipped, not reset at
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    rewards = torch.tensor(
        [[0.1, 0.0, 9.0, 0.0, 1.0], [0.0, 0.5, 1.0, 9.0, 0.0], [2.0, 0.0, 0.0, 0.0, 9.0]]
    )
    adv, returns = estimate("reinforce_plus_plus", rewards, mask, group_ids=[0, 1, 2], gamma=0.9)
    g = 0.9
    assert_close(returns[0], torch.tensor([0.1 + g**3, g**2, 0.0, g, 1.0]))
    expected_returns = ref_discounted(rewards.tolist(), mask.tolist(), g)
    assert_close(returns, torch.tensor(expected_returns))
    assert_close(adv, torch.tensor(ref_whiten(expected_returns, mask.tolist())))


def test_reinforce_plus_plus_baseline_matches_loop_reference():
    adv, _ = estimate("reinforce_plus_plus_baseline")
    centered = ref_group_baseline(SCORES, GROUPS, norm_by_std=False)
    token = [[c * m for m in row] for c, row in zip(centered, MASK.tolist(), strict=True)]
    assert_close(adv, torch.tensor(ref_whiten(token, MASK.tolist())))


def test_remax_subtracts_greedy_baseline():
    baseline = torch.tensor([0.5, 0.5, 0.5, 1.0, 0.0, 0.3])
    adv, returns = estimate("remax", baseline_rewards=baseline)
    assert_close(adv, spread([0.5, -0.5, 0.0, -0.3, 0.3, 0.0]))
    assert_close(returns, spread(SCORES))


def test_remax_without_baseline_says_what_is_missing():
    with pytest.raises(ValueError, match="remax needs baseline_rewards"):
        estimate("remax")


# --------------------------------------------------------------------------- GAE


def test_gae_gamma_lambda_one_is_reward_to_go_minus_value():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    rewards = torch.tensor([[0.0, 0.5, 1.0, 7.0], [1.0, 2.0, 7.0, 7.0]])
    values = torch.tensor([[0.2, 0.4, 0.6, 5.0], [0.5, 1.0, 5.0, 5.0]])
    adv, returns = estimate("gae", rewards, mask, group_ids=[0, 1], values=values)
    raw = [[1.5 - 0.2, 1.5 - 0.4, 1.0 - 0.6, 0.0], [3.0 - 0.5, 2.0 - 1.0, 0.0, 0.0]]
    assert_close(returns, torch.tensor([[1.5, 1.5, 1.0, 0.0], [3.0, 2.0, 0.0, 0.0]]))
    assert_close(adv, torch.tensor(ref_whiten(raw, mask.tolist())))


def test_gae_matches_loop_reference_with_holes():
    torch.manual_seed(2)
    mask = torch.tensor(
        [[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0], [1, 0, 1, 0, 1, 0]], dtype=torch.float32
    )
    rewards, values = torch.randn(3, 6), torch.randn(3, 6)
    adv, returns = estimate(
        "gae", rewards, mask, group_ids=[0, 1, 2], values=values, gamma=0.95, lam=0.8
    )
    raw = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.95, 0.8)
    assert_close(returns, (torch.tensor(raw) + values) * mask)
    assert_close(adv, torch.tensor(ref_whiten(raw, mask.tolist())))


def test_gae_without_values_raises():
    with pytest.raises(ValueError, match="gae needs values from a critic"):
        estimate("gae")


# --------------------------------------------------------------------------- contract


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_every_estimator_follows_the_contract(name):
    torch.manual_seed(3)
    rewards = outcome_rewards() + 5.0 * (1 - MASK)  # junk where the mask is 0 must not count
    kwargs = {
        "values": torch.randn(MASK.shape),
        "baseline_rewards": torch.rand(6),
        "old_log_probs": torch.rand(MASK.shape).log(),
        "sum_pi_squared": torch.rand(MASK.shape),
        "reward_components": torch.randn(6, 2),
        "implicit_rewards": torch.randn(MASK.shape),  # PRIME's (junk where the mask is 0)
    }
    config = {"gamma": 0.9, "lam": 0.95}  # passed to the estimators that read them
    kwargs |= {k: v for k, v in config.items() if k in ADV_ESTIMATORS.knobs(name)}
    if name == "grpo_passk":  # needs two samples a group
        kwargs["group_ids"] = ["a", "a", "a", "a", "c", "c"]
    adv, returns = estimate(name, rewards, **kwargs)
    clean_adv, _ = estimate(name, outcome_rewards(), **kwargs)
    assert adv.shape == returns.shape == MASK.shape
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()
    assert torch.equal(adv * (1 - MASK), torch.zeros_like(adv))
    assert torch.equal(returns * (1 - MASK), torch.zeros_like(returns))
    assert_close(adv, clean_adv)
    bool_adv, _ = estimate(name, rewards, MASK.bool(), **kwargs)
    assert_close(bool_adv, adv)


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "gpg", "reinforce_plus_plus"])
def test_empty_response_gets_zero_advantage(name):
    mask = MASK.clone()
    mask[1] = 0
    adv, _ = estimate(name, outcome_rewards(), mask)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[1], torch.zeros(4))


# --------------------------------------------------------------------------- aliases, new names


def test_vectorized_names_are_aliases():
    for alias, name in [("grpo_vectorized", "grpo"), ("rloo_vectorized", "rloo")]:
        assert ADV_ESTIMATORS.get(alias) is ADV_ESTIMATORS.get(name)
        assert ADV_ESTIMATORS.info(alias) == ADV_ESTIMATORS.info(name)
        assert ADV_ESTIMATORS.info(alias)["groups"] is True and ADV_ESTIMATORS.needs(alias) == ()
        assert ADV_ESTIMATORS.canonical(alias) == name
    assert ADV_ESTIMATORS.canonical("grpo") == "grpo"
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'"):
        ADV_ESTIMATORS.alias("x", "nope")


def test_remax_per_token_rewards_give_the_reward_to_go():
    rewards = torch.tensor([[0.1, 0.2, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, returns = estimate(
        "remax", rewards, mask, group_ids=[0], baseline_rewards=torch.tensor([0.5])
    )
    assert_close(returns, torch.tensor([[1.3, 1.2, 1.0, 0.0]]))
    assert_close(adv, torch.tensor([[0.8, 0.7, 0.5, 0.0]]))


PASSK_IDS = ["a", "a", "a", "a", "c", "c"]  # a: 1, 0, .5, .7; c: a tie .3, .3


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_hand_values(norm):
    adv, returns = estimate("grpo_passk", group_ids=PASSK_IDS, norm_adv_by_std=norm)
    # only the best of a gets an advantage: its margin over the second best, 1 - .7
    std = math.sqrt((0.45**2 + 0.55**2 + 0.05**2 + 0.15**2) / 3)
    best = 0.3 / (std + 1e-6) if norm else 0.3
    assert_close(adv, spread([best, 0.0, 0.0, 0.0, 0.0, 0.0]))
    assert_close(returns, adv)


def test_grpo_passk_refuses_a_group_of_one():
    with pytest.raises(ValueError, match=r"grpo_passk needs at least 2 samples per group; group 1"):
        estimate("grpo_passk")


GDPO_IDS = ["a", "a", "b", "b"]
GDPO_MASK = torch.ones(4, 2)
# component 1 of group b has a spread 10x the other: GRPO on the sum would follow it alone
GDPO_COMPONENTS = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 10.0], [0.0, 30.0]])


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        # a: (±.5 / .707) + 0; b: ±.707 ∓ .707 = 0; whitened over 8 tokens: ±sqrt(7/4)
        (None, [math.sqrt(7 / 4), -math.sqrt(7 / 4), 0.0, 0.0]),
        # a: ±2 * .707; b: ±(1.414 - .707); var of the tokens 10/7
        ([2.0, 1.0], [math.sqrt(1.4), -math.sqrt(1.4), math.sqrt(0.35), -math.sqrt(0.35)]),
    ],
)
def test_gdpo_hand_values(weights, expected):
    rewards = outcome_rewards(GDPO_COMPONENTS.sum(-1).tolist(), GDPO_MASK)
    adv, returns = estimate(
        "gdpo", rewards, GDPO_MASK, group_ids=GDPO_IDS, reward_components=GDPO_COMPONENTS,
        reward_weights=weights,
    )  # fmt: skip
    assert_close(adv, spread(expected, GDPO_MASK), atol=1e-5, rtol=1e-5)
    assert_close(returns, adv)


def test_gdpo_checks_its_inputs():
    with pytest.raises(ValueError, match=r"gdpo: 3 reward_weights for 2 components"):
        estimate("gdpo", reward_components=torch.ones(6, 2), reward_weights=[1, 2, 3])
    with pytest.raises(ValueError, match=r"reward_components must be \[B, K\] with B=6"):
        estimate("gdpo", reward_components=torch.ones(6))


OTB_MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
OTB_IDS = ["g", "g", "s"]  # s: a single trajectory


def otb(name, mask, sum_pi_squared, **kw):
    rewards = outcome_rewards([1.0, 2.0, 0.7], mask)
    old = torch.full(mask.shape, 0.5).log()  # w = 1 - 2 * .5 + Σπ² = Σπ²
    return estimate(name, rewards, mask, group_ids=OTB_IDS, old_log_probs=old,
                    sum_pi_squared=sum_pi_squared, **kw)  # fmt: skip


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_hand_values(name):
    # w: .5 on row 0, 1 on row 1 -> W = [.5, 1] and [1, 2, 3]; G = [1, 1] and [2, 2, 2]
    # B_0 = (1 * .5 + 2 * 1) / 1.5 = 5/3, B_1 = (1 * 1 + 2 * 2) / 3 = 5/3; past row 0's end
    # only row 1 is left: no baseline (zero tail), or its own return (advantage 0)
    spsq = torch.tensor([[0.5] * 4, [1.0] * 4, [0.3] * 4])
    adv, returns = otb(name, OTB_MASK, spsq)
    b = 5 / 3
    expected = [[1 - b, 1 - b, 0, 0], [2 - b, 2 - b, 2, 0], [0.7, 0.7, 0, 0]]
    assert_close(adv, torch.tensor(expected))
    assert_close(returns, torch.tensor([[1.0, 1, 0, 0], [2, 2, 2, 0], [0.7, 0.7, 0, 0]]))
    adv, _ = otb(name, OTB_MASK, spsq, handle_zero_tail=False)
    assert_close(adv[1, 2], torch.tensor(0.0), atol=1e-6, rtol=0)
    # importance weights scale w by ρ²: ρ = 2 on row 0 makes it weigh as much as row 1
    adv, _ = otb(
        name, OTB_MASK, spsq, rollout_is_weights=torch.tensor([[2.0] * 4, [1.0] * 4, [1.0] * 4])
    )
    b0, b1 = (1 * 2 + 2 * 1) / 3, (1 * 4 + 2 * 2) / 6
    assert_close(adv[0, :2], torch.tensor([1 - b0, 1 - b1]))


def test_optimal_token_baselines_align_gaps_differently():
    # row 1 has tool output at column 1; w = 1 everywhere: W = [1, 2] and [1, -, 2, 3]
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    spsq = torch.ones(mask.shape)
    # by column: at column 1 only row 0 is valid (baseline its own return); at columns 2-3
    # only row 1, the unique longest (3 tokens vs 2): zero tail from column 2
    adv, _ = otb("optimal_token_baseline", mask, spsq)
    assert_close(adv[:2], torch.tensor([[-0.5, 0.0, 0, 0], [0.5, 0, 2, 2]]))
    # by the model's tokens: row 1's 2nd token (column 2) meets row 0's 2nd (column 1):
    # B = (1 * 2 + 2 * 2) / 4 = 1.5; its 3rd token is past row 0's end
    adv, _ = otb("tir_optimal_token_baseline", mask, spsq)
    assert_close(adv[:2], torch.tensor([[-0.5, -0.5, 0, 0], [0.5, 0, 0.5, 2]]))


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_says_what_is_missing(name):
    with pytest.raises(ValueError, match=f"{name} needs old_log_probs and sum_pi_squared"):
        estimate(name)


# --------------------------------------------------------------------------- treadle check


def test_check_refuses_configs_the_new_estimators_cannot_run():
    from treadle.check import check_algorithm
    from treadle.config import load_config
    from treadle.runtime.errors import ConfigError

    def problems(*overrides: str) -> str:
        try:
            check_algorithm(load_config(None, list(overrides)), "train")
        except ConfigError as e:
            return str(e)
        return ""

    assert "gdpo normalizes each component" in problems("algorithm.adv_estimator=gdpo")
    assert problems("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]") == ""
    assert "rollout.n=1 makes groups of one" in problems(
        "algorithm.adv_estimator=grpo_passk", "rollout.n=1", "actor.ppo_mini_batch_size=8"
    )
    for name in ["optimal_token_baseline", "tir_optimal_token_baseline"]:
        assert problems(f"algorithm.adv_estimator={name}") == ""
        assert "actor.recompute_old_log_probs=false skips" in problems(
            f"algorithm.adv_estimator={name}", "actor.recompute_old_log_probs=false"
        )
    with pytest.raises(ConfigError, match=r"gdpo_reward_weights has 1 weights for 2"):
        load_config(None, ["algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1]"])
    with pytest.raises(ConfigError, match=r"gdpo_reward_keys lists a key twice"):
        load_config(None, ["algorithm.gdpo_reward_keys=[a,a]"])


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_a_name_an_estimator_does_not_take_is_an_error(name):
    with pytest.raises(TypeError, match="some_future_option"):
        estimate(name, some_future_option=1)
    with pytest.raises(TypeError, match="some_future_input"):
        EstimatorInputs(outcome_rewards(), MASK, GROUPS, some_future_input=1)  # type: ignore[call-arg]


# --------------------------------------------------------------------------- split trajectories


@pytest.mark.parametrize(
    "name", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "gpg", "gdpo"]
)
def test_a_trajectory_split_into_segments_weighs_as_one(name):
    """Group "a" is three trajectories scored 1, 0, 0.5; the first was split into two
    segments (two rows, one trajectory id). With its weights each segment gets the advantage
    the unsplit trajectory gets (the whitening estimators: its group statistics are the
    unsplit group's); without them the split trajectory counts twice."""
    whole, _ = estimate(name)
    rows = [0, 0, 1, 2, 3, 4, 5]  # the first row is split: its two segments
    mask = MASK[rows]
    rewards = outcome_rewards([SCORES[i] for i in rows], mask)
    groups = [GROUPS[i] for i in rows]
    weights = trajectory_weights(groups, [0, 0, 1, 2, 3, 4, 5])
    assert weights is not None and weights.tolist() == [0.5, 0.5, 1, 1, 1, 1, 1]
    split, _ = estimate(name, rewards, mask, group_ids=groups, sample_weights=weights)
    counted_twice, _ = estimate(name, rewards, mask, group_ids=groups)
    per_row = lambda adv: (adv.sum(-1) / mask.sum(-1)).tolist()  # noqa: E731
    per_whole = (whole.sum(-1) / MASK.sum(-1)).tolist()
    if name in ("reinforce_plus_plus_baseline", "gdpo"):  # whitened over the batch's tokens
        # the trajectory scored 0.5 is its group's mean (1, 0, 0.5): centred 0 before the
        # whitening, as the rows of the all-equal group "c" are
        assert per_row(split)[3] == pytest.approx(per_row(split)[5])
        assert per_row(counted_twice)[3] != pytest.approx(per_row(counted_twice)[5])
    else:  # (gpg's factor B / nonzero counts rows, as its loss does: compared up to it)
        scale = 7 / 4 / 2 if name == "gpg" else 1.0
        assert per_row(split) == pytest.approx([per_whole[i] * scale for i in rows])
    assert per_row(counted_twice)[:4] != pytest.approx(per_row(split)[:4])


def test_trajectory_weights_are_none_when_nothing_is_split():
    assert trajectory_weights(["a", "a", "b"], [0, 1, 0]) is None
    # the same trajectory number in two groups is two trajectories
    assert trajectory_weights(["a", "b"], [0, 0]) is None
