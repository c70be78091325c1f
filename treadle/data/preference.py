"""Preference data: pairs (DPO, reward models) and unpaired examples (KTO).

- **Pairs**: a prompt, rendered as the RL prompts are, with a chosen and a rejected response
  (text, or one assistant message), each tokenized as a rollout's response: content + EOS; or,
  without a prompt, two whole conversations that differ in their last message (TRL's
  implicit prompt, :func:`implicit_prompt`). A file without the chosen/rejected columns fails
  naming the file and the keys to set (``data.chosen_key``, ``data.rejected_key``).
- **Unpaired examples**: a prompt, a completion and a boolean label (desirable or not), TRL's
  unpaired preference format; a file of pairs is read as two examples per pair (chosen
  desirable, rejected not).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from transformers import PreTrainedTokenizerBase

from treadle.data.options import TextOptions
from treadle.data.prompts import collate_prompts
from treadle.data.readers import Record, answer_text, check_messages, read_records, require
from treadle.data.rows import Rows, keep, kept, right_padded
from treadle.data.templating import (
    check_template,
    pad_or_eos_id,
    prompt_ids,
    prompt_text,
    response_ids,
)
from treadle.runtime.errors import DataError

if TYPE_CHECKING:
    import torch


class PairRow(TypedDict):
    uid: str
    prompt_text: str
    prompt_ids: list[int]
    chosen_ids: list[int]  # response tokens + EOS
    rejected_ids: list[int]
    ground_truth: str  # the answer column when the file has one, else ""


PairDataset = Rows[PairRow]  # preference pairs


def _columns_by_file(records: list[Record]) -> dict[str, list[str]]:
    """Each file's columns that hold a value in some row, in the order they first appear."""
    present: dict[str, dict[str, None]] = {}
    for record in records:
        seen = present.setdefault(record.file, {})
        seen.update((k, None) for k, v in record.row.items() if v is not None)
    return {file: list(seen) for file, seen in present.items()}


def _ground_truth(record: Record, options: TextOptions) -> str:
    """The row's answer column when the file has one (for a task evaluation), else ""."""
    answer = record.row.get(options.answer_key) if options.answer_key else None
    return "" if answer is None else answer_text(record, options.answer_key or "", answer)


def _check_pair_columns(records: list[Record], keys: dict[str, str], config_key: str) -> None:
    """Every file has the prompt/chosen/rejected columns (the prompt may be implicit:
    :func:`implicit_prompt`), else say which keys to set."""
    chosen = keys["chosen_key"]
    texts = {r.file for r in records if not isinstance(r.row.get(chosen), list)}
    conversations = {r.file for r in records} - texts
    for file, columns in _columns_by_file(records).items():
        implicit = {"prompt_key"} if file in conversations else set()
        missing = [
            f"'{col}' (data.{key})"
            for key, col in keys.items()
            if col not in columns and key not in implicit
        ]
        if missing:
            raise DataError(
                f"{config_key}: {file} has no column {', '.join(missing)}; its columns are "
                f"{', '.join(columns) or 'none'}. A preference file needs a prompt, a chosen and "
                "a rejected response: set data.prompt_key, data.chosen_key and "
                "data.rejected_key to the columns that hold them"
            )


def implicit_prompt(record: Record, options: TextOptions) -> Record:
    """A pair row without a prompt whose chosen and rejected are whole conversations (TRL's
    implicit-prompt format: Anthropic HH, UltraFeedback binarized) as one with its prompt: the
    messages both start with, each response its last assistant message. Other rows as they
    are."""
    o = options
    chosen, rejected = record.row.get(o.chosen_key), record.row.get(o.rejected_key)
    if record.row.get(o.prompt_key) is not None or not isinstance(chosen, list):
        return record
    chosen = check_messages(record, o.chosen_key, chosen)
    rejected = check_messages(record, o.rejected_key, rejected)
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    ends = (chosen[n:], rejected[n:])
    if not n or any(len(end) != 1 or end[0]["role"] != "assistant" for end in ends):
        raise DataError(
            f"{record.where}: without a '{o.prompt_key}' field (data.prompt_key), "
            f"'{o.chosen_key}' and '{o.rejected_key}' must be conversations that differ only in "
            f"their last message, the assistant's (they share {n} message(s), then have "
            f"{len(ends[0])} and {len(ends[1])})"
        )
    row = {**record.row, o.prompt_key: chosen[:n], o.chosen_key: ends[0], o.rejected_key: ends[1]}
    return dataclasses.replace(record, row=row)


def response_text(record: Record, key: str) -> str:
    value = require(record, key, "response")
    if isinstance(value, str):
        return value
    ok = isinstance(value, list) and len(value) == 1
    message = check_messages(record, key, value)[0] if ok else None
    if message is None or message["role"] != "assistant":
        raise DataError(
            f"{record.where}: field '{key}' must be a string or a list of one "
            "{'role': 'assistant', 'content': str} message"
        )
    return message["content"]


