"""What the preference trainers (DPO, KTO, reward model) share: data, batches, held-out
scores, and the driver's skeleton (:class:`PairTrainer`).

A step's batch holds ``data.batch_size`` pairs: ``prompts``/``prompt_mask`` left-padded and
``chosen``/``rejected`` with their masks right-padded (:func:`treadle.data.collate_pairs`), so
a rank receives whole pairs and lays out ``2 x pairs`` sequences as a rollout would. KTO's
batch holds ``data.batch_size`` unpaired examples (:func:`treadle.data.collate_unpaired`),
each with the completion of the example before it in the batch for the KL estimate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence, Sized
from typing import Generic, TypeVar

import torch

from treadle.algorithms import pair_stats
from treadle.config import Config
from treadle.data import (
    PairDataset,
    ResumableSampler,
    UnpairedDataset,
    collate_pairs,
    collate_unpaired,
)
from treadle.protocol import Batch
from treadle.rewards import load_reward_fn
from treadle.tracking.tracker import timed
from treadle.trainers.base import Trainer
from treadle.trainers.datasets import config_pairs, config_unpaired
from treadle.trainers.evaluation import evaluate_sets, load_val_sets
from treadle.trainers.prompts import held_out, listed, tokenizer

D = TypeVar("D", PairDataset, UnpairedDataset)


def load_pairs(cfg: Config, files: list[str], key: str) -> PairDataset:
    """The preference pairs of ``files`` (the config key ``key``), checked and tokenized."""
    return config_pairs(cfg, listed(files, key, " of pairs"), key, tokenizer(cfg))


def load_unpaired(cfg: Config, files: list[str], key: str) -> UnpairedDataset:
    """The unpaired examples of ``files`` (pairs: two each), checked and tokenized."""
    files = listed(files, key, " of unpaired examples")
    return config_unpaired(cfg, files, key, tokenizer(cfg))


def unpaired_batch(ds: UnpairedDataset, indices: Sequence[int]) -> Batch:
    rows = [ds[i] for i in indices]
    return Batch.from_dict(
        tensors=collate_unpaired(rows, ds.pad_id), objects={"uid": [r["uid"] for r in rows]}
    )


def held_out_unpaired(cfg: Config, ds: UnpairedDataset) -> tuple[Batch, int]:
    """The first ``data.val_size`` held-out examples (all by default), padded for the ranks."""
    return unpaired_batch(ds, held_out(cfg, ds)).pad_to_multiple(cfg.actor.world_size)


def pair_sampler(cfg: Config, ds: Sized) -> tuple[ResumableSampler, int, int]:
    """(sampler, steps per epoch, last step): ``trainer.epochs`` overrides ``total_steps``."""
    d, t = cfg.data, cfg.trainer
    sampler = ResumableSampler(len(ds), d.batch_size, t.seed, d.shuffle)
    per_epoch = sampler.steps_per_epoch
    return sampler, per_epoch, t.epochs * per_epoch if t.epochs is not None else t.total_steps


def pair_batch(ds: PairDataset, indices: Sequence[int]) -> Batch:
    rows = [ds[i] for i in indices]
    return Batch.from_dict(
        tensors=collate_pairs(rows, ds.pad_id), objects={"uid": [r["uid"] for r in rows]}
    )


def held_out_batch(cfg: Config, ds: PairDataset) -> tuple[Batch, int]:
    """The first ``data.val_size`` held-out pairs (all by default), padded for the ranks."""
    return pair_batch(ds, held_out(cfg, ds)).pad_to_multiple(cfg.actor.world_size)


def pair_means(chosen: torch.Tensor, rejected: torch.Tensor, prefix: str) -> dict[str, float]:
    """``<prefix>pair_accuracy`` (chosen scored above rejected) and ``<prefix>margin``."""
    stats = pair_stats(chosen, rejected)
    n = max(len(chosen), 1)
    return {f"{prefix}pair_accuracy": stats["accuracy"] / n, f"{prefix}margin": stats["margin"] / n}


class PairTrainer(Trainer, Generic[D]):
    """A driver over a dataset of pairs (or examples), read with ``load`` before the run
    directory is made: epochs of ``data.batch_size`` rows, one :meth:`update` a step, held-out
    scores (:meth:`evaluate`) when ``data.val_files`` is set and, with ``eval_task``, the
    task's held-out accuracy of greedy generations (:meth:`task_accuracy`)."""

    def __init__(
        self,
        cfg: Config,
        load: Callable[[Config, list[str], str], D],
        with_ref: bool,
        eval_task: bool = False,
    ) -> None:
        if eval_task:  # fail before anything starts on a reward function that will not load
            load_reward_fn(cfg.reward.function)
        d = cfg.data
        self.train: D = load(cfg, d.train_files, "data.train_files")
        self.val: D | None = load(cfg, d.val_files, "data.val_files") if d.val_files else None
        self.val_ref: Batch | None = None  # the reference never changes: score it once
        super().__init__(cfg)
        self.val_sets = load_val_sets(cfg) if eval_task else {}  # (closed by close())
        sampler, self.steps_per_epoch, self.total = pair_sampler(cfg, self.train)
        self.start_workers(sampler, with_ref=with_ref)

    def run_step(self, step: int) -> dict[str, float]:
        m: dict[str, float] = {}
        start = time.perf_counter()
        self.update(self.sampler.next_indices(), m)
        m["timing/step"] = time.perf_counter() - start
        m["epoch"] = step / self.steps_per_epoch
        if self.val is not None and self.eval_due(step):
            with timed(m, "eval"):
                m.update(self.evaluate(step))
        return m

    def update(self, indices: list[int], m: dict[str, float]) -> None:
        """One optimizer step on the rows ``indices``; its metrics (and timings) into ``m``."""
        raise NotImplementedError

    def evaluate(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def task_accuracy(self, step: int) -> dict[str, float]:
        """The validation sets' metrics (``eval/val/accuracy``, ...) with the trained weights,
        when ``eval_task`` asked for them."""
        if not self.val_sets:
            return {}
        self.rollout.sync_weights(version=step)  # generate with the trained weights
        return evaluate_sets(self.cfg, self.rollout, self.val_sets)
