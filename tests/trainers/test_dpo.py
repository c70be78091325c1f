"""DPO through the real worker and the `treadle dpo` command, on the tiny task.

The worker's sequence log-probs and its gradient are checked against a plain transformers
implementation written here; the loss at step 0 (policy = reference) is ln 2.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from treadle.cli import main
from treadle.config import Config, load_config
from treadle.models.loading import load_causal_lm
from treadle.tracking.tracker import read_metrics
from treadle.trainers.pairs import load_pairs, pair_batch
from treadle.trainers.roles import build_actors

BETA = 0.2


def dpo_config(task, *overrides: str) -> Config:
    return load_config(
        "examples/arithmetic/dpo.yaml",
        [
            f"model.path={task['model']}",
            f"data.train_files=[{task['pairs_train']}]",
            f"data.val_files=[{task['pairs_test']}]",
            "data.batch_size=8",
            "data.val_size=4",
            "rollout.engine=hf",  # the session's one in-process vLLM engine serves another model
            "rollout.max_new_tokens=24",
            "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size=3",  # uneven micro-batches: 3 + 3 + 2 pairs
            f"dpo.beta={BETA}",
            "dpo.nll_coef=0",  # the plain DPO loss unless a test adds the NLL term
            "trainer.progress=false",
            *overrides,
        ],
    )


def plain_sequence_logp(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logp = F.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    picked = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    return picked[-len(response) :].sum()


def plain_step_zero(task, nll_coef: float = 0.0) -> dict:
    """Log-probs and the DPO (+ NLL) gradient norm at step 0 of the first 8 pairs, plainly."""
    cfg = dpo_config(task)
    rows = load_pairs(cfg, cfg.data.train_files, "data.train_files").rows[:8]
    model = load_causal_lm(task["model"])
    chosen = torch.stack(
        [plain_sequence_logp(model, r["prompt_ids"], r["chosen_ids"]) for r in rows]
    )
    rejected = torch.stack(
        [plain_sequence_logp(model, r["prompt_ids"], r["rejected_ids"]) for r in rows]
    )
    h = (chosen - chosen.detach()) - (rejected - rejected.detach())  # the reference = the policy
    nll = -chosen.sum() / sum(len(r["chosen_ids"]) for r in rows)  # token-mean over the batch
    ((-F.logsigmoid(BETA * h)).mean() + nll_coef * nll).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return {
        "chosen": chosen.detach(),
        "rejected": rejected.detach(),
        "grad_norm": float(norm),
        "nll": float(nll.detach()),
    }


@pytest.fixture(scope="module")
def plain(tiny_task):
    return plain_step_zero(tiny_task)


def run_worker_step(cfg: Config) -> tuple[dict, dict]:
    ds = load_pairs(cfg, cfg.data.train_files, "data.train_files")
    batch = pair_batch(ds, range(8))
    actors = build_actors(cfg, cfg.model.path, with_ref=True)
    try:
        ref = actors.group.compute_ref_pair_log_probs(batch)
        policy = actors.group.compute_pair_log_probs(batch)
        metrics = actors.group.train_dpo(batch.union(ref))
    finally:
        actors.close()
    return {**ref.tensors, **policy.tensors}, metrics


def check_step_zero(logps: dict, metrics: dict, plain: dict) -> None:
    torch.testing.assert_close(logps["chosen_logps"], plain["chosen"], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(logps["rejected_logps"], plain["rejected"], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(logps["ref_chosen_logps"], logps["chosen_logps"])
    assert metrics["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["dpo/reward_accuracy"] == 0.0  # every pair tied
    assert metrics["dpo/margin"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["dpo/chosen_logp"] == pytest.approx(float(plain["chosen"].mean()), rel=1e-5)
    assert metrics["dpo/nll"] == pytest.approx(plain["nll"], rel=1e-5)
    # Micro-batches (and ranks) add up to the gradient of the mean loss over all 8 pairs.
    assert metrics["dpo/grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)


def test_dpo_step_zero_is_ln2_with_the_plain_gradient(tiny_task, plain):
    logps, metrics = run_worker_step(dpo_config(tiny_task, "trainer.backend=local"))
    check_step_zero(logps, metrics, plain)


def test_dpo_nll_term_adds_the_chosen_token_mean_nll(tiny_task):
    cfg = dpo_config(tiny_task, "trainer.backend=local", "dpo.nll_coef=0.5")
    logps, metrics = run_worker_step(cfg)
    check_step_zero(logps, metrics, plain_step_zero(tiny_task, nll_coef=0.5))


@pytest.mark.slow
def test_dpo_two_ranks_normalise_exactly(tiny_task, ray_session, plain):
    cfg = dpo_config(tiny_task, "actor.world_size=2", "trainer.num_cpus=2")
    logps, metrics = run_worker_step(cfg)  # 4 pairs a rank: micro-batches of 3 + 1
    check_step_zero(logps, metrics, plain)


@pytest.mark.slow
def test_dpo_recipe_runs_evaluates_exports_and_resumes(tiny_task, tmp_path, capsys):
    out = tmp_path / "dpo"
    args = [
        "dpo",
        "examples/arithmetic/dpo.yaml",
        f"model.path={tiny_task['model']}",
        f"data.train_files=[{tiny_task['pairs_train']}]",
        f"data.val_files=[{tiny_task['pairs_test']}]",
        "data.batch_size=8",
        "data.val_size=4",
        "rollout.engine=hf",
        "rollout.max_new_tokens=24",
        "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=8",
        "actor.lr=1e-3",
        "trainer.backend=local",
        "trainer.total_steps=2",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
    ]
    assert main(args) == 0
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics[1]["dpo/loss"] != pytest.approx(math.log(2), abs=1e-4)  # the policy moved
    assert metrics[1]["dpo/chosen_reward"] != 0.0
    assert {"eval/pair_accuracy", "eval/margin", "eval/val/accuracy"} <= metrics[1].keys()
    printed = capsys.readouterr().out
    assert "held-out pair accuracy:" in printed and "held-out accuracy:" in printed
    before = load_file(str(tiny_task["model"] / "model.safetensors"))
    after = load_file(str(out / "final_model" / "model.safetensors"))
    assert all(not torch.equal(before[k], after[k]) for k in before)
    # The same command with one more step resumes from step 2; the reference stays model.path.
    assert main([*args, "trainer.total_steps=3"]) == 0
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[2]["dpo/chosen_reward"] != 0.0  # measured against the initial policy
    assert (out / "checkpoints" / "step_3" / "optimizer.safetensors").is_file()


def test_dpo_start_up_errors(tiny_task, tmp_path, capsys):
    out = tmp_path / "bad"
    common = [f"model.path={tiny_task['model']}", f"trainer.output_dir={out}"]
    # A file of prompts, not pairs: named, with the keys to set; nothing started or written.
    code = main(
        ["dpo", "examples/arithmetic/dpo.yaml", *common, f"data.train_files=[{tiny_task['train']}]"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert f"data.train_files: {tiny_task['train']} has no column 'chosen'" in err
    assert "data.chosen_key" in err and "data.rejected_key" in err
    assert not out.exists()
    code = main(["dpo", "examples/arithmetic/dpo.yaml", *common, "dpo.loss_type=hing"])
    assert code == 2
    err = capsys.readouterr().err
    assert "dpo.loss_type: unknown name 'hing'; valid: aot, " in err
    assert "(did you mean 'hinge'?)" in err
