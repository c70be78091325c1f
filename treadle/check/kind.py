"""Which command a config is for, when ``treadle check`` is not told (``--kind``).

The settings only one command reads say it (the table of :mod:`treadle.config.rules.commands`):
``dpo`` is `treadle dpo`'s, ``kto`` `treadle kto`'s, ``teacher`` and ``distill`` `treadle
distill`'s, and RL's own (``algorithm``, ``critic``, ``prime``, ``async``, ``rollout.n``, the
reward model's, the LLM judge's, the curriculum's) `treadle train`'s. A config that sets none
of them is told by what it trains on: no training files, `treadle eval` (held-out sets) or
`treadle serve` (none); rows of preference pairs, `treadle rm` (a DPO config sets its ``dpo``
section, as examples/arithmetic/dpo.yaml does and rm.yaml does not); labelled completions,
`treadle kto`; worked answers or conversations (or reasoning-gym's rows, whose answers are the
targets), `treadle sft`; prompts alone, `treadle train`. A config that sets two commands'
settings, or whose rows cannot be read, is one it cannot tell: ``--kind`` is asked for; rows
that hold answers as well as responses (the demo's SFT and GRPO share them) are taken for SFT,
and the line says that ``--kind train`` checks them for RL.
"""

from __future__ import annotations

import json
from pathlib import Path

from treadle.config import Config
from treadle.config.rules import Kind
from treadle.config.rules.commands import PASS_RATE, changed_settings
from treadle.runtime.errors import ConfigError

# The settings that only one command reads (None: the whole section), and that command;
# "train" also stands for `treadle distill`, which runs the RL dataflow too.
OWN_SETTINGS: list[tuple[str, tuple[str, ...] | None, Kind]] = [
    ("dpo", None, "dpo"),
    ("kto", None, "kto"),
    ("teacher", None, "distill"),
    ("distill", None, "distill"),
    ("algorithm", None, "train"),
    ("critic", None, "train"),
    ("prime", None, "train"),
    ("async", None, "train"),
    ("rollout", ("n", "ignore_eos"), "train"),
    ("reward", ("model_path", "micro_batch_size", "overlong_buffer_len"), "train"),
    ("reward", ("overlong_penalty", "judge"), "train"),
    ("data", ("sampler", *(f"pass_rate_{k}" for k in PASS_RATE)), "train"),
]


def infer_kind(cfg: Config) -> tuple[Kind, str]:
    """The command ``cfg`` is for and why (the rest of a line: ``it sets dpo.beta=0.2``), or
    a ConfigError that asks for ``--kind``."""
    said: dict[Kind, list[str]] = {}
    for section, keys, kind in OWN_SETTINGS:
        settings = getattr(cfg, "async_" if section == "async" else section)
        names = [k for k in keys or type(settings).model_fields if k != "plugins"]
        said.setdefault(kind, []).extend(changed_settings(section, settings, names))
    found = {kind: shown for kind, shown in said.items() if shown}
    if "distill" in found:  # (distillation runs the RL dataflow: RL's settings are its too)
        found.pop("train", None)
    if len(found) > 1:
        parts = [f"{shown[0]} (`treadle {kind}`)" for kind, shown in found.items()]
        raise ConfigError(
            f"cannot tell which command the config is for: it sets {' and '.join(parts)}: "
            f"give --kind {' or --kind '.join(found)}"
        )
    if found:
        ((kind, shown),) = found.items()
        more = f" and {len(shown) - 1} more" if len(shown) > 1 else ""
        return kind, f"it sets {shown[0]}{more}"
    return _by_data(cfg)


def _by_data(cfg: Config) -> tuple[Kind, str]:
    """The command of a config that sets no command's own settings, by its data."""
    d = cfg.data
    if d.source == "reasoning_gym":
        return "sft", "no RL setting, and reasoning-gym's rows, with their answers to learn"
    if not d.train_files:
        if d.val_files or d.val_sets:
            return "eval", "no data.train_files, and held-out sets to evaluate"
        return "serve", "no data.train_files, nor held-out sets"
    file = d.train_files[0]
    columns = _columns(file)
    if columns is None:
        raise ConfigError(
            f"cannot tell which command the config is for: it sets no command's own section "
            f"(algorithm, dpo, kto, teacher, ...), and the columns of data.train_files' "
            f"'{file}' cannot be read: give --kind"
        )
    rows = "no RL setting, and data.train_files' rows hold"
    pairs, unpaired = (d.chosen_key, d.rejected_key), (d.completion_key, d.label_key)
    kinds: list[tuple[Kind, str]] = [
        ("rm", f"preference pairs ({', '.join(pairs)}) and no dpo section"),
        ("kto", f"labelled completions ({', '.join(unpaired)})"),
        ("sft", f"responses to learn ({d.response_key})"),
        ("sft", f"conversations to learn ({d.messages_key})"),
        ("sft", f"text to learn whole ({d.text_key}) and no prompts"),
    ]
    needs = [set(pairs), set(unpaired), {d.response_key}, {d.messages_key}, {d.text_key}]
    if d.prompt_key in columns:  # (a text column beside the prompts: RL's rows)
        kinds, needs = kinds[:-1], needs[:-1]
    for (kind, what), needed in zip(kinds, needs, strict=True):
        if needed <= columns:
            # (rows with answers too train RL as well: the demo's SFT and GRPO share them)
            rl = kind == "sft" and d.answer_key in columns
            return kind, f"{rows} {what}" + ("; --kind train checks it for RL" if rl else "")
    return "train", f"{rows} prompts without responses ({d.response_key})"


def _columns(file: str) -> set[str] | None:
    """The columns of a data file's first row (JSONL), or its schema's (Parquet); None when
    they cannot be read (the data checks say why)."""
    path = Path(file).expanduser()
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return set(pq.read_schema(path).names)
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    return set(row) if isinstance(row, dict) else None
    except (OSError, ValueError, ImportError):
        return None
    return None
