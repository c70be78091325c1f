"""Every row a command reads, checked before the run draws it: data files, reasoning-gym's
rows, the validation sets, ground truths and the columns a batched reward needs.

Each file is read through the same readers as the run (``treadle.data``), file by file so that
each bad file is reported; every prompt's ground truth is one its built-in reward takes (the
reward's own rule, ``treadle.rewards.functions.ground_truth_rule``: arithmetic's is an
integer), and every row has the columns a batched reward is called with. With
``data.source=reasoning_gym`` its rows are drawn, which checks the dataset names and configs.
A file's row count is remembered (:mod:`treadle.runtime.cache`) by the fingerprints of the file
and of the tokenizer's files and the settings a reader sees; what the reader logged (rows
filtered) is said again on a second check, which reads no rows.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from treadle.check.models import Tokenizer
from treadle.check.user_code import import_user_code, load_reward, reward_columns
from treadle.config import Config
from treadle.config.rules import RL_KINDS, Kind
from treadle.runtime import cache
from treadle.runtime.errors import ConfigError

Reader = Callable[[Config, Any, str, str, Any], int]
Attempt = Callable[..., Any]  # check's attempt(what, fn, *args): fn's value, or None (noted)


def check_gym(
    cfg: Config, kind: Kind, tokenizer: Any, tools: Any, attempt: Attempt,
    summary: list[str], problems: list[str],
) -> None:  # fmt: skip
    """reasoning-gym's rows of each split ``kind`` reads: drawing them checks the dataset
    names and configs (each problem names its key)."""
    if kind not in GYM_KINDS:
        return  # check_algorithm says the source does not fit the command
    for split, reader in _gym_splits(cfg, kind):
        key = "data.val_files" if split == "val" else "data.train_files"  # the split's key
        count = attempt(
            f"data.reasoning_gym ({split})", _rows, reader, cfg, tokenizer, "", key, tools
        )
        if count is None:
            break  # both splits come from one spec: its problem is said once
        summary.append(f"data.reasoning_gym ({split}): {count} rows")
        if split == "train" and kind in RL_KINDS and count < cfg.data.batch_size:
            problems.append(
                f"data.reasoning_gym.size: {count} rows, fewer than one batch of "
                f"data.batch_size={cfg.data.batch_size}: lower data.batch_size or raise it"
            )


def check_files(
    cfg: Config, kind: Kind, tokenizer: Any, tools: Any, attempt: Attempt,
    summary: list[str], problems: list[str],
) -> None:  # fmt: skip
    """Every data file ``kind`` reads, file by file."""
    for key, files, reader, required in _data_files(cfg, kind):
        if not files and required:
            problems.append(f"{key} is empty: list at least one JSONL or Parquet file")
        counts = [
            attempt(f"{key}: {file}", _rows, reader, cfg, tokenizer, file, key, tools)
            for file in files
        ]
        summary += [
            f"{key}: {f}: {n} rows" for f, n in zip(files, counts, strict=True) if n is not None
        ]
        total = sum(n or 0 for n in counts)
        if key == "data.val_files" and None not in counts:
            summary += _fewer_rows("data.val_size", cfg.data.val_size, total)
        if key == "data.train_files" and None not in counts and 0 < total < cfg.data.batch_size:
            problems.append(
                f"{key}: {total} rows, fewer than one batch of data.batch_size="
                f"{cfg.data.batch_size}: lower data.batch_size or add rows"
            )


def _data_files(cfg: Config, kind: Kind) -> list[tuple[str, list[str], Reader, bool]]:
    """(config key, files, reader, whether at least one file is needed) for ``kind``."""
    d = cfg.data
    train, val = ("data.train_files", d.train_files), ("data.val_files", d.val_files)
    if kind == "serve":
        return []
    if kind in RL_KINDS:
        responses = kind == "distill" and cfg.distill.loss == "gkd" and cfg.distill.lmbda < 1
        prompts: list[tuple[str, list[str], Reader, bool]] = [
            (*train, _prompt_rows, True),
            (*val, _prompt_rows, False),
        ]
        # gkd trains on the dataset's responses too
        return [*prompts, (*train, _sft_rows, True)] if responses else prompts
    if kind == "eval":  # (data.val_sets instead will do)
        return [(*val, _prompt_rows, not d.val_sets)]
    if kind == "sft":
        return [(*train, _sft_rows, True), (*val, _prompt_rows, False)]
    out: list[tuple[str, list[str], Reader, bool]] = [
        (*train, _pair_rows, True),
        (*val, _pair_rows, False),
    ]
    if kind == "kto":
        out = [(*train, _unpaired_rows, True), (*val, _unpaired_rows, False)]
    if (kind == "dpo" and cfg.dpo.eval_task) or (kind == "kto" and cfg.kto.eval_task):
        out.append((*val, _prompt_rows, False))
    return out


GYM_KINDS = (*RL_KINDS, "sft", "eval")  # the commands that read data.source=reasoning_gym


def evaluates(cfg: Config, kind: Kind) -> bool:
    """Whether ``kind`` generates on the validation sets (and scores them)."""
    return (
        kind in (*RL_KINDS, "sft", "eval")
        or (kind == "dpo" and cfg.dpo.eval_task)
        or (kind == "kto" and cfg.kto.eval_task)
    )


def check_val_sets(
    cfg: Config, tokenizer: Any, tools: Any, attempt: Attempt, summary: list[str]
) -> None:
    """Every ``data.val_sets`` entry: its reward loads, its rows read (each problem names the
    set's key)."""

    for name, spec in cfg.data.val_sets.items():
        key = f"data.val_sets.{name}"
        if spec.reward is not None:
            reward = f"{key}.reward"
            load = partial(load_reward, spec.reward, reward)
            if attempt(reward, import_user_code, spec.reward, reward, load):
                summary.append(f"{reward}: {spec.reward}")
        if tokenizer is not None:
            ds = attempt(key, _val_set_rows, cfg, name, tokenizer, tools)
            if ds is not None:
                summary.append(f"{key}: {len(ds)} rows")
                summary += _fewer_rows(f"{key}.size", spec.size, len(ds))


def _fewer_rows(key: str, size: int | None, rows: int) -> list[str]:
    """A note when ``key`` asks for more held-out rows than there are (all are evaluated)."""
    if size is None or size <= rows:
        return []
    return [f"{key}={size}: the set has {rows} rows, so all {rows} are evaluated"]


def _val_set_rows(cfg: Config, name: str, tokenizer: Tokenizer, tools: Any) -> Any:
    """The set's prompts, every ground truth one its reward takes."""
    from treadle.trainers.datasets import val_set_prompts

    ds = val_set_prompts(cfg, name, tokenizer.load(), tools)
    key, own = f"data.val_sets.{name}", cfg.data.val_sets[name].reward
    reward = (own, f"{key}.reward") if own else (cfg.reward.function, "reward.function")
    _check_ground_truths(cfg, ds, key, reward, cfg.data.val_sets[name].source == "files")
    return ds


def _gym_splits(cfg: Config, kind: Kind) -> list[tuple[str, Reader]]:
    """(split, reader) of the reasoning-gym rows ``kind`` reads: drawing them checks the
    dataset names and configs (each problem names its key)."""
    held_out: list[tuple[str, Reader]] = [("val", _prompt_rows)] if cfg.data.has_val else []
    if kind == "eval":
        return held_out or [("val", _no_held_out)]
    return [("train", _sft_rows if kind == "sft" else _prompt_rows), *held_out]


def _rows(
    reader: Reader, cfg: Config, tokenizer: Tokenizer, file: str, key: str, tools: Any
) -> int:
    """``reader``'s row count of ``file``, remembered for the file, the tokenizer's files and
    the settings a reader sees (the ``data`` section, ``rollout.max_new_tokens``, the tools:
    ``treadle.trainers.datasets.text_options``); what it logged (rows filtered) is said again."""
    path = Path(file)
    if tokenizer.prints is None or cfg.data.source != "files" or not path.is_file():
        return reader(cfg, tokenizer.load(), file, key, tools)
    data = cache.fingerprint(path)
    # (the reward whose rule the prompts' ground truths are held to)
    settings = [cfg.data.model_dump(mode="json"), cfg.rollout.max_new_tokens, tools]
    scored = _scoring_reward(cfg, cfg.reward.function)
    settings += [scored, reward_columns(scored)]  # (the columns: its signature)
    cache_key = [reader.__name__, key, file, data, settings, tokenizer.prints]
    hit = cache.lookup("rows", cache_key)
    if isinstance(hit, dict):
        for line in hit["logged"]:
            logging.getLogger("treadle.data").warning("%s", line)
        return int(hit["rows"])
    with _logged("treadle.data") as logged:
        rows = reader(cfg, tokenizer.load(), file, key, tools)
    files = [data, *tokenizer.prints[0]]
    cache.store("rows", cache_key, {"rows": rows, "logged": logged}, files)
    return rows


@contextmanager
def _logged(name: str) -> Iterator[list[str]]:
    """The messages logged to ``name`` (and below) while inside, still logged as usual."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger(name).addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger(name).removeHandler(handler)


def _no_held_out(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    raise ConfigError("data.reasoning_gym.val_size=0: eval needs held-out rows")


def _prompt_rows(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    """The prompts of ``file``, every ground truth one ``reward.function`` takes (every
    command that reads prompts scores them with it)."""
    from treadle.trainers.datasets import config_prompts

    ds = config_prompts(cfg, [file], key, tokenizer, tools)
    files = cfg.data.source == "files"
    _check_ground_truths(cfg, ds, key, (cfg.reward.function, "reward.function"), files)
    return len(ds)


def _scoring_reward(cfg: Config, spec: str) -> str | None:
    """``spec`` when it scores every sample: an agent loop of the user's may give the
    trajectory's reward itself (a game's, an environment's), so the reward function may never
    see the ground truth; treadle's own loops (single_turn, tools) never do."""
    from treadle.agents.registry import BUILTIN_LOOPS

    return spec if cfg.rollout.agent_loop in BUILTIN_LOOPS else None


def _check_ground_truths(
    cfg: Config, ds: Any, key: str, reward: tuple[str, str], files: bool
) -> None:
    """Every row's ground truth is one the built-in reward ``reward`` (its spec and config key)
    takes, by its own rule (``treadle.rewards.functions.ground_truth_rule``): a bad one would
    stop the run at whichever step draws it. The first bad row is named (``files``: rows of files,
    whose column data.answer_key names)."""
    from treadle.rewards import ground_truth_rule

    spec, spec_key = reward
    scored = _scoring_reward(cfg, spec)
    if scored is not None:
        _checkreward_columns(cfg, ds, key, scored, spec_key)
    rule = ground_truth_rule(scored) if scored is not None else None
    if rule is None:
        return
    bad = [(row, problem) for row in ds.rows if (problem := rule(row["ground_truth"]))]
    if not bad:
        return
    (row, problem), others = bad[0], len(bad) - 1
    label, _, number = row["uid"].rpartition(":")
    where = f"{label} row {number}" if files else f"row {row['uid']}"
    truth = row["ground_truth"]
    shown = repr(truth if len(truth) <= 40 else truth[:37] + "...")
    notes = [f"{others} more row{'s' if others > 1 else ''} too"] if others else []
    if re.fullmatch(r"-?\d+\.0", truth):  # (the file's own number: it is not rewritten)
        notes.append(
            "a float column, as pandas writes integers with a missing value to Parquet: "
            "store the answers as integers or text"
        )
    if files:
        notes.append(f"data.answer_key={cfg.data.answer_key}: is it the right column?")
    said = f" ({'; '.join(notes)})" if notes else ""
    raise ConfigError(
        f"{key}: {where}: answer {shown} {problem}, which {spec_key}={spec} needs{said}"
    )


def _checkreward_columns(cfg: Config, ds: Any, key: str, spec: str, spec_key: str) -> None:
    """A batched reward gets the rows' columns: one it needs that a row lacks stopped the run
    at step 1 with the function's TypeError. The first such row is named."""
    needed = reward_columns(spec) or []
    for row in ds.rows:
        missing = [name for name in needed if name not in row["row"]]
        if not missing:
            continue
        label, _, number = row["uid"].rpartition(":")
        where = f"{label} row {number}" if cfg.data.source == "files" else f"row {row['uid']}"
        names = " and ".join(repr(name) for name in missing)
        plural = "s" if len(missing) > 1 else ""
        hint = (
            "set data.source=reasoning_gym (its rows have them) or use another reward"
            if spec == "reasoning_gym"
            else f"add the column{plural} to the data, or give the parameter{plural} a default"
        )
        raise ConfigError(
            f"{key}: {where} has no column{plural} {names}, which {spec_key}={spec} is called "
            f"with (a batched reward gets the rows' columns): {hint}"
        )


def _sft_rows(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    from treadle.trainers.datasets import config_sft

    return len(config_sft(cfg, [file], key, tokenizer))


def _pair_rows(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    from treadle.trainers.datasets import config_pairs

    return len(config_pairs(cfg, [file], key, tokenizer))


def _unpaired_rows(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    from treadle.trainers.datasets import config_unpaired

    return len(config_unpaired(cfg, [file], key, tokenizer))
