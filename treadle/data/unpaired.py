"""Unpaired examples (KTO): a prompt, a completion and a boolean label (desirable or not),
TRL's unpaired preference format; a file of pairs is read as two examples per pair (chosen
desirable, rejected not)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from transformers import PreTrainedTokenizerBase

from treadle.data.options import TextOptions
from treadle.data.pairs import response_text
from treadle.data.prompts import collate_prompts
from treadle.data.readers import Record, answer_text, read_records
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


class UnpairedRow(TypedDict):
    uid: str
    prompt_text: str
    prompt_ids: list[int]
    completion_ids: list[int]  # response tokens + EOS
    label: bool  # desirable
    ground_truth: str


UnpairedDataset = Rows[
    UnpairedRow
]  # unpaired examples (KTO): a prompt, a completion, whether it is desirable


def _unpaired_kind(records: list[Record], options: TextOptions) -> str:
    """ "unpaired" (completion + label columns) or "pairs" (chosen + rejected), for all files."""
    seen: dict[str, dict[str, None]] = {}
    for record in records:
        seen.setdefault(record.file, {}).update(
            (k, None) for k, v in record.row.items() if v is not None
        )
    kinds = set()
    for file, columns in seen.items():
        if {options.completion_key, options.label_key} <= columns.keys():
            kinds.add("unpaired")
        elif {options.chosen_key, options.rejected_key} <= columns.keys():
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
    shown, text, contents = prompt_text(record, o.prompt_key, tokenizer, o)
    if pairs:
        examples = [
            (f"{record.uid}:chosen", response_text(record, o.chosen_key), True),
            (f"{record.uid}:rejected", response_text(record, o.rejected_key), False),
        ]
    else:
        completion = response_text(record, o.completion_key)
        examples = [(record.uid, completion, _label(record, o.label_key))]
    prompt = prompt_ids(tokenizer, text, contents, o)
    answer = record.row.get(o.answer_key) if o.answer_key else None
    return [
        UnpairedRow(
            uid=uid,
            prompt_text=shown,
            prompt_ids=prompt,
            completion_ids=response_ids(tokenizer, c, o),
            label=label,
            ground_truth="" if answer is None else answer_text(record, o.answer_key or "", answer),
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
