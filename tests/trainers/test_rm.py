"""`treadle rm`: a Bradley-Terry reward model on the tiny task's pairs, end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from treadle.cli import main
from treadle.config import Config, load_config
from treadle.data import ResumableSampler
from treadle.models.loading import load_value_model
from treadle.tracking.tracker import read_metrics
from treadle.trainers.pairs import load_pairs
from treadle.trainers.rm import rm


def plain_score(model, prompt: list[int], response: list[int]) -> float:
    """The reward of prompt + response: the value model's output at its last token."""
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([prompt + response])).logits[0, -1, 0])


def plain_first_step_grad_norm(cfg: Config) -> float:
    """Gradient norm of the mean Bradley-Terry loss over the first batch, computed plainly."""
    ds = load_pairs(cfg, cfg.data.train_files, "data.train_files")
    indices = ResumableSampler(len(ds), cfg.data.batch_size, cfg.trainer.seed).next_indices()
    model = load_value_model(cfg.model.path)

    def score(prompt: list[int], response: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([prompt + response])).logits[0, -1, 0]

    rows = [ds[i] for i in indices]
    chosen = torch.stack([score(r["prompt_ids"], r["chosen_ids"]) for r in rows])
    rejected = torch.stack([score(r["prompt_ids"], r["rejected_ids"]) for r in rows])
    (-F.logsigmoid(chosen - rejected)).mean().backward()
    grads = [p.grad.norm() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(grads)))


@pytest.mark.slow
def test_rm_recipe_trains_and_exports_a_value_model(tiny_task, tmp_path, capsys):
    out = tmp_path / "rm"
    overrides = [
        f"model.path={tiny_task['model']}",
        f"data.train_files=[{tiny_task['pairs_train']}]",
        f"data.val_files=[{tiny_task['pairs_test']}]",
        "data.batch_size=8",
        "data.val_size=6",
        "rollout.max_new_tokens=24",
        "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=3",
        "actor.lr=1e-3",
        "trainer.backend=local",
        "trainer.total_steps=2",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
    ]
    assert main(["rm", "examples/arithmetic/rm.yaml", *overrides]) == 0
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    # A zero-initialised head scores every response 0: each pair tied, loss ln 2.
    assert metrics[0]["rm/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics[0]["rm/accuracy"] == 0.0 and metrics[0]["rm/chosen_score"] == 0.0
    cfg = load_config("examples/arithmetic/rm.yaml", overrides)
    # Micro-batches of 3 + 3 + 2 pairs add up to the gradient of the batch's mean loss.
    assert metrics[0]["rm/grad_norm"] == pytest.approx(plain_first_step_grad_norm(cfg), rel=1e-4)
    assert metrics[1]["rm/chosen_score"] != 0.0
    assert "held-out pair accuracy:" in capsys.readouterr().out
    # final_model is a value model; its scores, computed plainly at the last token of
    # prompt + response, give the held-out accuracy and margin the run logged at step 2.
    folder = out / "final_model"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"][0].endswith("ForTokenClassification")
    model = load_value_model(folder)
    rows = load_pairs(cfg, cfg.data.val_files, "data.val_files").rows[:6]
    chosen = [plain_score(model, r["prompt_ids"], r["chosen_ids"]) for r in rows]
    rejected = [plain_score(model, r["prompt_ids"], r["rejected_ids"]) for r in rows]
    assert any(c != 0.0 for c in chosen)
    accuracy = sum(c > r for c, r in zip(chosen, rejected, strict=True)) / 6
    margin = sum(c - r for c, r in zip(chosen, rejected, strict=True)) / 6
    assert metrics[1]["eval/pair_accuracy"] == accuracy
    assert metrics[1]["eval/margin"] == pytest.approx(margin, rel=1e-4, abs=1e-6)
    # The same command with one more step resumes: the trained head, not a fresh zero one.
    assert main(["rm", "examples/arithmetic/rm.yaml", *overrides, "trainer.total_steps=3"]) == 0
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[2]["rm/chosen_score"] != 0.0
    assert metrics[2]["rm/loss"] != pytest.approx(math.log(2), abs=1e-5)


@pytest.mark.slow
def test_rm_two_ranks_normalise_exactly(tiny_task, ray_session, tmp_path):
    cfg = load_config(
        "examples/arithmetic/rm.yaml",
        [
            f"model.path={tiny_task['model']}",
            f"data.train_files=[{tiny_task['pairs_train']}]",
            "data.val_files=[]",
            "trainer.eval_every=0",  # (nothing to evaluate)
            "data.batch_size=8",
            "rollout.max_new_tokens=24",
            "actor.world_size=2",
            "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size=3",  # 4 pairs a rank: 3 + 1
            "trainer.num_cpus=2",
            "trainer.total_steps=1",
            "trainer.progress=false",
            f"trainer.output_dir={tmp_path / 'rm2'}",
        ],
    )
    metrics = rm(cfg)
    assert metrics["rm/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["rm/grad_norm"] == pytest.approx(plain_first_step_grad_norm(cfg), rel=1e-4)
    saved = json.loads((tmp_path / "rm2" / "final_model" / "config.json").read_text())
    assert saved["architectures"][0].endswith("ForTokenClassification")
