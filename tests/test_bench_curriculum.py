"""bench/curriculum.py without running it (it trains for an hour): every stage's config passes
the config and algorithm checks of its command, the arms differ only in how prompts are drawn,
and the table's standard errors are the ones it says."""

from __future__ import annotations

import argparse
import math

import pytest
from bench_scripts import bench_script

from treadle.config import load_config
from treadle.config.rules import check_algorithm


@pytest.fixture(scope="module")
def bench():
    with bench_script("curriculum") as module:
        yield module


@pytest.mark.parametrize("size", ["full", "medium", "small", "tiny"])
def test_every_stage_config_passes_its_commands_checks(bench, size, tmp_path):
    args = argparse.Namespace(size=size, model=tmp_path, engine="vllm", bf16=False)
    sft = load_config(bench.config(args, bench.MIX, tmp_path / "sft", "sft"))
    check_algorithm(sft, "sft")
    arms = {}
    for arm, overrides in bench.ARMS.items():
        cfg = load_config(bench.config(args, bench.MIX, tmp_path / arm, "arm"), overrides)
        check_algorithm(cfg, "train")
        arms[arm] = cfg
    s = bench.SIZES[size]
    assert arms["uniform"].data.sampler == "uniform" and not arms["uniform"].algorithm.filter_groups
    assert arms["dynamic"].algorithm.filter_groups and arms["pass_rate"].data.sampler == "pass_rate"
    # the arms share the held-out rows with the warm start and draw from rows of their own
    assert sft.data.reasoning_gym.val_seed == arms["uniform"].data.reasoning_gym.val_seed
    assert sft.data.reasoning_gym.val_size == arms["uniform"].data.reasoning_gym.val_size == s.val
    assert arms["uniform"].data.reasoning_gym.seed != sft.data.reasoning_gym.seed
    # everything else is the same in every arm
    plain = {arm: cfg.model_dump() for arm, cfg in arms.items()}
    for cfg in plain.values():
        cfg["trainer"]["output_dir"] = ""
        cfg["data"]["sampler"] = "uniform"
        cfg["algorithm"]["filter_groups"] = False
    assert plain["uniform"] == plain["dynamic"] == plain["pass_rate"]


def test_the_standard_error_is_across_seeds_or_binomial_for_one(bench):
    size = bench.SIZES["full"]
    run = {"step": 40, "bench/rollouts": 2560, "wall_s": 100.0}
    one = bench.summary("uniform", [{**run, "eval/val/accuracy": 0.3}], size)
    assert one["se"] == pytest.approx(math.sqrt(0.3 * 0.7 / size.val))
    runs = [{**run, "eval/val/accuracy": a} for a in (0.3, 0.4, 0.5)]
    three = bench.summary("uniform", runs, size)
    assert three["accuracy"] == pytest.approx(0.4)
    assert three["se"] == pytest.approx(0.1 / math.sqrt(3))  # sample sd 0.1 over 3 seeds
    assert three["rollouts"] == 2560 and math.isnan(three["datasets"]["products"])
