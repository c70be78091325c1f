"""Datasets from local files, prompt templating, length filtering and a resumable sampler.

One module per job: ``readers`` (files to records: JSONL, Parquet, ``save_to_disk`` folders;
every bad row reported with its file and 1-based row), ``templating`` (the chat template,
tools in prompts, text to token ids with special-token strings kept as text), ``options``
(``TextOptions``: how every reader turns rows into tokens, and ``from_config``, the one adapter
from a run's config), ``rows`` (``Rows``, length limits), ``prompts`` (RL prompts), ``sft``
(SFT examples), ``pairs`` (preference pairs), ``unpaired`` (KTO's examples) and ``sampler``
(``ResumableSampler``); ``gym`` draws rows from reasoning-gym instead of files
(``data.source=reasoning_gym``) and holds its reward.

Layout: prompts are left-padded (``collate_prompts``), SFT sequences and responses
right-padded. ``loss_mask[t] == 1`` means token ``t`` is a target, predicted from position
``t - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from treadle.data.gym import KEY as GYM_KEY
from treadle.data.gym import Split, gym_records, instruction
from treadle.data.options import Overlong, TextOptions
from treadle.data.pairs import PairDataset, PairRow, collate_pairs, load_pair_dataset
from treadle.data.prompts import (
    PromptDataset,
    PromptRow,
    collate_prompts,
    left_pad,
    load_prompt_dataset,
    pad_prompts,
    prompt_batch,
    prompt_dataset,
)
from treadle.data.readers import Record, read_records
from treadle.data.rows import Rows
from treadle.data.sampler import ResumableSampler
from treadle.data.sft import SFTDataset, SFTRow, collate_sft, load_sft_dataset, sft_dataset
from treadle.data.templating import (
    HERMES_TOOLS_PROMPT,
    encode_rendered,
    special_strings,
    supports_tools,
    tool_messages,
)
from treadle.data.unpaired import (
    UnpairedDataset,
    UnpairedRow,
    collate_unpaired,
    load_unpaired_dataset,
)

if TYPE_CHECKING:
    from treadle.config import Config
    from treadle.config.data import ReasoningGymConfig

__all__ = [
    "HERMES_TOOLS_PROMPT",
    "Overlong",
    "PairDataset",
    "PairRow",
    "PromptDataset",
    "PromptRow",
    "ResumableSampler",
    "Rows",
    "SFTDataset",
    "SFTRow",
    "TextOptions",
    "UnpairedDataset",
    "UnpairedRow",
    "collate_pairs",
    "collate_prompts",
    "collate_sft",
    "collate_unpaired",
    "config_pairs",
    "config_prompts",
    "config_records",
    "config_sft",
    "config_unpaired",
    "encode_rendered",
    "gym_rows",
    "left_pad",
    "load_pair_dataset",
    "load_prompt_dataset",
    "load_sft_dataset",
    "load_unpaired_dataset",
    "pad_prompts",
    "prompt_batch",
    "prompt_dataset",
    "sft_dataset",
    "special_strings",
    "supports_tools",
    "tool_messages",
    "val_set_prompts",
]

# The readers as a run calls them: ``TextOptions.from_config`` gives every one the ``data``
# section's settings, so the trainers and ``treadle check`` see exactly the same rows.

Tokenizer = PreTrainedTokenizerBase
VAL_KEY = "data.val_files"  # the key the drivers name held-out prompts by


def config_records(
    cfg: Config, files: Sequence[str], key: str, options: TextOptions
) -> tuple[list[Record], TextOptions]:
    """The rows of ``files`` (the config key ``key``) and how to read them; with
    ``data.source=reasoning_gym`` reasoning-gym's rows of that split instead
    (:func:`gym_rows`)."""
    if cfg.data.source == "files":
        return read_records(files, key), options
    split: Split = "val" if key == VAL_KEY else "train"
    return gym_rows(cfg.data.reasoning_gym, split, options, GYM_KEY)


def gym_rows(
    spec: ReasoningGymConfig, split: Split, options: TextOptions, key: str
) -> tuple[list[Record], TextOptions]:
    """reasoning-gym's rows of ``split`` as ``spec`` (the config key ``key``) draws them: the
    prompt is the ``question``, the ground truth the ``answer``, the SFT target the
    ``solution``, and the answer format's instruction the system prompt unless
    ``data.system_prompt`` is set."""
    system = options.system_prompt
    gym = replace(
        options,
        prompt_key="question",
        answer_key="answer",
        response_key="solution",
        system_prompt=instruction(spec.answer_format) if system is None else system,
        config_key=f"{key} ({split})",
    )
    return gym_records(spec, split, key), gym


def val_set_prompts(cfg: Config, name: str, tokenizer: Tokenizer, tools: Any) -> PromptDataset:
    """The prompts of the validation set ``data.val_sets.<name>``: its files, or the held-out
    rows of its reasoning-gym settings, read with the ``data`` section's columns and template."""
    spec, key = cfg.data.val_sets[name], f"data.val_sets.{name}"
    options = TextOptions.from_config(cfg, f"{key}.files", tools)
    if spec.source == "files":
        records = read_records(spec.files, f"{key}.files")
    else:
        records, options = gym_rows(spec.reasoning_gym, "val", options, f"{key}.reasoning_gym")
    return prompt_dataset(records, tokenizer, options)


def config_prompts(
    cfg: Config, files: Sequence[str], key: str, tokenizer: Tokenizer, tools: Any
) -> PromptDataset:
    """RL and evaluation prompts of ``files`` (the config key ``key``)."""
    records, options = config_records(cfg, files, key, TextOptions.from_config(cfg, key, tools))
    return prompt_dataset(records, tokenizer, options)


def config_sft(cfg: Config, files: Sequence[str], key: str, tokenizer: Tokenizer) -> SFTDataset:
    """SFT examples of ``files``: at most ``data.max_prompt_length + rollout.max_new_tokens``
    tokens; a longer one is dropped (``data.overlong_prompts`` is about prompts)."""
    options = replace(TextOptions.from_config(cfg, key), overlong="filter")
    records, options = config_records(cfg, files, key, options)
    return sft_dataset(records, tokenizer, options)


def config_pairs(cfg: Config, files: Sequence[str], key: str, tokenizer: Tokenizer) -> PairDataset:
    """Preference pairs of ``files``, checked and tokenized."""
    return load_pair_dataset(files, tokenizer, TextOptions.from_config(cfg, key))


def config_unpaired(
    cfg: Config, files: Sequence[str], key: str, tokenizer: Tokenizer
) -> UnpairedDataset:
    """Unpaired examples of ``files`` (or pairs, two examples each), checked and tokenized."""
    return load_unpaired_dataset(files, tokenizer, TextOptions.from_config(cfg, key))
