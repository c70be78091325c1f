"""Datasets from local files, prompt templating, length filtering and a resumable sampler.

One module per job: ``readers`` (files to records: JSONL, Parquet, ``save_to_disk`` folders;
every bad row reported with its file and 1-based row), ``templating`` (the chat template,
tools in prompts, text to token ids with special-token strings kept as text), ``options``
(``TextOptions``: how every reader turns rows into tokens), ``rows`` (``Rows``, length
limits), ``prompts`` (RL prompts), ``sft`` (SFT examples), ``preference`` (pairs, and KTO's
unpaired examples), ``sampler`` (``ResumableSampler``, uniform) and ``curriculum``
(``PassRateSampler``: prompts drawn by their recent pass rate); ``gym`` draws rows
from reasoning-gym instead of files (``data.source=reasoning_gym``) and holds its reward.

The data layer reads typed options (``TextOptions``, a reasoning-gym spec), never the run's
config: :mod:`treadle.trainers.datasets` turns a run's config into them.

Layout: prompts are left-padded (``collate_prompts``), SFT sequences and responses
right-padded. ``loss_mask[t] == 1`` means token ``t`` is a target, predicted from position
``t - 1``.
"""

from __future__ import annotations

from treadle.data.curriculum import PassRateRule, PassRateSampler
from treadle.data.gym import gym_rows
from treadle.data.options import Overlong, TextOptions
from treadle.data.preference import (
    PairDataset,
    PairRow,
    UnpairedDataset,
    UnpairedRow,
    collate_pairs,
    collate_unpaired,
    load_pair_dataset,
    load_unpaired_dataset,
)
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
from treadle.data.rows import Rows
from treadle.data.sampler import PromptSampler, ResumableSampler
from treadle.data.sft import SFTDataset, SFTRow, collate_sft, load_sft_dataset, sft_dataset
from treadle.data.templating import (
    HERMES_TOOLS_PROMPT,
    encode_rendered,
    special_strings,
    supports_tools,
    tool_messages,
)

__all__ = [
    "HERMES_TOOLS_PROMPT",
    "Overlong",
    "PairDataset",
    "PairRow",
    "PassRateRule",
    "PassRateSampler",
    "PromptDataset",
    "PromptRow",
    "PromptSampler",
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
]