def _pair_row(record: Record, tokenizer: PreTrainedTokenizerBase, options: TextOptions) -> PairRow:
    record = implicit_prompt(record, options)
    shown, text, contents = prompt_text(record, options.prompt_key, tokenizer, options)
    chosen = response_text(record, options.chosen_key)
    rejected = response_text(record, options.rejected_key)
    if chosen == rejected:
        raise DataError(
            f"{record.where}: the chosen and rejected responses are the same, "
            "which teaches nothing: fix or drop the row"
        )
    return PairRow(
        uid=record.uid,
        prompt_text=shown,
        prompt_ids=prompt_ids(tokenizer, text, contents, options),
        chosen_ids=response_ids(tokenizer, chosen, options),
        rejected_ids=response_ids(tokenizer, rejected, options),
        ground_truth=_ground_truth(record, options),
    )


def load_pair_dataset(
    files: Sequence[str | Path], tokenizer: PreTrainedTokenizerBase, options: TextOptions
) -> PairDataset:
    """Read, validate and tokenize preference pairs (prompt, chosen, rejected).

    A prompt longer than ``max_prompt_length`` tokens or a response (with its EOS) longer than
    ``max_response_length`` drops the pair with a logged count or raises, as for prompts. The
    ``answer_key`` column is optional (kept as ``ground_truth`` for a task evaluation).
    """
    o = options
    check_template(tokenizer, o.apply_chat_template)
    records = read_records(files, o.config_key)
    keys = {"prompt_key": o.prompt_key, "chosen_key": o.chosen_key, "rejected_key": o.rejected_key}
    _check_pair_columns(records, keys, o.config_key)
    limits = {
        "prompt": ("data.max_prompt_length", o.max_prompt_length),
        "chosen": ("rollout.max_new_tokens", o.max_response_length),
        "rejected": ("rollout.max_new_tokens", o.max_response_length),
    }
    rows: list[PairRow] = []
    for record in records:
        row = _pair_row(record, tokenizer, o)
        lengths = {
            "prompt": len(row["prompt_ids"]),
            "chosen": len(row["chosen_ids"]),
            "rejected": len(row["rejected_ids"]),
        }
        if all(
            keep(f"{record.where}: {part} is", lengths[part], limit, o.overlong, name)
            for part, (name, limit) in limits.items()
        ):
            rows.append(row)
    return kept(
        rows,
        len(records),
        pad_or_eos_id(tokenizer),
        o.config_key,
        f"pairs with a prompt over data.max_prompt_length={o.max_prompt_length} or a response "
        f"over rollout.max_new_tokens={o.max_response_length} tokens",
        "every pair is over the length limits: raise data.max_prompt_length (prompts) or "
        "rollout.max_new_tokens (chosen and rejected responses)",
    )


