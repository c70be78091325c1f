"""The curriculum (data.sampler=pass_rate, treadle.data.curriculum): the rule against numbers
worked by hand, draws that follow the weights, its state through JSON, the synchronous source
handing it every group's scores, and the config rules that refuse what makes no sense."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from treadle.config import load_config
from treadle.config.rules import check_algorithm
from treadle.data import PassRateRule, PassRateSampler, PromptDataset, ResumableSampler
from treadle.data.curriculum import (
    group_pass_rate,
    pass_rate_weights,
    pool_metrics,
    updated_rate,
)
from treadle.engines.inference import SamplingParams
from treadle.protocol import Batch
from treadle.rollout.sources import SyncSource
from treadle.rollout.sources.synchronous import drawn_groups
from treadle.runtime.errors import ConfigError, DataError

RULE = PassRateRule()  # threshold 1, ema 0.5, unseen 0.25, floor 0.05, solved 0.01
NAN = math.nan

# --- the rule, by hand ---------------------------------------------------------------------------


def test_the_weights_are_the_learnability_above_a_floor_worked_by_hand():
    rates = np.array([NAN, 0.0, 1.0, 0.5, 0.9, 0.02, 0.1])
    want = [
        0.25,  # never drawn: unseen
        0.05,  # never solved: the floor
        0.01,  # always solved: solved
        0.25,  # 0.5 x 0.5, the most there is
        0.09,  # 0.9 x 0.1 > 0.1 x 0.05 + 0.9 x 0.01 = 0.014
        0.0492,  # 0.02 x 0.98 = 0.0196 < 0.98 x 0.05 + 0.02 x 0.01 = 0.0492
        0.09,  # 0.1 x 0.9 > 0.9 x 0.05 + 0.1 x 0.01 = 0.046
    ]
    np.testing.assert_allclose(pass_rate_weights(rates, RULE), want, rtol=1e-12)
    other = PassRateRule(unseen=1.0, floor=0.2, solved=0.0001)
    np.testing.assert_allclose(
        pass_rate_weights(np.array([NAN, 0.0, 0.5, 1.0]), other), [1.0, 0.2, 0.25, 0.0001]
    )


def test_a_pass_rate_is_the_share_at_the_threshold_folded_into_a_moving_average():
    assert group_pass_rate([1.0, 0.5, 1.0, 0.0], 1.0) == 0.5
    assert group_pass_rate([1.0, 0.5, 1.0, 0.0], 0.5) == 0.75
    assert updated_rate(NAN, 0.75, 0.5) == 0.75  # the first group is the rate
    assert updated_rate(0.5, 1.0, 0.5) == 0.75
    assert updated_rate(0.2, 0.0, 0.25) == pytest.approx(0.15)
    assert updated_rate(0.2, 0.0, 1.0) == 0.0  # ema 1: the latest group alone


def test_the_pool_metrics_worked_by_hand():
    rates = np.array([NAN, 0.0, 1.0, 0.5, 0.9, 0.02, 0.1])
    m = pool_metrics(rates, RULE)
    assert m == pytest.approx(
        {
            "data/pool_seen": 6 / 7,
            "data/pool_learning": 3 / 7,  # 0.5, 0.9, 0.1: weighed by p(1 - p)
            "data/pool_solved": 1 / 7,  # 1.0
            "data/pool_unsolved": 2 / 7,  # 0.0, 0.02: at the floor
            "data/pool_pass_rate": (0 + 1 + 0.5 + 0.9 + 0.02 + 0.1) / 6,
        }
    )
    assert pool_metrics(np.full(3, NAN), RULE) == {  # nothing seen: no mean of nothing
        "data/pool_seen": 0.0,
        "data/pool_learning": 0.0,
        "data/pool_solved": 0.0,
        "data/pool_unsolved": 0.0,
    }


# --- the sampler -------------------------------------------------------------------------------


def _sampler(rates: list[float], batch_size: int = 1, seed: int = 0) -> PassRateSampler:
    sampler = PassRateSampler(len(rates), batch_size, seed, RULE)
    seen = [i for i, r in enumerate(rates) if not math.isnan(r)]
    state = sampler.state_dict()
    sampler.load_state_dict({**state, "seen": seen, "rates": [rates[i] for i in seen]})
    return sampler


def test_draws_follow_the_weights():
    """One prompt a draw, 13,000 draws: Pearson's chi-square against the weights' shares stays
    under the 0.1% critical value of 4 degrees of freedom (18.47); a fixed seed, so it is not
    flaky."""
    rates = [NAN, 0.0, 0.5, 1.0, 0.9]  # weights 0.25, 0.05, 0.25, 0.01, 0.09 (sum 0.65)
    sampler = _sampler(rates)
    draws = 13_000
    counts = np.bincount([sampler.next_indices()[0] for _ in range(draws)], minlength=5)
    expected = draws * np.array([0.25, 0.05, 0.25, 0.01, 0.09]) / 0.65  # 5000, 1000, ..., 1800
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47, (counts, expected)
    # and a uniform sampler's counts are far from these shares
    uniform = np.full(5, draws / 5)
    assert float(((uniform - expected) ** 2 / expected).sum()) > 1000


def test_a_batch_is_distinct_prompts_and_the_heavier_come_more_often():
    sampler = _sampler([0.5] * 4 + [0.0] * 4 + [1.0] * 4, batch_size=4)
    counts = np.zeros(12)
    for _ in range(500):
        batch = sampler.next_indices()
        assert len(set(batch)) == 4
        counts[batch] += 1
    learning, unsolved, solved = counts[:4].sum(), counts[4:8].sum(), counts[8:].sum()
    assert learning > unsolved > solved > 0


def test_observed_groups_move_the_rates_and_failed_runs_move_nothing():
    sampler = PassRateSampler(4, 2, 0, RULE)
    sampler.observe({0: [1.0, 1.0], 1: [0.0, 1.0], 2: []})  # 2: every run failed
    sampler.observe({1: [1.0, 1.0]})
    np.testing.assert_equal(sampler.rates, [1.0, 0.75, NAN, NAN])
    assert sampler.pool_metrics()["data/pool_seen"] == 0.5


def test_the_state_round_trips_through_json_and_a_resumed_sampler_draws_the_same():
    def run(sampler: PassRateSampler, steps: int) -> list[list[int]]:
        out = []
        for _ in range(steps):
            batch = sampler.next_indices()
            # a deterministic outcome per prompt: its pass rate is index / 20
            sampler.observe({i: [1.0] * i + [0.0] * (20 - i) for i in batch})
            out.append(batch)
        return out

    straight = run(PassRateSampler(20, 4, 7, RULE), 6)
    first = PassRateSampler(20, 4, 7, RULE)
    before = run(first, 4)
    state = json.loads(json.dumps(first.state_dict()))  # as state.json keeps it
    resumed = PassRateSampler(20, 4, 7, RULE)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == first.state_dict()
    assert before + run(resumed, 2) == straight


def test_a_checkpoint_of_the_other_sampler_is_refused_with_what_to_do():
    curriculum, uniform = PassRateSampler(10, 2, 0, RULE), ResumableSampler(10, 2, 0)
    with pytest.raises(DataError, match=r"drawn uniformly .* resume with data\.sampler=uniform"):
        curriculum.load_state_dict(uniform.state_dict())
    with pytest.raises(DataError, match=r"by pass rate .* resume with data\.sampler=pass_rate"):
        uniform.load_state_dict(curriculum.state_dict())
    with pytest.raises(DataError, match=r"saved for a dataset of 10 rows, this one has 12"):
        PassRateSampler(12, 2, 0, RULE).load_state_dict(curriculum.state_dict())


# --- the synchronous source hands it every group -------------------------------------------------

PROMPTS, N = 12, 4


def _dataset() -> PromptDataset:
    rows = [
        {"uid": f"p{i}", "prompt_text": "", "prompt_ids": [1], "ground_truth": "", "row": {}}
        for i in range(PROMPTS)
    ]
    return PromptDataset(rows, pad_id=0)  # type: ignore[arg-type]


class EchoRollout:
    """Each prompt's ``n`` samples, one token each; the number of generated samples counted."""

    def __init__(self) -> None:
        self.generated = 0

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        batch = prompts.repeat(params.n, interleave=True)
        batch["responses"] = torch.ones(len(batch), 1, dtype=torch.long)
        batch["response_mask"] = torch.ones(len(batch), 1, dtype=torch.long)
        self.generated += len(batch)
        return batch

    def take_counters(self) -> dict[str, float]:
        return {}


