"""Preference pairs (DPO, reward models): a prompt, rendered as the RL prompts are, with a
chosen and a rejected response (text, or one assistant message), each tokenized as a rollout's
response: content + EOS. A file without the chosen/rejected columns fails naming the file and
the keys to set (``data.chosen_key``, ``data.rejected_key``).
"""

from __future__ import annotations

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


def _check_pair_columns(records: list[Record], keys: dict[str, str], config_key: str) -> None:
    """Every file has the prompt/chosen/rejected columns, else say which keys to set."""
    present: dict[str, dict[str, None]] = {}  # file -> columns with a value in some row
    for record in records:
        seen = present.setdefault(record.file, {})
        seen.update((k, None) for k, v in record.row.items() if v is not None)
    for file, seen in present.items():
        columns = list(seen)
        missing = [f"'{col}' (data.{key})" for key, col in keys.items() if col not in columns]
        if missing:
            raise DataError(
                f"{config_key}: {file} has no column {', '.join(missing)}; its columns are "
                f"{', '.join(columns) or 'none'}. A preference file needs a prompt, a chosen and "
                "a rejected response: set data.prompt_key, data.chosen_key and "
                "data.rejected_key to the columns that hold them"
            )


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
    shown, text, contents = prompt_text(record, options.prompt_key, tokenizer, options)
    chosen = response_text(record, options.chosen_key)
    rejected = response_text(record, options.rejected_key)
    if chosen == rejected:
        raise DataError(
            f"{record.where}: the chosen and rejected responses are the same, "
            "which teaches nothing: fix or drop the row"
        )
    answer = record.row.get(options.answer_key) if options.answer_key else None
    return PairRow(
        uid=record.uid,
        prompt_text=shown,
        prompt_ids=prompt_ids(tokenizer, text, contents, options),
        chosen_ids=response_ids(tokenizer, chosen, options),
        rejected_ids=response_ids(tokenizer, rejected, options),
        ground_truth=""
        if answer is None
        else answer_text(record, options.answer_key or "", answer),
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
