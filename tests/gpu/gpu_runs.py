"""What tests/gpu shares: the marks, the two precisions, a run on the CPU of the GPU machine,
and one actor step on a fixed batch (the GPU-against-CPU comparison's two sides).

``python tests/gpu/gpu_runs.py step MODEL TRAIN OUT MIXED RESULT`` runs :func:`step_outputs`
and writes its tensors to ``RESULT`` (safetensors): the CPU side, run by :func:`on_cpu`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# bf16 mixed precision (float32 weights and optimizer, bf16 matrix products, a bf16 rollout
# engine) and pure bf16 (the weights, the optimizer's state and the rollout in bf16)
PRECISIONS: dict[str, tuple[str, ...]] = {
    "bf16_mixed": ("actor.mixed_precision=bf16", "rollout.dtype=bfloat16"),
    "bf16": ("model.dtype=bfloat16",),
}


def on_cpu(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python args...`` with no GPU visible (in a process that sees one, FSDP2's default
    device mesh is the GPU's whatever the worker's device), from the repository root with the
    tests' modules importable; its output captured."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    paths = [str(ROOT), str(TESTS), str(TESTS / "gpu"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# ----------------------------------------------------------------------------- one step


def fixed_batch(vocab: int, rows: int = 8, prompt: int = 6, response: int = 5):
    """Left-padded prompts and right-padded responses of random ids (seed 0), with random
    advantages: the same numbers on every machine."""
    from treadle.protocol import Batch

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (rows, prompt), generator=g)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    prompt_mask[::3, :2] = 0  # shorter prompts: left padding
    prompts[prompt_mask == 0] = 0
    responses = torch.randint(3, vocab, (rows, response), generator=g)
    response_mask = torch.ones(rows, response, dtype=torch.long)
    response_mask[1::2, 3:] = 0  # shorter responses
    batch = Batch.from_dict(
        tensors={
            "prompts": prompts,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "advantages": torch.randn(rows, response, generator=g) * response_mask,
        }
    )
    batch.meta["step"] = 1
    return batch


def step_outputs(model: str, train: str, out: Path, mixed: bool) -> dict[str, torch.Tensor]:
    """One actor update of GRPO's loss with a KL term and an entropy bonus on
    :func:`fixed_batch`, on this process's device: the log-probs and entropy of the old-policy
    pass, the update's loss, KL, entropy and gradient norm, and every parameter's gradient."""
    import json

    from treadle.config import load_config
    from treadle.trainers.rl import RLTrainer

    keys = [
        f"model.path={model}",
        f"data.train_files=[{train}]",
        "data.val_files=[]",
        "data.batch_size=4",
        "data.max_prompt_length=64",
        "rollout.engine=hf",
        "rollout.n=2",
        "rollout.max_new_tokens=8",
        "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=4",
        "algorithm.kl_coef=0.05",
        "algorithm.entropy_coef=0.01",
        "reward.function=arithmetic",
        "trainer.backend=local",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        *(PRECISIONS["bf16_mixed"][:1] if mixed else ()),
    ]
    trainer = RLTrainer(load_config(None, keys))
    worker = trainer.group.workers[0]  # the local backend: the worker itself
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    grads: dict[str, torch.Tensor] = {}
    step = worker.engine.step

    def capture() -> dict[str, float]:
        for name, p in worker.engine.module.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[f"grad/{name}"] = g.detach().float().cpu()
        return step()

    try:
        batch = fixed_batch(vocab)
        old = trainer.group.compute_log_probs(batch)
        batch["old_log_probs"] = old["old_log_probs"]
        batch["ref_log_probs"] = old["old_log_probs"] - 0.1 * batch["response_mask"]
        worker.engine.step = capture
        metrics = trainer.group.update_actor(batch)
    finally:
        worker.engine.__dict__.pop("step", None)
        trainer.close()
    names = ("actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm")
    return {
        "log_probs": old["old_log_probs"].float(),
        "entropy": old["entropy"].float(),
        **{name: torch.tensor([metrics[name]], dtype=torch.float64) for name in names},
        **grads,
    }


if __name__ == "__main__":
    from safetensors.torch import save_file

    command, model, train, out, mixed, result = sys.argv[1:]
    assert command == "step", command
    outputs = step_outputs(model, train, Path(out), mixed == "1")
    save_file({k: v.contiguous() for k, v in outputs.items()}, result)
