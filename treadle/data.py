"""Datasets from local files, prompt templating, length filtering and a resumable sampler.

Files are JSONL (`.jsonl`, `.json`), Parquet (`.parquet`) or folders written by
`datasets.Dataset.save_to_disk` (what `treadle.train(train_dataset=Dataset)` writes), read
through `datasets`. Every bad row is reported with its file and 1-based row:
`data.train_files: train.jsonl row 7: prompt field 'prompt' is missing or empty`.

RL prompts (`load_prompt_dataset`) are rendered with the tokenizer's chat template (one user
message, optionally after a system message; a prompt field may also hold a list of chat
messages) and tokenized once, up front. Each row keeps the prompt as written in the file
(`prompt_text`, what reward functions see), its token ids, the ground truth and a stable id
`<file>:<row>` that the trainer uses as the base of the GRPO group id (`uid`).

SFT examples (`load_sft_dataset`) are prompt + response + EOS with a loss mask over the response
tokens, or a `messages` column for multi-turn chat with the loss on assistant turns only. The
prompt and each assistant turn are tokenized separately and concatenated, exactly as a rollout
sees them: prompt tokens from the template, response tokens generated up to the EOS.

Preference pairs (`load_pair_dataset`, for DPO and reward models) are a prompt, rendered as
the RL prompts are, with a chosen and a rejected response (text, or one assistant message),
each tokenized as a rollout's response: content + EOS. A file without the chosen/rejected
columns fails naming the file and the keys to set (`data.chosen_key`, `data.rejected_key`).
Unpaired examples (`load_unpaired_dataset`, for KTO) are a prompt, a completion and a boolean
label (desirable or not), TRL's unpaired preference format; a file of pairs is read as two
examples per pair.

Text in a file that spells a special token (`<|im_end|>`, `</s>`) stays plain text unless
`allow_special_tokens`: user text is tokenized with `split_special_tokens=True`, and a rendered
chat template is split at its own special tokens, the user's content between them tokenized as
plain text. Rows without such strings are tokenized exactly as before (one call on the whole
text), so their ids do not change.

A file that does not parse (not UTF-8, bad JSON, a row that is not an object) fails naming the
file and the 1-based row (blank lines are not rows).

Layout: prompts are left-padded (`collate_prompts`), SFT sequences right-padded (`collate_sft`).
`loss_mask[t] == 1` means token `t` is a target, predicted from position `t - 1`.

`ResumableSampler` shuffles per epoch from `(seed, epoch)` alone, so its state is three integers
and a resumed run draws exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypedDict, TypeVar

import numpy as np
import torch
from datasets import load_dataset
from transformers import PreTrainedTokenizerBase

from treadle.errors import ConfigError, DataError

if TYPE_CHECKING:
    from treadle.config import Config

logger = logging.getLogger(__name__)

Overlong = Literal["filter", "error"]
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class PromptRow(TypedDict):
    uid: str  # "<file>:<row>", stable across runs
    prompt_text: str  # the prompt as written in the file (last user message for a chat list)
    prompt_ids: list[int]  # the rendered prompt, tokenized
    ground_truth: str
    row: dict[str, Any]  # every column of the file's row (agent loops read extra ones)


class SFTRow(TypedDict):
    uid: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is a training target


R = TypeVar("R")


@dataclass
class Rows(Generic[R]):
    """Tokenized rows of one kind. `pad_id` is the tokenizer's pad token (its EOS when it has
    none); `n_filtered` counts the examples dropped for their length."""

    rows: list[R]
    pad_id: int
    n_filtered: int = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> R:
        return self.rows[index]


PromptDataset = Rows[PromptRow]  # RL prompts
SFTDataset = Rows[SFTRow]  # SFT examples with their loss masks


# --- reading files ---------------------------------------------------------------------------


@dataclass
class _Record:
    where: str  # "data.train_files: train.jsonl row 7", for messages
    uid: str
    row: dict[str, Any]
    file: str = ""


def _read_records(files: Sequence[str | Path], config_key: str) -> list[_Record]:
    """All rows of all files, each with its message prefix and stable id."""
    if isinstance(files, (str, Path)):
        files = [files]
    names = [Path(f).name for f in files]
    unique_names = len(set(names)) == len(names)
    records = []
    for file, name in zip(files, names, strict=True):
        label = name if unique_names else str(file)
        rows = _read_file(Path(file), config_key)
        records += [
            _Record(f"{config_key}: {file} row {i}", f"{label}:{i}", row, str(file))
            for i, row in enumerate(rows, start=1)
        ]
    if not records:
        raise DataError(f"{config_key}: no rows in {', '.join(map(str, files)) or 'no files'}")
    return records


def _read_file(path: Path, config_key: str) -> list[dict[str, Any]]:
    if path.is_dir():
        return _read_saved(path, config_key)
    if not path.is_file():
        raise DataError(f"{config_key}: file '{path}' does not exist")
    builder = _FORMATS.get(path.suffix.lower())
    if builder is None:
        raise DataError(
            f"{config_key}: '{path}' is not JSONL (.jsonl, .json), Parquet (.parquet) or a "
            "folder written by Dataset.save_to_disk"
        )
    if path.stat().st_size == 0:
        return []
    datasets_log = logging.getLogger("datasets")
    level = datasets_log.level
    datasets_log.setLevel(logging.CRITICAL)  # it logs a parse error before raising it
    try:
        rows = list(load_dataset(builder, data_files=str(path), split="train"))
    except Exception as e:  # datasets wraps parse errors in several exception types
        bad_row = _find_bad_row(path) if builder == "json" else None
        cause = bad_row or (str(e).splitlines() or [type(e).__name__])[0]
        raise DataError(f"{config_key}: cannot read '{path}': {cause}") from None
    finally:
        datasets_log.setLevel(level)
    return rows


def _read_saved(path: Path, config_key: str) -> list[dict[str, Any]]:
    """The rows of a folder written by ``Dataset.save_to_disk`` (one split of a DatasetDict's
    folder: ``folder/train``)."""
    from datasets import Dataset, load_from_disk

    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise DataError(
            f"{config_key}: '{path}' holds a DatasetDict: name one split's folder "
            f"({', '.join(f'{path}/{name}' for name in splits) or 'none found'})"
        )
    if not (path / "state.json").is_file():
        raise DataError(
            f"{config_key}: '{path}' is a folder, but not one written by Dataset.save_to_disk "
            "(no state.json in it)"
        )
    try:
        ds = load_from_disk(str(path))
    except Exception as e:  # a damaged folder: arrow and json errors of several kinds
        raise DataError(f"{config_key}: cannot read '{path}': {e}") from None
    assert isinstance(ds, Dataset)
    return [dict(row) for row in ds]


def _find_bad_row(path: Path) -> str | None:
    """Which row of a JSON Lines file (or JSON array) does not parse, and why; None if all do.

    `datasets` says 'JSON parse error ... in row 0' (its row count, 0-based within a block)
    or only 'utf-8 codec can't decode'; this names the 1-based row as the file numbers it.
    """
    data = path.read_bytes()
    if data.lstrip().startswith(b"["):  # a .json file holding one array of rows
        return _bad_array_row(data)
    row = 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        row += 1
        try:
            value = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            return f"row {row}: not UTF-8 (byte {e.start} of the row)"
        except json.JSONDecodeError as e:
            return f"row {row}: not valid JSON (column {e.colno}: {e.msg})"
        if not isinstance(value, dict):
            return f"row {row}: not a JSON object (a {_json_type(value)})"
    return None


def _bad_array_row(data: bytes) -> str | None:
    try:
        rows = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        return f"not UTF-8 (byte {e.start} of the file)"
    except json.JSONDecodeError as e:
        return f"not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}"
    for i, value in enumerate(rows if isinstance(rows, list) else [], start=1):
        if not isinstance(value, dict):
            return f"row {i}: not a JSON object (a {_json_type(value)})"
    return None


def _json_type(value: Any) -> str:
    names = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return names.get(type(value), "null" if value is None else type(value).__name__)


def _require(record: _Record, key: str, what: str) -> Any:
    value = record.row.get(key)
    blank = isinstance(value, str) and not value.strip()
    if value is None or blank or (isinstance(value, list) and not value):
        raise DataError(f"{record.where}: {what} field '{key}' is missing or empty")
    return value


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _check_messages(record: _Record, key: str, value: Any) -> list[dict[str, str]]:
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        raise DataError(
            f"{record.where}: field '{key}' must be a string or a list of "
            "{'role': str, 'content': str} messages"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


# --- prompts ---------------------------------------------------------------------------------


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError("model.path: the tokenizer has neither a pad nor an EOS token")
    return int(pad)


def _check_template(tokenizer: PreTrainedTokenizerBase, apply_chat_template: bool) -> None:
    if apply_chat_template and not tokenizer.chat_template:
        raise ConfigError(
            "data.apply_chat_template is true but the tokenizer has no chat_template: "
            "set data.apply_chat_template=false for a base model"
        )


def _prompt_messages(
    record: _Record, key: str, value: Any, system_prompt: str | None
) -> list[dict[str, str]]:
    messages = (
        [{"role": "user", "content": value}]
        if isinstance(value, str)
        else _check_messages(record, key, value)
    )
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    *,
    generation: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    kwargs: dict[str, Any] = {}
    if tools:
        from treadle.agents.tools import tool_messages

        messages, kwargs = tool_messages(tokenizer, messages, tools)
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation, tokenize=False, **kwargs
    )
    assert isinstance(text, str)
    return text


def _prompt_text(
    record: _Record,
    key: str,
    tokenizer: PreTrainedTokenizerBase,
    apply_chat_template: bool,
    system_prompt: str | None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, str, list[str]]:
    """(the prompt as written, the text the model is given, the user's texts within it)."""
    value = _require(record, key, "prompt")
    if not apply_chat_template:
        if not isinstance(value, str):
            raise DataError(
                f"{record.where}: prompt field '{key}' is a list of messages, which needs "
                "data.apply_chat_template=true"
            )
        return value, value, [value]
    messages = _prompt_messages(record, key, value, system_prompt)
    users = [m["content"] for m in messages if m["role"] == "user"]
    shown = value if isinstance(value, str) else (users[-1] if users else messages[-1]["content"])
    text = _render(tokenizer, messages, generation=True, tools=tools)
    return shown, text, [m["content"] for m in messages]


# --- special tokens in user text ---------------------------------------------------------------


def _specials(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The special-token strings of the tokenizer, longest first (for one regex)."""
    return sorted({str(t) for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)


def _spells_special(specials: list[str], texts: Sequence[str]) -> bool:
    return any(s in text for text in texts for s in specials)


def _encode_plain(tokenizer: PreTrainedTokenizerBase, text: str, *, bos: bool = False) -> list[int]:
    """User text whose special-token strings stay text (`split_special_tokens`)."""
    if not text and not bos:
        return []
    return list(tokenizer.encode(text, add_special_tokens=bos, split_special_tokens=True))


def _encode_rendered(
    tokenizer: PreTrainedTokenizerBase, text: str, contents: Sequence[str], specials: list[str]
) -> list[int]:
    """A rendered template holding the user's `contents` (in order): the template's special
    tokens become their ids, the contents' special-token strings stay text.

    Tokenizers split the text at special tokens and tokenize the pieces between them on their
    own, so splitting here at the template's special tokens gives the same ids as tokenizing
    the whole text, except that the user's strings are no longer special.
    """
    spans, pos = [], 0
    for content in contents:
        at = text.find(content, pos) if content else -1
        if at >= 0:
            spans.append((at, at + len(content)))
            pos = at + len(content)
    pattern = re.compile("|".join(re.escape(s) for s in specials))
    ids: list[int] = []
    start = 0
    for match in pattern.finditer(text):
        if any(a <= match.start() < b for a, b in spans):
            continue  # the user's text
        ids += _encode_plain(tokenizer, text[start : match.start()])
        ids.append(int(tokenizer.convert_tokens_to_ids(match.group())))  # type: ignore[arg-type]
        start = match.end()
    return ids + _encode_plain(tokenizer, text[start:])


def _encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    contents: Sequence[str],
    *,
    templated: bool,
    allow_special: bool,
    specials: list[str],
) -> list[int]:
    """One prompt's ids: rendered (`templated`) or the raw text with the tokenizer's BOS."""
    if allow_special or not _spells_special(specials, contents):
        return _encode(tokenizer, text, special=not templated)
    if templated:
        return _encode_rendered(tokenizer, text, contents, specials)
    return _encode_plain(tokenizer, text, bos=True)


def _encode_response(
    tokenizer: PreTrainedTokenizerBase, text: str, *, allow_special: bool
) -> list[int]:
    return _encode(tokenizer, text) if allow_special else _encode_plain(tokenizer, text)


def _tokenize(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], *, special: bool
) -> list[list[int]]:
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=special)["input_ids"]
    return [list(x) for x in ids]


def _keep(where: str, length: int, limit: int, overlong: Overlong, limit_name: str) -> bool:
    if length <= limit:
        return True
    if overlong == "error":
        raise DataError(
            f"{where} {length} tokens, longer than {limit_name}={limit}: raise the limit "
            "or set data.overlong_prompts=filter to drop such rows"
        )
    return False


def _log_filtered(n_filtered: int, total: int, limit_name: str, limit: int, key: str) -> None:
    if n_filtered:
        logger.warning(
            "%s: filtered %d of %d rows longer than %s=%d tokens",
            key,
            n_filtered,
            total,
            limit_name,
            limit,
        )


def load_prompt_dataset(
    files: Sequence[str | Path],
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    overlong: Overlong = "filter",
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    config_key: str = "data.train_files",
    tools: list[dict[str, Any]] | None = None,
    allow_special_tokens: bool = False,
) -> PromptDataset:
    """Read, validate, render and tokenize RL prompts.

    Prompts longer than `max_prompt_length` tokens are dropped with a logged count
    (`overlong="filter"`) or raise DataError naming file, row, length and limit ("error").
    Without an `answer_key` every ground truth is "" (for reward models). `tools`: JSON
    schemas of the agent loop's tools, given to the chat template (or put into the system
    message: `treadle.agents.tools.tool_messages`). Special-token strings in the prompts stay
    text unless `allow_special_tokens`.
    """
    _check_template(tokenizer, apply_chat_template)
    records = _read_records(files, config_key)
    shown, texts, truths, contents = [], [], [], []
    for record in records:
        prompt, text, content = _prompt_text(
            record, prompt_key, tokenizer, apply_chat_template, system_prompt, tools
        )
        shown.append(prompt)
        texts.append(text)
        contents.append(content)
        truths.append(
            "" if answer_key is None else _as_text(_require(record, answer_key, "answer"))
        )
    ids = _tokenize(tokenizer, texts, special=not apply_chat_template)  # one fast batch call
    specials = _specials(tokenizer)
    for i, content in enumerate(contents):
        if not allow_special_tokens and _spells_special(specials, content):
            ids[i] = _encode_prompt(
                tokenizer,
                texts[i],
                content,
                templated=apply_chat_template,
                allow_special=False,
                specials=specials,
            )
    rows: list[PromptRow] = []
    for record, prompt, prompt_ids, truth in zip(records, shown, ids, truths, strict=True):
        where = f"{record.where}: prompt is"
        if _keep(where, len(prompt_ids), max_prompt_length, overlong, "max_prompt_length"):
            rows.append(
                PromptRow(
                    uid=record.uid,
                    prompt_text=prompt,
                    prompt_ids=prompt_ids,
                    ground_truth=truth,
                    row=record.row,
                )
            )
    n_filtered = len(records) - len(rows)
    _log_filtered(n_filtered, len(records), "max_prompt_length", max_prompt_length, config_key)
    if not rows:
        raise DataError(
            f"{config_key}: every prompt is longer than max_prompt_length={max_prompt_length}"
        )
    return PromptDataset(rows=rows, pad_id=_pad_id(tokenizer), n_filtered=n_filtered)


def collate_prompts(
    token_id_lists: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """LEFT-pad prompts into `(input_ids [B, P], attention_mask [B, P])`, both int64."""
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


# --- supervised fine-tuning ------------------------------------------------------------------


def _eos(tokenizer: PreTrainedTokenizerBase) -> tuple[int, str]:
    if tokenizer.eos_token_id is None or tokenizer.eos_token is None:
        raise ConfigError("model.path: the tokenizer has no EOS token, which SFT appends")
    return int(tokenizer.eos_token_id), str(tokenizer.eos_token)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, *, special: bool = False) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special)) if text else []


def _sft_pair(
    record: _Record,
    prompt_key: str,
    response_key: str,
    tokenizer: PreTrainedTokenizerBase,
    apply_chat_template: bool,
    system_prompt: str | None,
    allow_special: bool,
) -> tuple[list[int], list[int]]:
    _, text, contents = _prompt_text(
        record, prompt_key, tokenizer, apply_chat_template, system_prompt
    )
    response = _as_text(_require(record, response_key, "response"))
    prompt_ids = _encode_prompt(
        tokenizer,
        text,
        contents,
        templated=apply_chat_template,
        allow_special=allow_special,
        specials=_specials(tokenizer),
    )
    response_ids = [
        *_encode_response(tokenizer, response, allow_special=allow_special),
        _eos(tokenizer)[0],
    ]
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def _sft_messages(
    record: _Record,
    messages_key: str,
    tokenizer: PreTrainedTokenizerBase,
    system_prompt: str | None,
    allow_special: bool,
) -> tuple[list[int], list[int]]:
    """Multi-turn: every assistant turn (content + EOS) is a target, everything else context.

    The template must render a conversation as a prefix of its continuations, and an assistant
    turn as its content followed by the EOS token (ChatML, Llama 3 and most templates do).
    """
    messages = _prompt_messages(
        record, messages_key, _require(record, messages_key, "messages"), system_prompt
    )
    eos_id, eos_text = _eos(tokenizer)
    specials = _specials(tokenizer)
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # the rendered text already turned into tokens
    first = 0  # the first message not yet turned into tokens
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise DataError(f"{record.where}: '{messages_key}' starts with an assistant turn")
        context = _render(tokenizer, messages[:i], generation=True)
        if not context.startswith(done):
            raise _template_error(record)
        context_ids = _encode_prompt(
            tokenizer,
            context[len(done) :],
            [m["content"] for m in messages[first:i]],
            templated=True,
            allow_special=allow_special,
            specials=specials,
        )
        content_ids = _encode_response(tokenizer, message["content"], allow_special=allow_special)
        turn_ids = [*content_ids, eos_id]
        ids += context_ids + turn_ids
        mask += [0] * len(context_ids) + [1] * len(turn_ids)
        done = context + message["content"] + eos_text
        first = i + 1
        if not _render(tokenizer, messages[: i + 1], generation=False).startswith(done):
            raise _template_error(record)
    if not any(mask):
        raise DataError(f"{record.where}: '{messages_key}' has no assistant turn to train on")
    return ids, mask


def _template_error(record: _Record) -> DataError:
    return DataError(
        f"{record.where}: the chat template does not render the conversation as a prefix of "
        "its continuations with assistant turns as content + EOS, which multi-turn SFT needs; "
        "use prompt/response columns instead"
    )


def load_sft_dataset(
    files: Sequence[str | Path],
    *,
    prompt_key: str = "prompt",
    response_key: str = "solution",
    messages_key: str = "messages",
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    overlong: Overlong = "filter",
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    config_key: str = "data.train_files",
    allow_special_tokens: bool = False,
) -> SFTDataset:
    """Read, validate and tokenize SFT examples.

    A row holds `prompt_key` and `response_key` (single turn: loss on the response and the
    EOS) or, when it has no `prompt_key`, a `messages_key` list of chat messages (loss on every
    assistant turn). Examples longer than `max_length` tokens are filtered or raise, as prompts.
    """
    _check_template(tokenizer, apply_chat_template)
    rows: list[SFTRow] = []
    records = _read_records(files, config_key)
    for record in records:
        if record.row.get(prompt_key) is None and record.row.get(messages_key) is not None:
            if not apply_chat_template:
                raise DataError(
                    f"{record.where}: '{messages_key}' needs data.apply_chat_template=true"
                )
            ids, mask = _sft_messages(
                record, messages_key, tokenizer, system_prompt, allow_special_tokens
            )
        else:
            ids, mask = _sft_pair(
                record,
                prompt_key,
                response_key,
                tokenizer,
                apply_chat_template,
                system_prompt,
                allow_special_tokens,
            )
        if _keep(f"{record.where}: example is", len(ids), max_length, overlong, "max_length"):
            rows.append(SFTRow(uid=record.uid, input_ids=ids, loss_mask=mask))
    n_filtered = len(records) - len(rows)
    _log_filtered(n_filtered, len(records), "max_length", max_length, config_key)
    if not rows:
        raise DataError(f"{config_key}: every example is longer than max_length={max_length}")
    return SFTDataset(rows=rows, pad_id=_pad_id(tokenizer), n_filtered=n_filtered)


def collate_sft(
    rows: Sequence[SFTRow], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RIGHT-pad SFT rows into `(input_ids, attention_mask, loss_mask)`, each `[B, L]` int64."""
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


# --- preference pairs -----------------------------------------------------------------------


class PairRow(TypedDict):
    uid: str
    prompt_text: str
    prompt_ids: list[int]
    chosen_ids: list[int]  # response tokens + EOS
    rejected_ids: list[int]
    ground_truth: str  # the answer column when the file has one, else ""


PairDataset = Rows[PairRow]  # preference pairs


def _check_pair_columns(records: list[_Record], keys: dict[str, str], config_key: str) -> None:
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


def _response_text(record: _Record, key: str) -> str:
    value = _require(record, key, "response")
    if isinstance(value, str):
        return value
    ok = isinstance(value, list) and len(value) == 1
    message = _check_messages(record, key, value)[0] if ok else None
    if message is None or message["role"] != "assistant":
        raise DataError(
            f"{record.where}: field '{key}' must be a string or a list of one "
            "{'role': 'assistant', 'content': str} message"
        )
    return message["content"]


def _pair_row(
    record: _Record,
    keys: dict[str, str],
    tokenizer: PreTrainedTokenizerBase,
    apply_chat_template: bool,
    system_prompt: str | None,
    allow_special: bool,
) -> PairRow:
    shown, text, contents = _prompt_text(
        record, keys["prompt_key"], tokenizer, apply_chat_template, system_prompt
    )
    chosen = _response_text(record, keys["chosen_key"])
    rejected = _response_text(record, keys["rejected_key"])
    if chosen == rejected:
        raise DataError(
            f"{record.where}: the chosen and rejected responses are the same, "
            "which teaches nothing: fix or drop the row"
        )
    eos = _eos(tokenizer)[0]
    answer = record.row.get(keys["answer_key"])
    return PairRow(
        uid=record.uid,
        prompt_text=shown,
        prompt_ids=_encode_prompt(
            tokenizer,
            text,
            contents,
            templated=apply_chat_template,
            allow_special=allow_special,
            specials=_specials(tokenizer),
        ),
        chosen_ids=[*_encode_response(tokenizer, chosen, allow_special=allow_special), eos],
        rejected_ids=[*_encode_response(tokenizer, rejected, allow_special=allow_special), eos],
        ground_truth="" if answer is None else _as_text(answer),
    )


def load_pair_dataset(
    files: Sequence[str | Path],
    *,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    answer_key: str = "answer",
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    max_response_length: int,
    overlong: Overlong = "filter",
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    config_key: str = "data.train_files",
    allow_special_tokens: bool = False,
) -> PairDataset:
    """Read, validate and tokenize preference pairs (prompt, chosen, rejected).

    A prompt longer than `max_prompt_length` tokens or a response (with its EOS) longer than
    `max_response_length` drops the pair with a logged count or raises, as for prompts. The
    `answer_key` column is optional (kept as `ground_truth` for a task evaluation).
    """
    _check_template(tokenizer, apply_chat_template)
    records = _read_records(files, config_key)
    keys = {"prompt_key": prompt_key, "chosen_key": chosen_key, "rejected_key": rejected_key}
    _check_pair_columns(records, keys, config_key)
    keys["answer_key"] = answer_key
    rows: list[PairRow] = []
    limits = {
        "prompt": ("data.max_prompt_length", max_prompt_length),
        "chosen": ("rollout.max_new_tokens", max_response_length),
        "rejected": ("rollout.max_new_tokens", max_response_length),
    }
    for record in records:
        row = _pair_row(
            record, keys, tokenizer, apply_chat_template, system_prompt, allow_special_tokens
        )
        lengths = {
            "prompt": len(row["prompt_ids"]),
            "chosen": len(row["chosen_ids"]),
            "rejected": len(row["rejected_ids"]),
        }
        if all(
            _keep(f"{record.where}: {part} is", lengths[part], limit, overlong, name)
            for part, (name, limit) in limits.items()
        ):
            rows.append(row)
    n_filtered = len(records) - len(rows)
    if n_filtered:
        logger.warning(
            "%s: filtered %d of %d pairs with a prompt over %d or a response over %d tokens",
            config_key,
            n_filtered,
            len(records),
            max_prompt_length,
            max_response_length,
        )
    if not rows:
        raise DataError(f"{config_key}: every pair is over the length limits")
    return PairDataset(rows=rows, pad_id=_pad_id(tokenizer), n_filtered=n_filtered)


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
    out["chosen"], out["chosen_mask"] = _right_padded(chosen, pad_id, width)
    rejected = [r["rejected_ids"] for r in rows]
    out["rejected"], out["rejected_mask"] = _right_padded(rejected, pad_id, width)
    return out


# --- unpaired examples (KTO) ------------------------------------------------------------------


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


def _unpaired_kind(records: list[_Record], keys: dict[str, str], config_key: str) -> str:
    """ "unpaired" (completion + label columns) or "pairs" (chosen + rejected), for all files."""
    seen: dict[str, dict[str, None]] = {}
    for record in records:
        seen.setdefault(record.file, {}).update(
            (k, None) for k, v in record.row.items() if v is not None
        )
    kinds = set()
    for file, columns in seen.items():
        if {keys["completion_key"], keys["label_key"]} <= columns.keys():
            kinds.add("unpaired")
        elif {keys["chosen_key"], keys["rejected_key"]} <= columns.keys():
            kinds.add("pairs")
        else:
            raise DataError(
                f"{config_key}: {file} has neither the columns '{keys['completion_key']}' and "
                f"'{keys['label_key']}' (data.completion_key, data.label_key) of unpaired "
                f"examples nor '{keys['chosen_key']}' and '{keys['rejected_key']}' "
                f"(data.chosen_key, data.rejected_key) of pairs; its columns are "
                f"{', '.join(columns) or 'none'}"
            )
    if len(kinds) > 1:
        raise DataError(f"{config_key}: mixes files of pairs and of unpaired examples")
    return kinds.pop() if kinds else "unpaired"


def _label(record: _Record, key: str) -> bool:
    value = record.row.get(key)
    if not isinstance(value, bool):
        raise DataError(
            f"{record.where}: label field '{key}' must be true or false (desirable or not), "
            f"got {value!r}"
        )
    return value


def _unpaired_row_group(
    record: _Record,
    keys: dict[str, str],
    pairs: bool,
    tokenizer: PreTrainedTokenizerBase,
    apply_chat_template: bool,
    system_prompt: str | None,
    allow_special: bool,
) -> list[UnpairedRow]:
    """The row's example, or a pair's two (chosen: desirable, then rejected)."""
    shown, text, contents = _prompt_text(
        record, keys["prompt_key"], tokenizer, apply_chat_template, system_prompt
    )
    if pairs:
        examples = [
            (f"{record.uid}:chosen", _response_text(record, keys["chosen_key"]), True),
            (f"{record.uid}:rejected", _response_text(record, keys["rejected_key"]), False),
        ]
    else:
        completion = _response_text(record, keys["completion_key"])
        examples = [(record.uid, completion, _label(record, keys["label_key"]))]
    prompt_ids = _encode_prompt(
        tokenizer,
        text,
        contents,
        templated=apply_chat_template,
        allow_special=allow_special,
        specials=_specials(tokenizer),
    )
    eos = _eos(tokenizer)[0]
    answer = record.row.get(keys["answer_key"])
    return [
        UnpairedRow(
            uid=uid,
            prompt_text=shown,
            prompt_ids=prompt_ids,
            completion_ids=[*_encode_response(tokenizer, c, allow_special=allow_special), eos],
            label=label,
            ground_truth="" if answer is None else _as_text(answer),
        )
        for uid, c, label in examples
    ]


def load_unpaired_dataset(
    files: Sequence[str | Path],
    *,
    keys: dict[str, str],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    max_response_length: int,
    overlong: Overlong = "filter",
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    config_key: str = "data.train_files",
    allow_special_tokens: bool = False,
) -> UnpairedDataset:
    """Read, validate and tokenize unpaired examples (KTO).

    ``keys``: the column names, by their config names (``prompt_key``, ``completion_key``,
    ``label_key``, ``chosen_key``, ``rejected_key``, ``answer_key``). Files hold either
    unpaired rows (prompt, completion, label: bool), TRL's unpaired preference format, or
    pairs, each read as two examples (chosen desirable, rejected not). Length limits as for
    pairs: an example over them is dropped (or raises).
    """
    _check_template(tokenizer, apply_chat_template)
    records = _read_records(files, config_key)
    pairs = _unpaired_kind(records, keys, config_key) == "pairs"
    rows: list[UnpairedRow] = []
    n_examples = 0
    for record in records:
        group = _unpaired_row_group(
            record,
            keys,
            pairs,
            tokenizer,
            apply_chat_template,
            system_prompt,
            allow_special_tokens,
        )
        n_examples += len(group)
        prompt_ok = _keep(
            f"{record.where}: prompt is",
            len(group[0]["prompt_ids"]),
            max_prompt_length,
            overlong,
            "data.max_prompt_length",
        )
        rows += [
            row
            for row in group
            if prompt_ok
            and _keep(
                f"{record.where}: completion is",
                len(row["completion_ids"]),
                max_response_length,
                overlong,
                "rollout.max_new_tokens",
            )
        ]
    n_filtered = n_examples - len(rows)
    if n_filtered:
        logger.warning(
            "%s: filtered %d of %d examples with a prompt over %d or a completion over %d tokens",
            config_key,
            n_filtered,
            n_examples,
            max_prompt_length,
            max_response_length,
        )
    if not rows:
        raise DataError(f"{config_key}: every example is over the length limits")
    return UnpairedDataset(rows=rows, pad_id=_pad_id(tokenizer), n_filtered=n_filtered)


def _right_padded(
    seqs: Sequence[Sequence[int]], pad_id: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` ``[len(seqs), width]`` (default: the longest), each row RIGHT-padded."""
    width = max(len(seq) for seq in seqs) if width is None else width
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[i, : len(seq)] = 1
    return ids, mask


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
    if not rows:
        raise ValueError("collate_unpaired: empty batch")
    prompts, prompt_mask = collate_prompts([r["prompt_ids"] for r in rows], pad_id)
    completions, completion_mask = _right_padded([r["completion_ids"] for r in rows], pad_id)
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


# --- sampling --------------------------------------------------------------------------------


class ResumableSampler:
    """Batches of dataset indices, reshuffled each epoch from `(seed, epoch)`.

    A batch never spans two epochs. With `drop_last` the tail of an epoch that does not fill a
    batch is skipped (it is in a different place next epoch); without it the last batch is
    short. The state is `{"epoch", "position", "seed"}` (plus `n` to detect a changed dataset).
    """

    def __init__(
        self, n: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        if batch_size <= 0 or seed < 0:
            raise ValueError(f"need batch_size > 0 and seed >= 0, got {batch_size}, {seed}")
        if n <= 0 or (drop_last and n < batch_size):
            raise DataError(
                f"the dataset has {n} rows, fewer than one batch of {batch_size}: "
                "lower data.batch_size or add rows"
            )
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.position = 0, 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) cache

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.n, self.batch_size)
        return full + int(bool(rest) and not self.drop_last)

    def _permutation(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
                self._order = (self.epoch, order.tolist())
            else:
                self._order = (self.epoch, list(range(self.n)))
        return self._order[1]

    def next_indices(self) -> list[int]:
        """The next batch; moves to the next epoch when this one has no full batch left."""
        remaining = self.n - self.position
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._permutation()[self.position : self.position + self.batch_size]
        self.position += len(batch)
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise DataError(f"sampler state lacks {sorted(missing)}: got {state}")
        if state.get("n", self.n) != self.n or not 0 <= int(state["position"]) <= self.n:
            raise DataError(
                f"sampler state {state} was saved for a dataset of {state.get('n')} rows, "
                f"this one has {self.n}: the data files changed since the checkpoint"
            )
        self.epoch, self.position, self.seed = (
            int(state["epoch"]),
            int(state["position"]),
            int(state["seed"]),
        )
        self._order = None


# ----------------------------------------------------------------------------- from a config
#
# The readers as a run calls them, with the ``data`` section's settings: the trainers and
# ``treadle check`` read files through these, so both see exactly the same rows.


def config_prompts(
    cfg: Config, files: Sequence[str], key: str, tokenizer: PreTrainedTokenizerBase, tools: Any
) -> PromptDataset:
    """RL and evaluation prompts of ``files`` (the config key ``key``)."""
    d = cfg.data
    return load_prompt_dataset(
        files,
        prompt_key=d.prompt_key,
        answer_key=d.answer_key,
        tokenizer=tokenizer,
        max_prompt_length=d.max_prompt_length,
        overlong=d.overlong_prompts,
        apply_chat_template=d.apply_chat_template,
        system_prompt=d.system_prompt,
        config_key=key,
        tools=tools,
        allow_special_tokens=d.allow_special_tokens,
    )


def config_sft(
    cfg: Config, files: Sequence[str], key: str, tokenizer: PreTrainedTokenizerBase
) -> SFTDataset:
    """SFT examples of ``files``: prompt + response (or chat messages), at most
    ``data.max_prompt_length + rollout.max_new_tokens`` tokens."""
    d = cfg.data
    return load_sft_dataset(
        files,
        prompt_key=d.prompt_key,
        response_key=d.response_key,
        messages_key=d.messages_key,
        tokenizer=tokenizer,
        max_length=d.max_prompt_length + cfg.rollout.max_new_tokens,
        apply_chat_template=d.apply_chat_template,
        system_prompt=d.system_prompt,
        config_key=key,
        allow_special_tokens=d.allow_special_tokens,
    )


def config_pairs(
    cfg: Config, files: Sequence[str], key: str, tokenizer: PreTrainedTokenizerBase
) -> PairDataset:
    """Preference pairs of ``files``, checked and tokenized."""
    d = cfg.data
    return load_pair_dataset(
        files,
        prompt_key=d.prompt_key,
        chosen_key=d.chosen_key,
        rejected_key=d.rejected_key,
        answer_key=d.answer_key,
        tokenizer=tokenizer,
        max_prompt_length=d.max_prompt_length,
        max_response_length=cfg.rollout.max_new_tokens,
        overlong=d.overlong_prompts,
        apply_chat_template=d.apply_chat_template,
        system_prompt=d.system_prompt,
        config_key=key,
        allow_special_tokens=d.allow_special_tokens,
    )


def config_unpaired(
    cfg: Config, files: Sequence[str], key: str, tokenizer: PreTrainedTokenizerBase
) -> UnpairedDataset:
    """Unpaired examples of ``files`` (or pairs, two examples each), checked and tokenized."""
    d = cfg.data
    keys = {
        name: getattr(d, name)
        for name in (
            "prompt_key",
            "completion_key",
            "label_key",
            "chosen_key",
            "rejected_key",
            "answer_key",
        )
    }
    return load_unpaired_dataset(
        files,
        keys=keys,
        tokenizer=tokenizer,
        max_prompt_length=d.max_prompt_length,
        max_response_length=cfg.rollout.max_new_tokens,
        overlong=d.overlong_prompts,
        apply_chat_template=d.apply_chat_template,
        system_prompt=d.system_prompt,
        config_key=key,
        allow_special_tokens=d.allow_special_tokens,
    )