def collate_pairs(rows: Sequence[PairRow], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompts LEFT-padded, chosen and rejected RIGHT-padded to one response width.

    Keys: `prompts`, `prompt_mask` `[B, P]`; `chosen`, `chosen_mask`, `rejected`,
    `rejected_mask` `[B, R]`; all int64. Row i of `prompts` followed by row i of either
    response is a whole sequence, as a rollout lays it out.
    """
    if not rows:
        raise ValueError("collate_pairs: empty batch")
    prompts, prompt_mask = collate_prompts([r["prompt_ids"] for r in rows], pad_id)
    width = max(max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows)
    out = {"prompts": prompts, "prompt_mask": prompt_mask}
    chosen = [r["chosen_ids"] for r in rows]
    out["chosen"], out["chosen_mask"] = right_padded(chosen, pad_id, width)
    rejected = [r["rejected_ids"] for r in rows]
    out["rejected"], out["rejected_mask"] = right_padded(rejected, pad_id, width)
    return out


# ---- unpaired examples (KTO) ------------------------------------------------------------


class UnpairedRow(TypedDict):
    uid: str
    prompt_text: str
    prompt_ids: list[int]
    completion_ids: list[int]  # response tokens + EOS
    label: bool  # desirable
    ground_truth: str


# unpaired examples (KTO): a prompt, a completion, whether it is desirable
UnpairedDataset = Rows[UnpairedRow]


def _unpaired_kind(records: list[Record], options: TextOptions) -> str:
    """ "unpaired" (completion + label columns) or "pairs" (chosen + rejected), for all files."""
    kinds = set()
    for file, columns in _columns_by_file(records).items():
        if {options.completion_key, options.label_key} <= set(columns):
            kinds.add("unpaired")
        elif {options.chosen_key, options.rejected_key} <= set(columns):
            kinds.add("pairs")
        else:
            raise DataError(
                f"{options.config_key}: {file} has neither the columns "
                f"'{options.completion_key}' and "
                f"'{options.label_key}' (data.completion_key, data.label_key) of unpaired "
                f"examples nor '{options.chosen_key}' and '{options.rejected_key}' "
                f"(data.chosen_key, data.rejected_key) of pairs; its columns are "
                f"{', '.join(columns) or 'none'}"
            )
    if len(kinds) > 1:
        raise DataError(f"{options.config_key}: mixes files of pairs and of unpaired examples")
    return kinds.pop() if kinds else "unpaired"


def _label(record: Record, key: str) -> bool:
    value = record.row.get(key)
    if not isinstance(value, bool):
        raise DataError(
            f"{record.where}: label field '{key}' must be true or false (desirable or not), "
            f"got {value!r}"
        )
    return value


def _examples(
    record: Record, pairs: bool, tokenizer: PreTrainedTokenizerBase, options: TextOptions
) -> list[UnpairedRow]:
    """The row's example, or a pair's two (chosen: desirable, then rejected)."""
    o = options
    record = implicit_prompt(record, o) if pairs else record
    shown, text, contents = prompt_text(record, o.prompt_key, tokenizer, o)
    if pairs:
        examples = [
            (f"{record.uid}:chosen", response_text(record, o.chosen_key), True),
            (f"{record.uid}:rejected", response_text(record, o.rejected_key), False),
        ]
    else:
        completion = response_text(record, o.completion_key)
        examples = [(record.uid, completion, _label(record, o.label_key))]
    prompt, truth = prompt_ids(tokenizer, text, contents, o), _ground_truth(record, o)
    return [
        UnpairedRow(
            uid=uid,
            prompt_text=shown,
            prompt_ids=prompt,
            completion_ids=response_ids(tokenizer, c, o),
            label=label,
            ground_truth=truth,
        )
        for uid, c, label in examples
    ]


def _within_limits(
    record: Record, group: list[UnpairedRow], options: TextOptions
) -> list[UnpairedRow]:
    """The examples of one row whose prompt and completion fit (or DataError, as ``overlong``)."""
    o, where = options, record.where
    prompt = len(group[0]["prompt_ids"])
    limit_name = "data.max_prompt_length"
    if not keep(f"{where}: prompt is", prompt, o.max_prompt_length, o.overlong, limit_name):
        return []
    limit, limit_name = o.max_response_length, "rollout.max_new_tokens"
    return [
        row
        for row in group
        if keep(
            f"{where}: completion is", len(row["completion_ids"]), limit, o.overlong, limit_name
        )
    ]


def load_unpaired_dataset(
    files: Sequence[str | Path], tokenizer: PreTrainedTokenizerBase, options: TextOptions
) -> UnpairedDataset:
    """Read, validate and tokenize unpaired examples (KTO).

    The columns are ``options``' ``prompt_key``, ``completion_key``, ``label_key``,
    ``chosen_key``, ``rejected_key``, ``answer_key``. Files hold either unpaired rows (prompt,
    completion, label: bool), TRL's unpaired preference format, or pairs, each read as two
    examples (chosen desirable, rejected not). Length limits as for pairs: an example over them
    is dropped (or raises).
    """
    o = options
    check_template(tokenizer, o.apply_chat_template)
    records = read_records(files, o.config_key)
    pairs = _unpaired_kind(records, o) == "pairs"
    rows: list[UnpairedRow] = []
    n_examples = 0
    for record in records:
        group = _examples(record, pairs, tokenizer, o)
        n_examples += len(group)
        rows += _within_limits(record, group, o)
    return kept(
        rows,
        n_examples,
        pad_or_eos_id(tokenizer),
        o.config_key,
        f"examples with a prompt over data.max_prompt_length={o.max_prompt_length} or a "
        f"completion over rollout.max_new_tokens={o.max_response_length} tokens",
        "every example is over the length limits: raise data.max_prompt_length (prompts) or "
        "rollout.max_new_tokens (completions)",
    )


def collate_unpaired(rows: Sequence[UnpairedRow], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompts LEFT-padded, completions RIGHT-padded, labels, and KTO's mismatched pairs.

    Keys: `prompts`, `prompt_mask` `[B, P]`; `completions`, `completion_mask` `[B, R]`;
    `labels` `[B]` (1: desirable); `kl_completions`, `kl_completion_mask`: row i holds the
    completion of row i - k (cyclically), so prompt i + KL completion i is a prompt with
    another example's completion. TRL rotates completions by k = 1; here k is the smallest
    shift that pairs no row with a completion of its own prompt (1 when none does), so that
    the two examples a pair file gives one prompt, adjacent in an unshuffled batch, are not
    paired with each other.
    """
    import torch

    if not rows:
        raise ValueError("collate_unpaired: empty batch")
    prompts, prompt_mask = collate_prompts([r["prompt_ids"] for r in rows], pad_id)
    completions, completion_mask = right_padded([r["completion_ids"] for r in rows], pad_id)
    keys = [tuple(r["prompt_ids"]) for r in rows]
    shift = next(
        (k for k in range(1, len(rows)) if all(keys[i] != keys[i - k] for i in range(len(rows)))),
        1,
    )
    return {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "completions": completions,
        "completion_mask": completion_mask,
        "labels": torch.tensor([int(r["label"]) for r in rows], dtype=torch.long),
        "kl_completions": torch.roll(completions, shift, dims=0),
        "kl_completion_mask": torch.roll(completion_mask, shift, dims=0),
    }
