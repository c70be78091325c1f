"""The curriculum (data.sampler=pass_rate) in a whole RL run on the tiny model, local backend:
its data/pool_* metrics, its state in the checkpoint, and a run resumed after step 2 drawing
the prompts of step 3 that the uninterrupted run drew."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_runs

from treadle.config import load_config
from treadle.tracking.tracker import read_metrics
from treadle.trainers.rl import train

PROMPTS, SAMPLES = 4, 4
POOL = ("seen", "learning", "solved", "unsolved")


def config(task, out: Path, steps: int, reward: str):  # type: ignore[no-untyped-def]
    return load_config(
        None,
        tiny_runs.overrides(
            task,
            out,
            "trainer.backend=local",
            "data.sampler=pass_rate",
            "data.pass_rate_threshold=0.5",  # the length reward's scores spread over 0..1
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=8",
            f"reward.function={reward}",
            f"trainer.total_steps={steps}",
            "trainer.save_every=1",
            "trainer.log_samples_every=1",
            f"trainer.log_samples={PROMPTS * SAMPLES}",  # every sample: the prompts drawn
            prompts=PROMPTS,
            samples=SAMPLES,
        ),
    )


def drawn(out: Path) -> dict[int, list[str]]:
    """Each step's prompts (one per sample), sorted."""
    steps: dict[int, list[str]] = {}
    for line in (out / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], []).append(row["prompt"])
    return {step: sorted(prompts) for step, prompts in steps.items()}


def sampler_state(out: Path, step: int) -> dict:
    return json.loads((out / f"checkpoints/step_{step}/state.json").read_text())["sampler"]


@pytest.mark.slow
def test_a_resumed_curriculum_draws_what_the_uninterrupted_run_draws(
    tiny_task, length_reward, tmp_path
):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(config(tiny_task, straight, 3, length_reward))
    train(config(tiny_task, resumed, 2, length_reward))
    train(config(tiny_task, resumed, 3, length_reward))
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in b] == [1, 2, 3] and "startup/resume" in b[2]
    # the pool's metrics, every step; after step 1 its 4 prompts are seen
    for m in a:
        assert {f"data/pool_{k}" for k in (*POOL, "pass_rate")} <= m.keys()
        parts = sum(m[f"data/pool_{k}"] for k in POOL[1:])
        assert parts == pytest.approx(m["data/pool_seen"]) and 0 <= m["data/pool_pass_rate"] <= 1
    # the curriculum's state is in every checkpoint: draws and the pass rates seen
    state = sampler_state(straight, 3)
    assert state["kind"] == "pass_rate" and state["draws"] == 3
    assert a[0]["data/pool_seen"] == pytest.approx(PROMPTS / state["n"])
    assert 4 <= len(state["seen"]) == len(state["rates"]) <= 12
    # the resumed run drew step 3's prompts as the uninterrupted run did, and learned the same
    assert drawn(resumed) == drawn(straight)
    assert sampler_state(resumed, 3) == state
    for key in ("reward/mean", "data/pool_pass_rate", "data/pool_learning"):
        assert b[-1][key] == pytest.approx(a[-1][key], rel=1e-6), key
