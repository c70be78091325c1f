"""Prompts rendered with the tokenizer's chat template, and text turned into token ids.

A prompt is one user message, optionally after ``system_prompt``, or a list of chat messages;
with tools, their schemas go to the template (``tools=``) or, for a template without tool
support, into the system message as Hermes instructions (``tool_messages``).

Text in a file that spells a special token (``<|im_end|>``, ``</s>``) stays plain text unless
``allow_special_tokens``: user text is tokenized with ``split_special_tokens=True``, and a
rendered chat template is split at its own special tokens, the user's content between them
tokenized as plain text. Rows without such strings are tokenized exactly as before (one call on
the whole text), so their ids do not change.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from treadle.data.options import TextOptions
from treadle.data.readers import Record, check_messages, require
from treadle.models.folders import TEMPLATE_KWARGS, template_key
from treadle.runtime.errors import ConfigError, DataError

HERMES_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def supports_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders ``tools=`` itself."""
    return "tools" in (template_key(tokenizer) or "")


def tool_messages(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    schemas: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(messages, kwargs)`` for ``apply_chat_template``: the schemas as ``tools=`` when the
    template supports them, else the Hermes instructions in the system message."""
    if not schemas:
        return messages, {}
    if supports_tools(tokenizer):
        return messages, {"tools": schemas}
    text = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(s) for s in schemas))
    if messages and messages[0]["role"] == "system":
        system = {"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}
        return [system, *messages[1:]], {}
    return [{"role": "system", "content": text}, *messages], {}


def tool_responses(contents: Sequence[str]) -> str:
    """A turn's tool results as one user message's text for a template without tool support:
    a ``<tool_response>`` block each, as Qwen2.5's template renders consecutive tool messages."""
    return "\n".join(f"<tool_response>\n{c}\n</tool_response>" for c in contents)


def hermes_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a template without tool support, written as the Hermes instructions
    (:func:`tool_messages`) tell the model to: an assistant message's ``tool_calls`` as
    ``<tool_call>`` blocks after its content, a run of ``tool`` messages as one user message
    (:func:`tool_responses`). Messages without either are kept as they are."""
    out: list[dict[str, Any]] = []
    results: list[str] = []  # the run of tool messages not yet written
    for m in [*messages, None]:
        if m is not None and m.get("role") == "tool":
            results.append(_text_of(m.get("content")))
            continue
        if results:
            out.append({"role": "user", "content": tool_responses(results)})
            results = []
        if m is None:
            break
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if not calls:
            out.append(m)
            continue
        blocks = [f"<tool_call>\n{json.dumps(_hermes_call(c))}\n</tool_call>" for c in calls]
        said = _text_of(m.get("content"))
        text = "\n".join([*([said] if said else []), *blocks])
        out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
    return out


def _text_of(content: Any) -> str:
    """A message's content as text: a string, or its text parts one after the other."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _hermes_call(call: Any) -> dict[str, Any]:
    function = (call.get("function") or call) if isinstance(call, dict) else {}
    return {"name": function.get("name"), "arguments": as_object(function.get("arguments", {}))}


def as_object(arguments: Any) -> Any:
    """A tool call's arguments as chat templates write them: a JSON string parsed (one that
    does not parse, and anything else, as given)."""
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(arguments)
    return arguments


def pad_or_eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError("model.path: the tokenizer has neither a pad nor an EOS token")
    return int(pad)


def eos_token(tokenizer: PreTrainedTokenizerBase) -> tuple[int, str]:
    if tokenizer.eos_token_id is None or tokenizer.eos_token is None:
        raise ConfigError("model.path: the tokenizer has no EOS token, which SFT appends")
    return int(tokenizer.eos_token_id), str(tokenizer.eos_token)


def check_template(tokenizer: PreTrainedTokenizerBase, apply_chat_template: bool) -> None:
    if apply_chat_template and not tokenizer.chat_template:
        raise ConfigError(
            "data.apply_chat_template is true but the tokenizer has no chat_template: "
            "set data.apply_chat_template=false for a base model"
        )


def prompt_messages(
    record: Record, key: str, value: Any, system_prompt: str | None
) -> list[dict[str, str]]:
    messages = (
        [{"role": "user", "content": value}]
        if isinstance(value, str)
        else check_messages(record, key, value)
    )
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    *,
    generation: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The chat template's text of ``messages``. A template that refuses a system message
    (Gemma 2's raises) gets it at the start of the first user message, as Gemma 3's own
    template writes it; one without tool support gets tool calls and results in Hermes' text
    (:func:`hermes_turns`)."""
    kwargs: dict[str, Any] = {}
    if not supports_tools(tokenizer) and any(
        m.get("role") == "tool" or m.get("tool_calls") for m in messages
    ):
        messages = hermes_turns(messages)
    if tools:
        messages, kwargs = tool_messages(tokenizer, messages, tools)
    try:
        return _apply(tokenizer, messages, generation, kwargs)
    except TemplateError:
        folded = _system_folded(messages)
        if folded is None:
            raise
    return _apply(tokenizer, folded, generation, kwargs)  # its error, if any, is what is left


def render_row(
    record: Record,
    key: str,
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    *,
    generation: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """:func:`render` for a data row: a template that refuses it, or renders it without a user
    message's text, names the file, row and field."""
    try:
        text = render(tokenizer, messages, generation=generation, tools=tools)
    except TemplateError as e:
        raise DataError(f"{record.where}: the chat template refuses field '{key}': {e}") from e
    for m in messages:
        content = m.get("content")
        if m.get("role") == "user" and isinstance(content, str) and content.strip() not in text:
            raise DataError(
                f"{record.where}: the chat template renders field '{key}' without the text of "
                f"its user message {content.strip()[:60]!r}, so the model would never read it; "
                "give model.path's tokenizer a template that writes message content (or set "
                "data.apply_chat_template=false)"
            )
    return text


def _apply(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    generation: bool,
    kwargs: dict[str, Any],
) -> str:
    if takes_parts(tokenizer):
        messages = [as_parts(m) for m in messages]
    return _template(tokenizer, messages, generation, kwargs)


def _template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    generation: bool,
    kwargs: dict[str, Any],
) -> str:
    """The template's text of ``messages`` as given, with the tokenizer's template variables
    (``data.chat_template_kwargs``)."""
    text = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=generation,
        tokenize=False,
        **getattr(tokenizer, TEMPLATE_KWARGS, {}),
        **kwargs,
    )
    assert isinstance(text, str)
    return text


