"""Prompt batches for the drivers: held-out and training prompts as ``Batch`` rows.

A batch of prompts holds ``prompts``/``prompt_mask`` (left-padded) and, per row, its ``uid``,
``prompt_text``, ``ground_truth`` and data ``row`` (what a batched reward function reads).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from treadle.config import Config
from treadle.data import PromptDataset
from treadle.models.loading import load_tokenizer
from treadle.runtime.errors import ConfigError
from treadle.trainers.datasets import config_prompts


def load_prompts(cfg: Config, files: list[str], key: str) -> PromptDataset:
    """The prompts of ``files`` (the config key ``key``), checked and tokenized; with
    ``data.source=reasoning_gym``, that split of reasoning-gym's rows."""
    files = files if cfg.data.source != "files" else listed(files, key)
    return config_prompts(cfg, files, key, tokenizer(cfg), tool_schemas(cfg))


def listed(files: list[str], key: str, what: str = "") -> list[str]:
    """``files``; a ConfigError when the config key ``key`` lists none (of ``what``)."""
    if not files:
        raise ConfigError(f"{key} is empty: list at least one JSONL or Parquet file{what}")
    return files


def tokenizer(cfg: Config) -> Any:
    """The run's tokenizer: ``model.tokenizer_path``, else the model's."""
    return load_tokenizer(
        cfg.model.tokenizer_path or cfg.model.path,
        allow_download=cfg.model.allow_download,
        template_kwargs=cfg.data.chat_template_kwargs,
    )


def held_out(cfg: Config, ds: Sized) -> list[int]:
    """The rows of held-out ``ds`` scored: the first ``data.val_size`` (all by default)."""
    return list(range(len(ds) if cfg.data.val_size is None else min(cfg.data.val_size, len(ds))))


def tool_schemas(cfg: Config) -> list[dict[str, Any]] | None:
    """The JSON schemas of ``rollout.tools``, which the prompts show the model."""
    from treadle.agents.tools import Toolbox

    return Toolbox.load(cfg.rollout.tools).schemas if cfg.rollout.tools else None
