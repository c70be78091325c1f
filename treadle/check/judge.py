"""``reward.judge`` checked before a run, without loading its weights: the model folder is a
causal LM's, its tokenizer loads (with a chat template when ``reward.judge.chat_template``),
``reward.judge.max_length`` fits its context, and the template (and a prob verdict's
``token`` and ``against``) reads, naming only ``{prompt}``, ``{response}``,
``{ground_truth}`` and columns every training row has."""

from __future__ import annotations

from typing import Any

from treadle.config import Config
from treadle.config.rules import RL_KINDS, Kind
from treadle.runtime.errors import ConfigError, TreadleError

KEY = "reward.judge.model_path"


def check_judge(cfg: Config, kind: Kind, summary: list[str], problems: list[str]) -> None:
    """The judge of an RL run, when it has one; each problem one line naming its key."""
    j = cfg.reward.judge
    if j.model_path is None or kind not in RL_KINDS:
        return
    try:
        folder = _check_model(cfg)
    except TreadleError as e:
        problems.append(str(e))
        return
    summary.append(
        f"reward.judge: {folder} ({j.verdict} verdict, weight {j.weight:g}, {j.engine} "
        f"{j.placement})"
    )


def _check_model(cfg: Config) -> str:
    """The judge's folder, after checking it is a causal LM's whose tokenizer and context fit
    the settings (and that the rows have the columns the settings name)."""
    from treadle.models.folders import load_tokenizer, model_config, resolve_model_path
    from treadle.rewards.verdicts import check_prompting

    j, allow = cfg.reward.judge, cfg.model.allow_download
    folder = str(resolve_model_path(str(j.model_path), key=KEY, allow_download=allow))
    config = model_config(folder, KEY, allow)
    arch = config.get("architectures") or []
    if arch and not any(str(a).endswith("ForCausalLM") for a in arch):
        raise ConfigError(
            f"{KEY}: '{j.model_path}' is not a causal LM (architectures: {', '.join(arch)}): "
            "a judge generates its verdict, so give a *ForCausalLM folder"
        )
    context = config.get("max_position_embeddings")
    length = j.length(context)
    if isinstance(context, int) and length >= context:
        raise ConfigError(
            f"reward.judge.max_length={length} leaves no room in the judge's context "
            f"(max_position_embeddings={context}; a scored prompt takes one more): lower it"
        )
    _check_columns(cfg, check_prompting(j, load_tokenizer(folder, key=KEY, allow_download=allow)))
    return folder


def _check_columns(cfg: Config, fields: list[str]) -> None:
    """Every training row has the columns ``fields`` (the first row without one is named)."""
    if not fields:
        return
    for record in _training_records(cfg):
        missing = [name for name in fields if name not in record.row]
        if missing:
            names = ", ".join(f"{{{name}}}" for name in missing)
            raise ConfigError(
                f"reward.judge names {names}, but {record.where} has no such column "
                f"(its columns: {', '.join(sorted(record.row))}): fix the template or the data"
            )


def _training_records(cfg: Config) -> list[Any]:
    """The training rows, as the run reads them (files, or reasoning-gym's drawn rows)."""
    if cfg.data.source == "reasoning_gym":
        from treadle.data.gym import gym_records

        return gym_records(cfg.data.reasoning_gym, "train")
    from treadle.data.readers import read_records

    return read_records(cfg.data.train_files, "data.train_files")
