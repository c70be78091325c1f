"""A run that cannot learn says so: groups built to be equal (a reward constant for each prompt)
give 100% equal groups, no token with a non-zero advantage, no update, and the report's
sentence. Local backend, one step of the tiny model."""

from __future__ import annotations

import json
import math

import pytest
import tiny_runs

from treadle.cli import main


@pytest.fixture
def per_prompt_reward(tmp_path):
    """1 for a prompt whose answer is even, 0 for one whose answer is odd, whatever the
    response: every group's samples get the same reward, the batch's rewards differ."""
    path = tmp_path / "parity.py"
    path.write_text(
        "def score(prompt, response, ground_truth):\n    return float(int(ground_truth) % 2 == 0)\n"
    )
    return f"{path}:score"


def test_equal_groups_show_in_metrics_and_report(tiny_task, per_prompt_reward, tmp_path):
    out = tmp_path / "run"
    code, metrics = tiny_runs.train(
        out,
        tiny_runs.overrides(
            tiny_task,
            out,
            "trainer.backend=local",
            "rollout.engine=hf",
            "trainer.total_steps=1",
            "trainer.eval_every=1",
            f"data.val_files=[{tiny_task['test']}]",
            "data.val_size=8",
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=4",
            f"reward.function={per_prompt_reward}",
            prompts=4,
            samples=2,
        ),
    )
    assert code == 0
    (m,) = metrics
    assert m["reward/frac_zero_std"] == 1.0 and m["reward/group_std"] == 0.0
    assert m["advantages/nonzero_frac"] == 0.0
    assert m["actor/update_ratio"] == 0.0  # no gradient: AdamW moved nothing
    assert "actor/ppo_kl" in m and "actor/kl" not in m  # algorithm.kl_coef=0: no reference
    # held-out: the share of the first 8 test answers that are even, and its binomial error
    rows = [json.loads(line) for line in tiny_task["test"].read_text().splitlines()[:8]]
    p = sum(int(r["answer"]) % 2 == 0 for r in rows) / 8
    assert m["eval/val/accuracy"] == p
    assert m["eval/val/accuracy/stderr"] == pytest.approx(math.sqrt(p * (1 - p) / 8))
    assert main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "<h2>Is it learning?</h2>" in page
    assert (
        "<li>100% of groups had equal rewards (mean over 1 step): their advantages are 0, "
        "nothing to learn from them; raise rollout.n or rollout.temperature, or use dynamic "
        "sampling (algorithm.filter_groups=true).</li>"
    ) in page
    assert "<li>0% of response tokens had a non-zero advantage (mean over 1 step" in page
    assert "No reference model is loaded" in page
    assert "raise actor.lr" not in page  # the update was 0 for want of a signal, not of lr