def _score(batch: Batch, m=None) -> torch.Tensor:
    """Prompt i: p0-p3 always pass, p4-p7 never, p8-p11 pass their first two samples of four."""
    scores = []
    for k, uid in enumerate(batch["uid"]):
        i = int(uid.split("/")[0][1:])
        scores.append(1.0 if i < 4 or (i >= 8 and k % N < 2) else 0.0)
    return torch.tensor(scores)[:, None]


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_sync_source_hands_the_sampler_every_group_and_logs_the_pool(dynamic: bool):
    overrides = [f"rollout.n={N}", "data.batch_size=4", "actor.ppo_mini_batch_size=16"]
    if dynamic:  # DAPO's dynamic sampling: the dropped groups tell their pass rate too
        overrides.append("algorithm.filter_groups=true")
    cfg = load_config(None, [*overrides, "data.sampler=pass_rate"])
    sampler, rollout = PassRateSampler(PROMPTS, 4, 0, RULE), EchoRollout()
    source = SyncSource(cfg, rollout, _dataset(), sampler, _score)  # type: ignore[arg-type]
    for step in range(1, 4):
        m: dict[str, float] = {}
        source.sample(step, m)
    seen = ~np.isnan(sampler.rates)
    assert rollout.generated == 4 * N * (sampler.draws)  # every drawn prompt was generated
    want = np.array([1.0] * 4 + [0.0] * 4 + [0.5] * 4)
    np.testing.assert_equal(sampler.rates[seen], want[seen])  # every group observed
    assert m["data/pool_seen"] == seen.sum() / PROMPTS
    assert m["data/pool_solved"] + m["data/pool_unsolved"] + m["data/pool_learning"] == (
        pytest.approx(m["data/pool_seen"])
    )
    if dynamic:  # the filter's rounds drew more: their groups were observed as well
        assert sampler.draws > 3 and m["rollout/gen_rounds"] >= 1


