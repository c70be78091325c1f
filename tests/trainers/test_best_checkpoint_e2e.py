"""trainer.keep_best and trainer.final_model=best on a tiny RL run (local backend), across a
resume: each checkpoint's state.json holds its step's eval metrics, the best of the first
process is still kept by the second, and final_model is the best checkpoint's model."""

from __future__ import annotations

import json

import pytest
import tiny_runs
import torch
from safetensors.torch import load_file

METRIC = "eval/val/accuracy"

# An even-length response scores FULL (1.0 in the first process: some held-out prompts are
# "right"; 0.5 in the second: none is), an odd one 0: the rewards vary, so the weights move.
REWARD = """import os

def score(prompt, response, ground_truth):
    return float(os.environ["FULL"]) if len(response) % 2 == 0 else 0.0
"""


@pytest.mark.slow
def test_the_best_checkpoint_outlives_keep_last_and_a_resume(
    tiny_task, tmp_path, monkeypatch, capsys
):
    reward = tmp_path / "parity.py"
    reward.write_text(REWARD)
    out = tmp_path / "run"
    keys = (
        f"data.val_files=[{tiny_task['test']}]",
        "data.val_size=8",
        "data.max_prompt_length=64",
        "rollout.max_new_tokens=16",
        "trainer.backend=local",
        "trainer.save_every=1",
        "trainer.eval_every=1",
        "trainer.keep_last=1",
        f"trainer.keep_best={METRIC}",
        "trainer.final_model=best",
        "reward.num_workers=0",
        f"reward.function={reward}:score",
    )
    monkeypatch.setenv("FULL", "1.0")
    code, _ = tiny_runs.train(
        out, tiny_runs.overrides(tiny_task, out, *keys, "trainer.total_steps=2")
    )
    assert code == 0
    capsys.readouterr()
    monkeypatch.setenv("FULL", "0.5")
    code, rows = tiny_runs.train(
        out, tiny_runs.overrides(tiny_task, out, *keys, "trainer.total_steps=4")
    )
    assert code == 0

    metrics = {m["step"]: m for m in rows}
    first = [metrics[1][METRIC], metrics[2][METRIC]]
    assert max(first) > 0 and metrics[3][METRIC] == metrics[4][METRIC] == 0.0
    best = 1 if first[0] >= first[1] else 2  # the earlier one on a tie
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == [f"step_{best}", "step_4"]
    for step in (best, 4):
        state = json.loads((out / f"checkpoints/step_{step}/state.json").read_text())
        assert state["eval"][METRIC] == metrics[step][METRIC]
    final = load_file(str(out / "final_model" / "model.safetensors"))
    for step, same in ((best, True), (4, False)):
        saved = load_file(str(out / f"checkpoints/step_{step}/model/model.safetensors"))
        assert all(torch.equal(final[k], saved[k]) for k in final) == same, step
    said = f"final model: {out / 'final_model'} (the best checkpoint, step_{best}: {METRIC}="
    assert f"{said}{metrics[best][METRIC]})" in capsys.readouterr().out
