"""The TRL side of `bench/grpo_vs_trl.py`: GRPO steps with TRL's `GRPOTrainer`, timed per phase.

Run by `grpo_vs_trl.py` with the TRL environment's python (`.venv-trl/`, which has TRL and no
treadle); not meant to be run by hand. It trains `--steps` + `--warmup` optimizer steps on the
rows of `--prompts` (a JSONL file of `prompt`, `answer`; each step takes all of them, so every
step sees the same prompts) and writes one record per step to `--out` as JSON.

TRL runs with its defaults except: `use_cpu=True` (on `--device cuda`, the GPU; then each step
record has its peak device memory, `max_memory_allocated` and `max_memory_reserved` in bytes,
the counters reset as the step begins); float32 weights, with `bf16` autocast when
`--dtype bfloat16` (TRL's default is bf16 autocast); one optimizer step per generation batch
(`per_device_train_batch_size` = prompts x samples, `gradient_accumulation_steps=1`);
`min_new_tokens` = `max_completion_length`, so every completion has exactly that many tokens;
the learning rate and seed given; no logging backend, no checkpoints. Defaults kept: `beta=0`
(no reference model), `loss_type="dapo"`, gradient checkpointing on, `num_iterations=1` (so TRL
computes no separate old-log-prob pass).

Timing, by a subclass of `GRPOTrainer` and a callback, per optimizer step:

- step: `on_step_begin` to `on_step_end` (generation, scoring, forward/backward, clip, AdamW);
- generation: `_generate_single_turn` (left-pad, `model.generate`, cut at EOS);
- prepare: `_generate_and_score_completions` (generation, decoding, reward, advantages, and any
  log-prob forward pass TRL makes there, counted separately as `logps_in_prepare`).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

_NUMBER = re.compile(r"-?\d+")


def final_number_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the last integer of the completion is the answer (both tasks' rule, simplified)."""
    scores = []
    for completion, truth in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = _NUMBER.findall(text)
        scores.append(float(bool(numbers) and int(numbers[-1]) == int(truth)))
    return scores


class TimedGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` that adds up the time of its generation and preparation per step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.phase: dict[str, float] = {}
        self.in_prepare = False

    def _add(self, name: str, seconds: float) -> None:
        self.phase[name] = self.phase.get(name, 0.0) + seconds

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        self._add("generate", time.perf_counter() - start)
        self._add("prompt_tokens", float(sum(len(p) for p in prompt_ids)))
        self._add("generated_tokens", float(sum(len(c) for c in completion_ids)))
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        self.in_prepare = True
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.in_prepare = False
            self._add("prepare", time.perf_counter() - start)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self.in_prepare:
            self._add("logps_in_prepare", time.perf_counter() - start)
        return out


class StepTimer(TrainerCallback):
    """One record per optimizer step: its wall time and the trainer's phase sums; the records
    so far written to ``out`` after every step (a run stopped early keeps its steps)."""

    def __init__(self, out: Path) -> None:
        self.trainer: TimedGRPOTrainer | None = None
        self.records: list[dict[str, float]] = []
        self.start = 0.0
        self.out = out

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        assert self.trainer is not None
        self.trainer.phase = {}
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        assert self.trainer is not None
        step = time.perf_counter() - self.start
        memory = {}
        if torch.cuda.is_initialized():
            memory = {
                "max_memory_allocated": float(torch.cuda.max_memory_allocated()),
                "max_memory_reserved": float(torch.cuda.max_memory_reserved()),
            }
        self.records.append({"step": step, **self.trainer.phase, **memory})
        self.out.write_text(json.dumps({"steps": self.records}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model folder")
    parser.add_argument("--prompts", required=True, help="JSONL of prompt, answer")
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line]
    chats = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    dataset = Dataset.from_dict({"prompt": chats, "answer": [r["answer"] for r in rows]})
    config = GRPOConfig(
        output_dir=str(Path(args.workdir) / "trl_out"),
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16",
        model_init_kwargs={"dtype": "float32"},  # bf16 is mixed precision: float32 weights
        per_device_train_batch_size=len(rows) * args.n,
        gradient_accumulation_steps=1,
        num_generations=args.n,
        max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens},
        temperature=args.temperature,
        learning_rate=args.lr,
        max_steps=args.warmup + args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
    )
    timer = StepTimer(Path(args.out))
    trainer = TimedGRPOTrainer(
        model=args.model,
        reward_funcs=final_number_reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(args.model),
        callbacks=[timer],
    )
    timer.trainer = trainer
    trainer.train()
    settings = {
        "gradient_checkpointing": config.gradient_checkpointing,
        "loss_type": config.loss_type,
        "beta": config.beta,
        "bf16": config.bf16,
        "scale_rewards": config.scale_rewards,
        "lr_scheduler_type": str(config.lr_scheduler_type),
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "param_dtype": str(next(trainer.model.parameters()).dtype),
    }
    Path(args.out).write_text(json.dumps({"steps": timer.records, "settings": settings}))


if __name__ == "__main__":
    main()
