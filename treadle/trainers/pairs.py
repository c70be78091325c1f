"""What the preference trainers (DPO, KTO, reward model) share: data, batches, held-out scores.

A step's batch holds ``data.batch_size`` pairs: ``prompts``/``prompt_mask`` left-padded and
``chosen``/``rejected`` with their masks right-padded (:func:`treadle.data.collate_pairs`), so
a rank receives whole pairs and lays out ``2 x pairs`` sequences as a rollout would. KTO's
batch holds ``data.batch_size`` unpaired examples (:func:`treadle.data.collate_unpaired`),
each with the completion of the example before it in the batch for the KL estimate.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized

import torch

from treadle.algorithms import pair_stats
from treadle.config import Config
from treadle.data import (
    PairDataset,
    ResumableSampler,
    UnpairedDataset,
    collate_pairs,
    collate_unpaired,
    config_pairs,
    config_unpaired,
)
from treadle.errors import ConfigError
from treadle.models import load_tokenizer
from treadle.protocol import Batch


def load_pairs(cfg: Config, files: list[str], key: str) -> PairDataset:
    """The preference pairs of ``files`` (the config key ``key``), checked and tokenized."""
    if not files:
        raise ConfigError(f"{key} is empty: list at least one JSONL or Parquet file of pairs")
    tok = load_tokenizer(
        cfg.model.tokenizer_path or cfg.model.path, allow_download=cfg.model.allow_download
    )
    return config_pairs(cfg, files, key, tok)


def load_unpaired(cfg: Config, files: list[str], key: str) -> UnpairedDataset:
    """The unpaired examples of ``files`` (pairs: two each), checked and tokenized."""
    if not files:
        raise ConfigError(
            f"{key} is empty: list at least one JSONL or Parquet file of unpaired examples"
        )
    tok = load_tokenizer(
        cfg.model.tokenizer_path or cfg.model.path, allow_download=cfg.model.allow_download
    )
    return config_unpaired(cfg, files, key, tok)


def unpaired_batch(ds: UnpairedDataset, indices: Sequence[int]) -> Batch:
    rows = [ds[i] for i in indices]
    return Batch.from_dict(
        tensors=collate_unpaired(rows, ds.pad_id), objects={"uid": [r["uid"] for r in rows]}
    )


def held_out_unpaired(cfg: Config, ds: UnpairedDataset) -> tuple[Batch, int]:
    """The first ``data.val_size`` held-out examples (all by default), padded for the ranks."""
    n = len(ds) if cfg.data.val_size is None else min(cfg.data.val_size, len(ds))
    return unpaired_batch(ds, range(n)).pad_to_multiple(cfg.actor.world_size)


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
    n = len(ds) if cfg.data.val_size is None else min(cfg.data.val_size, len(ds))
    return pair_batch(ds, range(n)).pad_to_multiple(cfg.actor.world_size)


def pair_means(chosen: torch.Tensor, rejected: torch.Tensor, prefix: str) -> dict[str, float]:
    """``<prefix>pair_accuracy`` (chosen scored above rejected) and ``<prefix>margin``."""
    stats = pair_stats(chosen, rejected)
    n = max(len(chosen), 1)
    return {f"{prefix}pair_accuracy": stats["accuracy"] / n, f"{prefix}margin": stats["margin"] / n}
