"""RL and evaluation prompts: rendered with the chat template, tokenized once, up front.

Each row keeps the prompt as written in the file (``prompt_text``, what reward functions see),
its token ids, the ground truth and a stable id ``<file>:<row>`` that the trainer uses as the
base of the GRPO group id (``uid``). Prompts are LEFT-padded (``collate_prompts``). A row with
pictures (``images_key``) is tokenized by the model's processor (:mod:`treadle.data.images`)
and keeps its pixel values; a batch of such rows has the field ``pixel_values``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from transformers import PreTrainedTokenizerBase

from treadle.data.images import PIXELS, image_prompt, stack_pixels
from treadle.data.options import TextOptions
from treadle.data.readers import Record, answer_text, read_records, require
from treadle.data.rows import Rows, keep, kept_within
from treadle.data.templating import (
    check_template,
    encode_prompt,
    pad_or_eos_id,
    prompt_text,
    special_strings,
    spells_special,
    tokenize,
)

if TYPE_CHECKING:
    import torch

    from treadle.protocol import Batch


class PromptRow(TypedDict):
    uid: str  # "<file>:<row>", stable across runs
    prompt_text: str  # the prompt as written in the file (last user message for a chat list)
    prompt_ids: list[int]  # the rendered prompt, tokenized
    ground_truth: str
    row: dict[str, Any]  # every column of the file's row (agent loops read extra ones)
    pixel_values: NotRequired[torch.Tensor]  # [images, 3, H, W]: a row with pictures


PromptDataset = Rows[PromptRow]  # RL prompts


def load_prompt_dataset(
    files: Sequence[str | Path],
    tokenizer: PreTrainedTokenizerBase,
    options: TextOptions,
) -> PromptDataset:
    """Read, validate, render and tokenize RL prompts.

    Prompts longer than ``options.max_prompt_length`` tokens are dropped with a logged count
    (``overlong="filter"``) or raise DataError naming file, row, length and limit ("error").
    Without an ``answer_key`` every ground truth is "" (for reward models). ``tools``: JSON
    schemas of the agent loop's tools, given to the chat template (or put into the system
    message: ``tool_messages``). Special-token strings in the prompts stay text unless
    ``allow_special_tokens``.
    """
    return prompt_dataset(read_records(files, options.config_key), tokenizer, options)


def prompt_dataset(
    records: Sequence[Record], tokenizer: PreTrainedTokenizerBase, options: TextOptions
) -> PromptDataset:
    """``load_prompt_dataset`` of rows already read (a source other than files)."""
    o = options
    check_template(tokenizer, o.apply_chat_template)
    parsed = [_parse(record, tokenizer, o) for record in records]
    ids = _prompt_ids(tokenizer, [p[1] for p in parsed], [p[2] for p in parsed], o)
    rows: list[PromptRow] = []
    for record, (shown, text, _, truth), text_ids in zip(records, parsed, ids, strict=True):
        pictures = image_prompt(record, o.images_key, text, o.processor)
        prompt_ids = text_ids if pictures is None else pictures[0]
        where = f"{record.where}: prompt is"
        if keep(where, len(prompt_ids), o.max_prompt_length, o.overlong, "max_prompt_length"):
            row = PromptRow(
                uid=record.uid,
                prompt_text=shown,
                prompt_ids=prompt_ids,
                ground_truth=truth,
                row=record.row,
            )
            if pictures is not None:
                row["pixel_values"] = pictures[1]
            rows.append(row)
    limit = f"max_prompt_length={o.max_prompt_length}"
    return kept_within(rows, len(records), pad_or_eos_id(tokenizer), o.config_key, limit, "prompt")


def _parse(
    record: Record, tokenizer: PreTrainedTokenizerBase, options: TextOptions
) -> tuple[str, str, list[str], str]:
    """(the prompt as written, the text the model is given, the user's texts, the truth)."""
    shown, text, contents = prompt_text(
        record, options.prompt_key, tokenizer, options, options.tools
    )
    key = options.answer_key
    truth = "" if key is None else answer_text(record, key, require(record, key, "answer"))
    return shown, text, contents, truth


def _prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    texts: list[str],
    contents: list[list[str]],
    options: TextOptions,
) -> list[list[int]]:
    """The prompts' ids: one fast batch call, then again one by one those whose user text
    spells a special token (it stays text)."""
    ids = tokenize(tokenizer, texts, special=not options.apply_chat_template)
    specials = special_strings(tokenizer)
    for i, content in enumerate(contents):
        if not options.allow_special_tokens and spells_special(specials, content):
            ids[i] = encode_prompt(
                tokenizer,
                texts[i],
                content,
                templated=options.apply_chat_template,
                allow_special=False,
                specials=specials,
            )
    return ids


def collate_prompts(
    token_id_lists: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """LEFT-pad prompts into `(input_ids [B, P], attention_mask [B, P])`, both int64."""
    import torch

    if not token_id_lists:
        raise ValueError("collate_prompts: empty batch")
    width = max(len(ids) for ids in token_id_lists)
    input_ids = torch.full((len(token_id_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_id_lists), width), dtype=torch.long)
    for i, ids in enumerate(token_id_lists):
        if ids:
            input_ids[i, width - len(ids) :] = torch.as_tensor(ids, dtype=torch.long)
            mask[i, width - len(ids) :] = 1
    return input_ids, mask


def prompt_batch(ds: PromptDataset, indices: list[int], pad_id: int, **meta: Any) -> Batch:
    """The prompt side of a batch: rows ``indices`` of ``ds``, left-padded."""
    from treadle.protocol import Batch

    rows = [ds[i] for i in indices]
    ids, mask = collate_prompts([r["prompt_ids"] for r in rows], pad_id)
    tensors = {"prompts": ids, "prompt_mask": mask}
    pixels = stack_pixels([r.get("pixel_values") for r in rows])
    if pixels is not None:
        tensors[PIXELS] = pixels
    return Batch.from_dict(
        tensors=tensors,
        objects={
            "uid": [r["uid"] for r in rows],
            "prompt_text": [r["prompt_text"] for r in rows],
            "ground_truth": [r["ground_truth"] for r in rows],
            "row": [r["row"] for r in rows],
        },
        meta=meta,
    )


def left_pad(batch: Batch, width: int) -> Batch:
    """``prompts``/``prompt_mask`` left-padded to ``width`` columns (to concat rounds)."""
    import torch

    extra = width - batch["prompts"].shape[1]
    if extra == 0:
        return batch
    out = batch.select(list(range(len(batch))))
    out["prompts"] = torch.nn.functional.pad(batch["prompts"], (extra, 0), value=0)
    out["prompt_mask"] = torch.nn.functional.pad(batch["prompt_mask"], (extra, 0), value=0)
    return out


def pad_prompts(batches: list[Batch]) -> Batch:
    """``batches`` concatenated, prompts left-padded to the widest."""
    from treadle.protocol import Batch

    if len(batches) == 1:
        return batches[0]
    width = max(b["prompts"].shape[1] for b in batches)
    return Batch.concat([left_pad(b, width) for b in batches])