def takes_parts(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template reads a message's content only as a list of parts
    (``[{"type": "text", "text": ...}]``): SmolVLM's, Idefics3's and LLaVA-NeXT's loop over
    the content and render a plain string as nothing."""
    key = template_key(tokenizer)
    return key is not None and _takes_parts(tokenizer, key)


@functools.lru_cache(maxsize=8)
def _takes_parts(tokenizer: PreTrainedTokenizerBase, template: str) -> bool:
    def shows(content: Any) -> bool:
        try:
            return _PROBE in _template(tokenizer, [{"role": "user", "content": content}], True, {})
        except Exception:  # a probe: a template that wants more shows nothing
            return False

    return not shows(_PROBE) and shows([{"type": "text", "text": _PROBE}])


def as_parts(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with a string content as one text part (other content as it is)."""
    content = message.get("content")
    if not isinstance(content, str):
        return message
    return {**message, "content": [{"type": "text", "text": content}]}


def _system_folded(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``messages`` with a leading system message put before the first user message's text;
    None where there is no such pair to fold."""
    if len(messages) < 2 or messages[0]["role"] != "system" or messages[1]["role"] != "user":
        return None
    system, user = messages[0]["content"], messages[1]["content"]
    if not (isinstance(system, str) and isinstance(user, str)):
        return None
    return [{**messages[1], "content": f"{system}\n\n{user}"}, *messages[2:]]


_PROBE = "treadle-probe"


def end_of_turn(tokenizer: PreTrainedTokenizerBase) -> tuple[int, str]:
    """The token the chat template closes an assistant turn with (ChatML's ``<|im_end|>``,
    Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``), found by rendering one; the
    tokenizer's EOS where the template writes no special token after the turn's text."""
    found = template_end_of_turn(tokenizer)
    return found if found is not None else eos_token(tokenizer)


def template_end_of_turn(tokenizer: PreTrainedTokenizerBase) -> tuple[int, str] | None:
    """:func:`end_of_turn` without the EOS fallback: None without a template or where it
    writes no special token after a turn's text."""
    key = template_key(tokenizer)
    return _end_of_turn(tokenizer, key) if key is not None else None


@functools.lru_cache(maxsize=8)
def _end_of_turn(tokenizer: PreTrainedTokenizerBase, template: str) -> tuple[int, str] | None:
    turn = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = render(tokenizer, turn, generation=False)
    except Exception:  # a probe: a template that wants more than two plain turns shows nothing
        return None
    after = text[text.rfind(_PROBE) + len(_PROBE) :]
    specials = special_strings(tokenizer)
    match = special_pattern(specials).search(after) if specials else None
    if match is None:
        return None
    token_id = tokenizer.convert_tokens_to_ids(match.group())
    return (token_id, match.group()) if isinstance(token_id, int) else None


def prompt_text(
    record: Record,
    key: str,
    tokenizer: PreTrainedTokenizerBase,
    options: TextOptions,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, str, list[str]]:
    """(the prompt as written, the text the model is given, the user's texts within it)."""
    value = require(record, key, "prompt")
    if not options.apply_chat_template:
        if not isinstance(value, str):
            raise DataError(
                f"{record.where}: prompt field '{key}' is a list of messages, which needs "
                "data.apply_chat_template=true"
            )
        return value, value, [value]
    messages = prompt_messages(record, key, value, options.system_prompt)
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:  # nothing asked: the model would answer the system message
        roles = ", ".join(m["role"] for m in messages)
        raise DataError(f"{record.where}: field '{key}' has no user message (its roles: {roles})")
    shown = value if isinstance(value, str) else users[-1]
    text = _with_pictures(record, key, tokenizer, options, messages, tools)
    if text is None:
        text = render_row(record, key, tokenizer, messages, generation=True, tools=tools)
    return shown, text, [m["content"] for m in messages]


def _with_pictures(
    record: Record,
    key: str,
    tokenizer: PreTrainedTokenizerBase,
    options: TextOptions,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> str | None:
    """A prompt with pictures where the template reads message parts (SmolVLM's): its last
    user message as an image part per picture, then its text, so that the template writes the
    processor's placeholders where its model reads them (``User:<image>...``). None where the
    row has no pictures, the template writes strings only, or its image parts are not the
    processor's placeholders (the caller's rendering then gets them after the header)."""
    pictures = record.row.get(options.images_key)
    if options.processor is None or not pictures or not takes_parts(tokenizer):
        return None
    n = len(pictures) if isinstance(pictures, list) else 1
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    parts = [{"type": "image"}] * n + [{"type": "text", "text": messages[last]["content"]}]
    shown = [*messages[:last], {**messages[last], "content": parts}, *messages[last + 1 :]]
    text = render_row(record, key, tokenizer, shown, generation=True, tools=tools)
    return text if text.count(options.processor.placeholder) == n else None


def shared_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How long a prefix ``a`` and ``b`` (texts, token ids) share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def special_strings(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The special-token strings of the tokenizer, longest first (for one regex)."""
    return sorted({str(t) for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)


def special_pattern(specials: Sequence[str]) -> re.Pattern[str]:
    """A regex of ``specials`` (:func:`special_strings`: the longest first matches first)."""
    return re.compile("|".join(re.escape(s) for s in specials))


def spells_special(specials: list[str], texts: Sequence[str]) -> bool:
    return any(s in text for text in texts for s in specials)


def encode_plain(tokenizer: PreTrainedTokenizerBase, text: str, *, bos: bool = False) -> list[int]:
    """User text whose special-token strings stay text (`split_special_tokens`)."""
    if not text and not bos:
        return []
    return list(tokenizer.encode(text, add_special_tokens=bos, split_special_tokens=True))


def encode_rendered(
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
    pattern = special_pattern(specials)
    ids: list[int] = []
    start = 0
    for match in pattern.finditer(text):
        if any(a <= match.start() < b for a, b in spans):
            continue  # the user's text
        ids += encode_plain(tokenizer, text[start : match.start()])
        token_id = tokenizer.convert_tokens_to_ids(match.group())
        assert isinstance(token_id, int)  # one token in, one id out
        ids.append(token_id)
        start = match.end()
    return ids + encode_plain(tokenizer, text[start:])


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    contents: Sequence[str],
    *,
    templated: bool,
    allow_special: bool,
    specials: list[str],
) -> list[int]:
    """One prompt's ids: rendered (`templated`) or the raw text with the tokenizer's BOS."""
    if allow_special or not spells_special(specials, contents):
        return encode(tokenizer, text, special=not templated)
    if templated:
        return encode_rendered(tokenizer, text, contents, specials)
    return encode_plain(tokenizer, text, bos=True)


def encode_response(
    tokenizer: PreTrainedTokenizerBase, text: str, *, allow_special: bool
) -> list[int]:
    return encode(tokenizer, text) if allow_special else encode_plain(tokenizer, text)


def encode(tokenizer: PreTrainedTokenizerBase, text: str, *, special: bool = False) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special)) if text else []


def tokenize(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], *, special: bool
) -> list[list[int]]:
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=special)["input_ids"]
    return [list(x) for x in ids]


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase, text: str, contents: Sequence[str], options: TextOptions
) -> list[int]:
    """A prompt's ids as ``options`` say (templated or raw, special-token strings as text)."""
    return encode_prompt(
        tokenizer,
        text,
        contents,
        templated=options.apply_chat_template,
        allow_special=options.allow_special_tokens,
        specials=special_strings(tokenizer),
    )


def response_ids(tokenizer: PreTrainedTokenizerBase, text: str, options: TextOptions) -> list[int]:
    """A response's ids as a rollout ends it: its content, then the token the chat template
    closes a turn with (:func:`end_of_turn`), or the EOS token for prompts without it."""
    ids = encode_response(tokenizer, text, allow_special=options.allow_special_tokens)
    end = end_of_turn(tokenizer) if options.apply_chat_template else eos_token(tokenizer)
    return [*ids, end[0]]
