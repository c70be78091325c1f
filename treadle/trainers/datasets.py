"""The one adapter from a run's config to the data layer.

The data layer (:mod:`treadle.data`) reads typed options and never the run's config:
:func:`text_options` makes a :class:`~treadle.data.TextOptions` from the ``data`` section
(responses: at most ``rollout.max_new_tokens``; the image processor of a vision-language
``model.path``), and ``data.source`` picks files or reasoning-gym's rows. Each command's
dataset is read here, by the trainers and by ``treadle check`` alike, so both see exactly the
same rows. The RL prompts' sampler is made here too (:func:`prompt_sampler`: ``data.sampler``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from treadle.config import Config
from treadle.data import (
    PairDataset,
    PassRateRule,
    PassRateSampler,
    PromptDataset,
    PromptSampler,
    ResumableSampler,
    SFTDataset,
    TextOptions,
    UnpairedDataset,
    gym_rows,
    load_pair_dataset,
    load_unpaired_dataset,
    prompt_dataset,
    sft_dataset,
)
from treadle.data.gym import KEY as GYM_KEY
from treadle.data.gym import Split
from treadle.data.images import ImageProcessor, load_image_processor
from treadle.data.readers import Record, read_records
from treadle.models.folders import resolve_model_path
from treadle.runtime.errors import ConfigError

Tokenizer = PreTrainedTokenizerBase
VAL_KEY = "data.val_files"  # the key the drivers name held-out prompts by


def text_options(cfg: Config, config_key: str, tools: Any = None) -> TextOptions:
    """The ``data`` section's settings (responses: at most ``rollout.max_new_tokens``)."""
    d = cfg.data
    # columns, template, system prompt, special tokens, prompt length: the same names
    same = {f.name for f in fields(TextOptions)} & set(type(d).model_fields)
    return TextOptions(
        **{name: getattr(d, name) for name in same},
        max_response_length=cfg.rollout.max_new_tokens,
        overlong=d.overlong_prompts,
        config_key=config_key,
        tools=tools,
        processor=_processor(cfg),
    )


def _processor(cfg: Config) -> ImageProcessor | None:
    """The image processor of ``model.path`` when it is a vision-language model (a path that
    does not resolve is reported by the checks of the model, not here)."""
    try:
        path = resolve_model_path(cfg.model.path, allow_download=cfg.model.allow_download)
    except ConfigError:
        return None
    return load_image_processor(path)


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


def val_set_prompts(cfg: Config, name: str, tokenizer: Tokenizer, tools: Any) -> PromptDataset:
    """The prompts of the validation set ``data.val_sets.<name>``: its files, or the held-out
    rows of its reasoning-gym settings, read with the ``data`` section's columns and template."""
    spec, key = cfg.data.val_sets[name], f"data.val_sets.{name}"
    options = text_options(cfg, f"{key}.files", tools)
    if spec.source == "files":
        records = read_records(spec.files, f"{key}.files")
    else:
        records, options = gym_rows(spec.reasoning_gym, "val", options, f"{key}.reasoning_gym")
    return prompt_dataset(records, tokenizer, options)


def config_prompts(
    cfg: Config, files: Sequence[str], key: str, tokenizer: Tokenizer, tools: Any
) -> PromptDataset:
    """RL and evaluation prompts of ``files`` (the config key ``key``)."""
    records, options = config_records(cfg, files, key, text_options(cfg, key, tools))
    return prompt_dataset(records, tokenizer, options)


def config_sft(cfg: Config, files: Sequence[str], key: str, tokenizer: Tokenizer) -> SFTDataset:
    """SFT examples of ``files``: at most ``data.max_prompt_length + rollout.max_new_tokens``
    tokens; a longer one is dropped (``data.overlong_prompts`` is about prompts)."""
    options = replace(text_options(cfg, key), overlong="filter")
    records, options = config_records(cfg, files, key, options)
    return sft_dataset(records, tokenizer, options)


def config_pairs(cfg: Config, files: Sequence[str], key: str, tokenizer: Tokenizer) -> PairDataset:
    """Preference pairs of ``files``, checked and tokenized."""
    return load_pair_dataset(files, tokenizer, text_options(cfg, key))


def config_unpaired(
    cfg: Config, files: Sequence[str], key: str, tokenizer: Tokenizer
) -> UnpairedDataset:
    """Unpaired examples of ``files`` (or pairs, two examples each), checked and tokenized."""
    return load_unpaired_dataset(files, tokenizer, text_options(cfg, key))


def prompt_sampler(cfg: Config, n: int) -> PromptSampler:
    """The RL prompts' sampler, as ``data.sampler`` says: uniform (shuffled each epoch, or in
    order), or the curriculum of ``data.pass_rate_*`` (:mod:`treadle.data.curriculum`)."""
    d, seed = cfg.data, cfg.trainer.seed
    if d.sampler == "uniform":
        return ResumableSampler(n, d.batch_size, seed, shuffle=d.shuffle)
    knobs = {f.name: getattr(d, f"pass_rate_{f.name}") for f in fields(PassRateRule)}
    return PassRateSampler(n, d.batch_size, seed, PassRateRule(**knobs))
