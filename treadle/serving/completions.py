"""From a chat or prompt to token ids, and from sampled ids back to the text the API returns.

The endpoint's tokenizer side (:mod:`treadle.serving.endpoint`): messages are rendered with the
model's chat template as treadle renders its own prompts (:mod:`treadle.data.templating`:
``tools=`` when the template takes them, else the Hermes block in the system message; the
user's text never becomes a special token), and a completion's text is its tokens decoded
without special tokens. A ``stop`` string cuts the completion after the token that completes
it: that token stays in the recorded tokens (they are what was sampled, a prefix of the
sample), the returned text ends before the stop string, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from treadle.data.templating import as_object, encode, encode_prompt, render, special_strings
from treadle.serving.openai_api import ApiError
from treadle.serving.server import Response


@dataclass(frozen=True)
class Sampled:
    """One choice's tokens as recorded (cut at a stop string) and its text."""

    token_ids: list[int]
    log_probs: list[float]
    versions: list[int]
    stop_reason: str  # "stop" | "length"
    text: str
    top_ids: list[list[int]] = field(default_factory=list)  # per token (empty: none asked)
    top_log_probs: list[list[float]] = field(default_factory=list)


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool calls with their JSON arguments parsed: chat templates
    write ``arguments`` as an object (vLLM parses them the same way before rendering)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            function = {**function, "arguments": as_object(function["arguments"])}
            out.append({**call, "function": function})
        else:
            out.append(call)
    return {**message, "tool_calls": out}


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """The prompt of a chat: rendered with the generation prompt, tokenized as treadle does."""
    messages = [_arguments_as_objects(m) for m in messages]
    try:
        text = render(tokenizer, messages, generation=True, tools=tools)
    except Exception as e:  # a template's raise_exception, a role it does not know
        message = f"the chat template cannot render these messages: {e}"
        raise ApiError(400, message, "messages") from None
    contents = [m["content"] for m in messages if m.get("content")]
    return encode_prompt(
        tokenizer,
        text,
        contents,
        templated=True,
        allow_special=False,
        specials=special_strings(tokenizer),
    )


def text_prompt_ids(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """A text completion's prompt: token ids as given, or the text with the tokenizer's BOS."""
    if isinstance(prompt, str):
        return encode(tokenizer, prompt, special=True)
    vocab = len(tokenizer)
    if any(t >= vocab for t in prompt):
        raise ApiError(400, f"'prompt' holds a token id beyond the vocabulary ({vocab})", "prompt")
    return list(prompt)


def decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def cut_at_stop(tokenizer: Any, ids: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(tokens to keep, the text before the stop string) for the first stop string in the
    completion's text; None when none occurs."""
    text = decode(tokenizer, ids)
    found = [(at, s) for s in stops if (at := text.find(s)) >= 0]
    if not found:
        return None
    at, stop = min(found)
    end = at + len(stop)
    keep = next(k for k in range(1, len(ids) + 1) if len(decode(tokenizer, ids[:k])) >= end)
    return keep, text[:at]


def finish(tokenizer: Any, r: Response, stops: tuple[str, ...]) -> Sampled:
    """A response as the endpoint returns and records it (cut at the first stop string)."""
    ids, log_probs, versions = r.token_ids, r.log_probs, r.versions()
    has_top = len(r.top_ids) == len(ids)
    top_ids, top_lps = (r.top_ids, r.top_log_probs) if has_top else ([], [])
    cut = cut_at_stop(tokenizer, ids, stops) if stops else None
    if cut is None:
        text = decode(tokenizer, ids)
        return Sampled(ids, log_probs, versions, r.stop_reason, text, top_ids, top_lps)
    k, text = cut
    return Sampled(ids[:k], log_probs[:k], versions[:k], "stop", text, top_ids[:k], top_lps[:k])


def alternatives(
    tokenizer: Any, top_ids: list[list[int]], top_log_probs: list[list[float]]
) -> list[list[tuple[str, float]]]:
    """Per completion token its most likely alternatives as (text, log-prob), most likely
    first; empty when the engine gave none."""
    return [
        [(str(tokenizer.decode([t])), lp) for t, lp in zip(ids, lps, strict=True)]
        for ids, lps in zip(top_ids, top_log_probs, strict=True)
    ]


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's own text (special tokens spelt out), for ``logprobs``."""
    return [str(tokenizer.decode([t])) for t in ids]
