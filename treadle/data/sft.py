"""SFT examples: prompt + response + EOS with a loss mask over the response tokens, or a
``messages`` column for multi-turn chat with the loss on assistant turns only.

The prompt and each assistant turn are tokenized separately and concatenated, exactly as a
rollout sees them: prompt tokens from the template, response tokens generated up to the EOS.
Sequences are RIGHT-padded (``collate_sft``); ``loss_mask[t] == 1`` means token ``t`` is a
target, predicted from position ``t - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

from transformers import PreTrainedTokenizerBase

from treadle.data.images import image_prompt
from treadle.data.options import TextOptions
from treadle.data.readers import Record, as_text, read_records, require
from treadle.data.rows import Rows, keep, kept_within
from treadle.data.templating import (
    check_template,
    encode,
    encode_plain,
    encode_prompt,
    encode_response,
    end_of_turn,
    eos_token,
    pad_or_eos_id,
    prompt_ids,
    prompt_messages,
    prompt_text,
    render_row,
    response_ids,
    shared_length,
    special_strings,
)
from treadle.runtime.errors import DataError

if TYPE_CHECKING:
    import torch


class SFTRow(TypedDict):
    uid: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is a training target
    pixel_values: NotRequired[torch.Tensor]  # [images, 3, H, W]: a row with pictures


SFTDataset = Rows[SFTRow]  # SFT examples with their loss masks


def load_sft_dataset(
    files: Sequence[str | Path], tokenizer: PreTrainedTokenizerBase, options: TextOptions
) -> SFTDataset:
    """Read, validate and tokenize SFT examples.

    A row holds ``prompt_key`` and ``response_key`` (single turn: loss on the response and the
    EOS) or, when it has no ``prompt_key``, a ``messages_key`` list of chat messages (loss on
    every assistant turn). Examples longer than ``options.sft_max_length`` tokens are filtered
    or raise, as prompts.
    """
    return sft_dataset(read_records(files, options.config_key), tokenizer, options)


def sft_dataset(
    records: Sequence[Record], tokenizer: PreTrainedTokenizerBase, options: TextOptions
) -> SFTDataset:
    """``load_sft_dataset`` of rows already read (a source other than files)."""
    o, max_length = options, options.sft_max_length
    check_template(tokenizer, o.apply_chat_template)
    rows: list[SFTRow] = []
    for record in records:
        ids, mask, pixels = _sft_example(record, tokenizer, o)
        if keep(f"{record.where}: example is", len(ids), max_length, o.overlong, "max_length"):
            row = SFTRow(uid=record.uid, input_ids=ids, loss_mask=mask)
            if pixels is not None:
                row["pixel_values"] = pixels
            rows.append(row)
    limit = f"max_length={max_length}"
    return kept_within(rows, len(records), pad_or_eos_id(tokenizer), o.config_key, limit, "example")


def _sft_example(
    record: Record, tokenizer: PreTrainedTokenizerBase, options: TextOptions
) -> tuple[list[int], list[int], torch.Tensor | None]:
    """``(ids, loss_mask, pixel values or None)`` of a prompt/response row (its prompt through
    the image processor when it has pictures), a chat (``messages_key``) row or a plain text
    (``text_key``) row."""
    row, key = record.row, options.messages_key
    if row.get(options.prompt_key) is None and row.get(key) is not None:
        if not options.apply_chat_template:
            raise DataError(f"{record.where}: '{key}' needs data.apply_chat_template=true")
        if row.get(options.images_key):
            raise DataError(f"{record.where}: images go with prompt/response rows, not '{key}'")
        return *_sft_messages(record, tokenizer, options), None
    if row.get(options.prompt_key) is None and row.get(options.text_key) is not None:
        return *_sft_text(record, tokenizer, options), None
    _, text, contents = prompt_text(record, options.prompt_key, tokenizer, options)
    response = as_text(require(record, options.response_key, "response"))
    pictures = image_prompt(record, options.images_key, text, options.processor)
    if pictures is not None:
        prompt, pixels = pictures
    else:
        prompt, pixels = prompt_ids(tokenizer, text, contents, options), None
    response_part = response_ids(tokenizer, response, options)
    return prompt + response_part, [0] * len(prompt) + [1] * len(response_part), pixels


def _sft_messages(
    record: Record,
    tokenizer: PreTrainedTokenizerBase,
    options: TextOptions,
) -> tuple[list[int], list[int]]:
    """Multi-turn: every assistant turn (content + end-of-turn token) is a target,
    everything else context.

    The template must write an assistant turn as its content (or that content trimmed, as
    Gemma's does, or after a space, as SmolVLM's) followed by its end-of-turn token
    (:func:`end_of_turn`: ChatML's ``<|im_end|>``, Gemma's ``<end_of_turn>``), as most
    templates do; the target is the turn as the template writes it. Where the template
    renders a conversation as a prefix of its continuations, each turn's context is what the
    model was given for it (:func:`_turn_by_turn`); where it does not (Qwen3's drops an earlier
    turn's thinking block once a user message follows), the conversation is the template's
    rendering of the whole of it (:func:`_in_one_render`).
    """
    key = options.messages_key
    messages = prompt_messages(record, key, require(record, key, "messages"), options.system_prompt)
    if messages[0]["role"] == "assistant":
        raise DataError(f"{record.where}: '{key}' starts with an assistant turn")
    try:
        pieces = _turn_by_turn(record, tokenizer, key, messages)
    except _NotAPrefix:
        pieces = _in_one_render(record, tokenizer, key, messages)
    if not pieces:
        raise DataError(f"{record.where}: '{key}' has no assistant turn to train on")
    return _encoded(tokenizer, options, pieces)


def _sft_text(
    record: Record, tokenizer: PreTrainedTokenizerBase, options: TextOptions
) -> tuple[list[int], list[int]]:
    """A plain text row (TRL's language-modeling format): its tokens with the tokenizer's BOS
    where it has one, then its EOS; every token after the first is a target."""
    text = as_text(require(record, options.text_key, "text"))
    if options.allow_special_tokens:
        ids = encode(tokenizer, text, special=True)
    else:
        ids = encode_plain(tokenizer, text, bos=True)
    ids = [*ids, eos_token(tokenizer)[0]]
    return ids, [0] + [1] * (len(ids) - 1)


class _NotAPrefix(Exception):
    """The template writes a conversation differently once more turns follow."""


# A turn to train on: the rendered text before it (from the previous turn's end), the contents
# of the messages in that text, the turn as written up to its end-of-turn token.
_Piece = tuple[str, list[str], str]


def _written(text: str, end_text: str) -> tuple[str, ...]:
    """How a template may write an assistant turn's ``text``, up to its end-of-turn token: as
    it is, trimmed, or after a space."""
    return tuple(c + end_text for c in (text, text.strip(), " " + text.strip()))


def _turn_by_turn(
    record: Record, tokenizer: PreTrainedTokenizerBase, key: str, messages: list[dict[str, str]]
) -> list[_Piece]:
    """Each assistant turn after its context: the template's rendering of the conversation up
    to it with the generation prompt, which each longer rendering must start with."""
    end_text = end_of_turn(tokenizer)[1]
    pieces: list[_Piece] = []
    done = ""  # the rendered text already taken
    first = 0  # the first message not yet taken
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context = render_row(record, key, tokenizer, messages[:i], generation=True)
        turns = render_row(record, key, tokenizer, messages[: i + 1], generation=False)
        if not (context.startswith(done) and turns.startswith(context)):
            raise _NotAPrefix
        rest = turns[len(context) :]
        written = [w for w in _written(message["content"], end_text) if rest.startswith(w)]
        if not written:
            raise _NotAPrefix
        pieces.append((context[len(done) :], [m["content"] for m in messages[first:i]], written[0]))
        done, first = context + written[0], i + 1
    return pieces


def _in_one_render(
    record: Record, tokenizer: PreTrainedTokenizerBase, key: str, messages: list[dict[str, str]]
) -> list[_Piece]:
    """The whole conversation as the template renders it, each assistant turn found in it in
    order, after the turn's header (what the template writes for the conversation before it
    with the generation prompt, as far as the whole starts with it). A turn with reasoning
    (``<think>...</think>``) that the template writes without it (Qwen3's earlier turns) is
    its answer alone; written otherwise (its thinking block rewritten), it is refused."""
    end_text = end_of_turn(tokenizer)[1]
    text = render_row(record, key, tokenizer, messages, generation=False)
    pieces: list[_Piece] = []
    at = 0  # where the text not yet taken starts
    first = 0  # the first message not yet taken
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        header = render_row(record, key, tokenizer, messages[:i], generation=True)
        start = max(at, shared_length(header, text))
        places = [(text.find(w, start), w) for w in _written(message["content"], end_text)]
        if "</think>" in message["content"]:
            answer = message["content"].rsplit("</think>", maxsplit=1)[-1].strip() + end_text
            where = text.find(answer, start)
            if where >= 0 and "<think>" not in text[start:where]:
                places.append((where, answer))
        places = [(where, w) for where, w in places if where >= 0]
        if not places:
            raise _template_error(record)
        where, written = min(places)
        pieces.append((text[at:where], [m["content"] for m in messages[first:i]], written))
        at, first = where + len(written), i + 1
    return pieces


def _encoded(
    tokenizer: PreTrainedTokenizerBase, options: TextOptions, pieces: list[_Piece]
) -> tuple[list[int], list[int]]:
    """``(ids, loss mask)`` of the turns: each context as a templated prompt (its messages'
    special-token strings stay text), each turn's content as a response, then the
    end-of-turn token; the turns are the targets."""
    end_id, end_text = end_of_turn(tokenizer)
    specials, allow_special = special_strings(tokenizer), options.allow_special_tokens
    ids: list[int] = []
    mask: list[int] = []
    for context, contents, written in pieces:
        context_ids = encode_prompt(
            tokenizer,
            context,
            contents,
            templated=True,
            allow_special=allow_special,
            specials=specials,
        )
        content = written.removesuffix(end_text)
        turn_ids = [*encode_response(tokenizer, content, allow_special=allow_special), end_id]
        ids += context_ids + turn_ids
        mask += [0] * len(context_ids) + [1] * len(turn_ids)
    return ids, mask


def _template_error(record: Record) -> DataError:
    return DataError(
        f"{record.where}: the chat template does not write the conversation's assistant turns "
        "as their content + end-of-turn token, which multi-turn SFT needs; use "
        "prompt/response columns instead"
    )


def collate_sft(
    rows: Sequence[SFTRow], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RIGHT-pad SFT rows into `(input_ids, attention_mask, loss_mask)`, each `[B, L]` int64."""
    import torch

    if not rows:
        raise ValueError("collate_sft: empty batch")
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
    return input_ids, attention_mask, loss_mask