def test_a_split_session_is_one_sample_scored_by_its_best_segment():
    batch = Batch.from_dict(
        tensors={
            "token_level_scores": torch.tensor([[1.0], [0.0], [0.0], [0.0], [1.0]]),
            "sample_index": torch.tensor([0, 1, 1, 2, 3]),  # sample 1: two segments
        },
        objects={"uid": ["a", "a", "a", "b", "b"]},
    )
    got = drawn_groups([5, 9, 3], ["a", "b", "c"], batch)  # c: every run failed
    assert got == {5: [1.0, 0.0], 9: [0.0, 1.0], 3: []}


# --- the rules ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            ["data.sampler=pass_rate", "data.shuffle=false"],
            r"data\.sampler=pass_rate draws prompts at random .* data\.shuffle=false asks for "
            r"the file's order: set data\.shuffle=true, or data\.sampler=uniform",
        ),
        (
            ["data.sampler=pass_rate", "trainer.mode=one_step_off", "rollout.placement=split"],
            r"data\.sampler=pass_rate learns from the groups a step generates, and "
            r"trainer\.mode=one_step_off draws prompts ahead of them: set trainer\.mode=sync",
        ),
        (
            ["data.pass_rate_floor=0.1", "data.pass_rate_ema=1"],
            r"data\.pass_rate_ema=1\.0, data\.pass_rate_floor=0\.1: set data\.sampler=pass_rate",
        ),
        (["data.sampler=pass_rate", "data.pass_rate_floor=0"], r"pass_rate_floor: .* greater"),
    ],
)
def test_the_config_refuses_what_makes_no_sense_in_one_line(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        load_config(None, ["rollout.n=2", "actor.ppo_mini_batch_size=32", *overrides])
    assert len(str(e.value).splitlines()) == 1, str(e.value)


def test_the_commands_without_rollouts_refuse_it():
    cfg = load_config(None, ["data.sampler=pass_rate"])
    with pytest.raises(ConfigError, match=r"data\.sampler=pass_rate is read by treadle train"):
        check_algorithm(cfg, "sft")
    check_algorithm(load_config(None, ["data.sampler=pass_rate"]), "train")
