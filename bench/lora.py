"""An actor update with LoRA against full fine-tuning: peak memory, step time, checkpoint size.

    OMP_NUM_THREADS=2 python bench/lora.py [--model smollm2|tiny] [--rank 16]
        [--seqs 16] [--prompt 64] [--response 64] [--micro 8] [--repeats 3]

Each variant runs in a process of its own (so peak memory is its own): it builds treadle's
actor worker (``ActorRolloutRefWorker`` through a local-backend group, FSDP2 on one rank),
times ``update_actor`` on the same batch of random token ids (median of ``--repeats`` after
one warm-up), then writes a checkpoint. Reported per variant: trainable parameters, step
seconds, peak memory (the process's peak RSS on CPU; ``torch.cuda.max_memory_allocated``
on a GPU), the checkpoint's size on disk. The variants: ``full`` (every parameter trains)
and ``lora`` (``actor.lora.rank=--rank``, alpha = 2 x rank, every linear layer of the
decoder); the last lines are the lora/full ratios of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # under treadle's .venv, set up when missing (bench/_env.py)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _env import ensure_project_python

    ensure_project_python()

import torch

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def make_batch(vocab: int, args: argparse.Namespace):
    from treadle.protocol import Batch

    g = torch.Generator().manual_seed(0)
    n, p, r = args.seqs, args.prompt, args.response
    return Batch.from_dict(
        tensors={
            "prompts": torch.randint(3, vocab, (n, p), generator=g),
            "prompt_mask": torch.ones(n, p, dtype=torch.long),
            "responses": torch.randint(3, vocab, (n, r), generator=g),
            "response_mask": torch.ones(n, r, dtype=torch.long),
            "old_log_probs": -torch.rand(n, r, generator=g) * 5,
            "advantages": torch.randn(n, r, generator=g),
        },
        meta={"step": 1},
    )


def child(args: argparse.Namespace) -> dict[str, float]:
    """One variant, in this process: its numbers."""
    from transformers import AutoConfig

    from treadle.config import load_config
    from treadle.trainers.roles import build_actors

    path = Path(args.path)
    lora = [f"actor.lora.rank={args.rank}", f"actor.lora.alpha={2 * args.rank}"]
    cfg = load_config(
        None,
        [
            f"model.path={path}",
            "trainer.backend=local",
            f"trainer.threads_per_rank={torch.get_num_threads()}",
            "algorithm.kl_coef=0",
            f"data.batch_size={args.seqs}",
            "rollout.n=1",
            f"actor.ppo_mini_batch_size={args.seqs}",
            f"actor.micro_batch_size={args.micro}",
            "actor.lr=1e-6",
            *(lora if args.child == "lora" else []),
        ],
    )
    batch = make_batch(AutoConfig.from_pretrained(path).vocab_size, args)
    actors = build_actors(cfg, str(path), with_ref=False)
    try:
        worker = actors.group.workers[0]
        trainable = sum(p.numel() for p in worker.actor.params)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        actors.group.update_actor(batch)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            actors.group.update_actor(batch)
            times.append(time.perf_counter() - start)
        peak = (
            torch.cuda.max_memory_allocated() / 2**20
            if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
        with tempfile.TemporaryDirectory() as tmp:
            actors.group.save_checkpoint(tmp)
            size = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
    finally:
        actors.close()
    return {
        "trainable": trainable,
        "step_s": statistics.median(times),
        "peak_mb": peak,
        "checkpoint_mb": size / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        from _env import model_folder

        path = model_folder(args.model, Path(tmp))
        for variant in ("full", "lora"):
            run = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--child", variant, "--path", str(path)],
                check=False,
                capture_output=True,
                text=True,
            )
            if run.returncode:
                sys.exit(f"{variant}: exit {run.returncode}\n{run.stderr[-3000:]}")
            rows[variant] = json.loads(run.stdout.strip().splitlines()[-1])
    memory = "peak GPU MiB" if torch.cuda.is_available() else "peak RSS MiB"
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(
        f"{args.model}, {where}, {torch.get_num_threads()} threads, {args.seqs} sequences of "
        f"{args.prompt}+{args.response} tokens, micro-batch {args.micro}, rank {args.rank}"
    )
    print(f"| variant | trainable params | step s | {memory} | checkpoint MiB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(
            f"| {name} | {r['trainable']:,} | {r['step_s']:.2f} | {r['peak_mb']:.0f} "
            f"| {r['checkpoint_mb']:.1f} |"
        )
    full, lora = rows["full"], rows["lora"]
    for key in ("step_s", "peak_mb", "checkpoint_mb"):
        print(f"ratio {key} lora/full: {lora[key] / full[key]:.3f}")


if __name__ == "__main__":
    main()
