"""The SFT driver: next-token loss on response tokens, with the same actor workers.

It uses the RL actor's worker group (FSDP2 engine, optimizer, checkpoints) without a
reference; a step is one optimizer step over ``data.batch_size`` samples. The run ends at
``trainer.total_steps`` (or after ``trainer.epochs`` passes), writes a checkpoint and exports
``<output_dir>/final_model``, and reports held-out accuracy when ``data.val_files`` is set.
"""

from __future__ import annotations

import math
import time

from treadle import checkpoint as ckpt
from treadle.config import Config
from treadle.data import ResumableSampler, collate_sft, load_sft_dataset
from treadle.errors import ConfigError
from treadle.models import load_tokenizer
from treadle.protocol import Batch
from treadle.tracking import Tracker, timed
from treadle.trainers.common import (
    build_actors,
    evaluate,
    load_prompts,
    prepare_run_dir,
    resume_point,
    save_checkpoint,
)


class SFTTrainer:
    """Owns the SFT data and the actor group; ``fit`` runs the loop."""

    def __init__(self, cfg: Config) -> None:
        d = cfg.data
        if not d.train_files:
            raise ConfigError("data.train_files is empty: list at least one JSONL or Parquet file")
        self.cfg, self.out = cfg, prepare_run_dir(cfg)
        latest, actor_path = resume_point(cfg)
        tok = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.ds = load_sft_dataset(
            d.train_files,
            prompt_key=d.prompt_key,
            response_key=d.response_key,
            tokenizer=tok,
            max_length=d.max_prompt_length + cfg.rollout.max_new_tokens,
            apply_chat_template=d.apply_chat_template,
            system_prompt=d.system_prompt,
        )
        self.val = load_prompts(cfg, d.val_files, "data.val_files") if d.val_files else None
        self.sampler = ResumableSampler(len(self.ds), d.batch_size, cfg.trainer.seed, d.shuffle)
        self.steps_per_epoch = max(len(self.ds) // d.batch_size, 1)
        t = cfg.trainer
        self.total = t.total_steps if t.epochs is None else t.epochs * self.steps_per_epoch
        self.start = 0
        if latest is not None:
            state = ckpt.read_state(latest)
            self.start = int(state["step"])
            self.sampler.load_state_dict(state["sampler"])
        self.actors = build_actors(cfg, actor_path, with_ref=False)
        self.group = self.actors.group
        if latest is not None:
            self.group.load_checkpoint(str(latest))

    def step(self, step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        rows = [self.ds[i] for i in self.sampler.next_indices()]
        ids, mask, loss_mask = collate_sft(rows, self.pad)
        batch = Batch.from_dict(
            tensors={"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
        )
        with timed(metrics, "update_actor"):
            metrics.update(self.group.train_sft(batch))
        metrics["timing/step"] = time.perf_counter() - start
        metrics["epoch"] = step / self.steps_per_epoch
        if not math.isfinite(metrics["sft/loss"]):
            raise FloatingPointError(f"step {step}: SFT loss is {metrics['sft/loss']}")
        t = self.cfg.trainer
        if self.val is not None and (
            step == self.total or (t.eval_every and step % t.eval_every == 0)
        ):
            self.group.sync_weights()  # the rollout engine generates with the trained weights
            with timed(metrics, "eval"):
                metrics["eval/accuracy"] = evaluate(self.cfg, self.group, self.val, self.pad)
        return metrics

    def fit(self) -> dict[str, float]:
        t, metrics = self.cfg.trainer, {}
        try:
            with Tracker(self.out, self.total, self.start, t.progress, "sft/loss") as tracker:
                for step in range(self.start + 1, self.total + 1):
                    metrics = self.step(step)
                    tracker.log(step, metrics)
                    last = step == self.total
                    if last or (t.save_every and step % t.save_every == 0):
                        state = self.sampler.state_dict()
                        save_checkpoint(self.cfg, self.group, step, state, final=last)
        finally:
            self.actors.close()
        return metrics


def sft(cfg: Config) -> dict[str, float]:
    """Run SFT with ``cfg``; returns the last step's metrics."""
    return SFTTrainer(cfg).fit()
