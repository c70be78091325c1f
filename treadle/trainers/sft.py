"""The SFT driver: next-token loss on response tokens, with the same actor workers.

A row is a prompt and a response (loss on the response) or, without a prompt, a
``data.messages_key`` list of chat messages (loss on every assistant turn). It uses the RL
actor's worker group (FSDP2 engine, optimizer, checkpoints) without a reference; a step is
one optimizer step over ``data.batch_size`` samples. The run ends at
``trainer.total_steps`` (or after ``trainer.epochs`` passes), writes a checkpoint and exports
``<output_dir>/final_model``, and evaluates the validation sets (``data.val_files``,
``data.val_sets``; :mod:`treadle.trainers.evaluation`) when there are some.
"""

from __future__ import annotations

import time

from treadle.config import Config
from treadle.data import ResumableSampler, collate_sft
from treadle.data.images import PIXELS, stack_pixels
from treadle.data.templating import pad_or_eos_id
from treadle.protocol import Batch
from treadle.tracking.tracker import timed
from treadle.trainers.base import Trainer
from treadle.trainers.datasets import config_sft
from treadle.trainers.evaluation import evaluate_sets, load_val_sets
from treadle.trainers.prompts import listed, tokenizer


class SFTTrainer(Trainer):
    """Owns the SFT data and the actor group; ``fit`` runs the loop."""

    kind = "sft"
    headline = "sft/loss"
    algorithm = "SFT"

    def __init__(self, cfg: Config) -> None:
        d = cfg.data
        files = d.train_files if d.source != "files" else listed(d.train_files, "data.train_files")
        super().__init__(cfg)
        tok = tokenizer(cfg)
        self.pad = pad_or_eos_id(tok)
        self.ds = config_sft(cfg, files, "data.train_files", tok)
        self.val_sets = load_val_sets(cfg)  # (closed by close())
        self.steps_per_epoch = max(len(self.ds) // d.batch_size, 1)
        if cfg.trainer.epochs is not None:
            self.total = cfg.trainer.epochs * self.steps_per_epoch
        sampler = ResumableSampler(len(self.ds), d.batch_size, cfg.trainer.seed, d.shuffle)
        self.start_workers(sampler, with_ref=False)

    def run_step(self, step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        rows = [self.ds[i] for i in self.sampler.next_indices()]
        ids, mask, loss_mask = collate_sft(rows, self.pad)
        tensors = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
        pixels = stack_pixels([r.get("pixel_values") for r in rows])
        if pixels is not None:
            tensors[PIXELS] = pixels
        batch = Batch.from_dict(tensors=tensors)
        with timed(metrics, "update_actor"):
            metrics.update(self.group.train_sft(batch))
        metrics["timing/step"] = time.perf_counter() - start
        metrics["epoch"] = step / self.steps_per_epoch
        if self.val_sets and self.eval_due(step):
            self.rollout.sync_weights(version=step)  # generate with the trained weights
            with timed(metrics, "eval"):
                metrics.update(evaluate_sets(self.cfg, self.rollout, self.val_sets))
        return metrics


def sft(cfg: Config) -> dict[str, float]:
    """Run SFT with ``cfg``; returns the last step's metrics."""
    return SFTTrainer(cfg).fit()
