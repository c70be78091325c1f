"""Prompt batches for the drivers: held-out and training prompts as ``Batch`` rows.

A batch of prompts holds ``prompts``/``prompt_mask`` (left-padded) and, per row, its ``uid``,
``prompt_text``, ``ground_truth`` and data ``row`` (what a batched reward function reads).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import torch

from treadle.config import Config
from treadle.data import PromptDataset, collate_prompts, config_prompts
from treadle.errors import ConfigError
from treadle.models import load_tokenizer
from treadle.protocol import Batch


def load_prompts(cfg: Config, files: list[str], key: str) -> PromptDataset:
    """The prompts of ``files`` (the config key ``key``), checked and tokenized."""
    return config_prompts(cfg, listed(files, key), key, tokenizer(cfg), tool_schemas(cfg))


def listed(files: list[str], key: str, what: str = "") -> list[str]:
    """``files``; a ConfigError when the config key ``key`` lists none (of ``what``)."""
    if not files:
        raise ConfigError(f"{key} is empty: list at least one JSONL or Parquet file{what}")
    return files


def tokenizer(cfg: Config) -> Any:
    """The run's tokenizer: ``model.tokenizer_path``, else the model's."""
    return load_tokenizer(
        cfg.model.tokenizer_path or cfg.model.path, allow_download=cfg.model.allow_download
    )


def held_out(cfg: Config, ds: Sized) -> list[int]:
    """The rows of held-out ``ds`` scored: the first ``data.val_size`` (all by default)."""
    return list(range(len(ds) if cfg.data.val_size is None else min(cfg.data.val_size, len(ds))))


def tool_schemas(cfg: Config) -> list[dict[str, Any]] | None:
    """The JSON schemas of ``rollout.tools``, which the prompts show the model."""
    from treadle.agents.tools import Toolbox

    return Toolbox.load(cfg.rollout.tools).schemas if cfg.rollout.tools else None


def prompt_batch(ds: PromptDataset, indices: list[int], pad_id: int, **meta: Any) -> Batch:
    rows = [ds[i] for i in indices]
    ids, mask = collate_prompts([r["prompt_ids"] for r in rows], pad_id)
    return Batch.from_dict(
        tensors={"prompts": ids, "prompt_mask": mask},
        objects={
            "uid": [r["uid"] for r in rows],
            "prompt_text": [r["prompt_text"] for r in rows],
            "ground_truth": [r["ground_truth"] for r in rows],
            "row": [r["row"] for r in rows],
        },
        meta=meta,
    )


def left_pad(batch: Batch, width: int) -> Batch:
    """``prompts``/``prompt_mask`` left-padded to ``width`` columns (to concat rounds)."""
    extra = width - batch["prompts"].shape[1]
    if extra == 0:
        return batch
    out = batch.select(list(range(len(batch))))
    out["prompts"] = torch.nn.functional.pad(batch["prompts"], (extra, 0), value=0)
    out["prompt_mask"] = torch.nn.functional.pad(batch["prompt_mask"], (extra, 0), value=0)
    return out
