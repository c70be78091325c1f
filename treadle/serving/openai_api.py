"""The OpenAI API's shapes for the endpoint: request bodies read and checked, responses built.

Pure functions over JSON-like dicts (no HTTP, no engine): :mod:`treadle.serving.endpoint`
serves them. A malformed body is an :class:`ApiError` (HTTP 400) whose message names the field;
the error body has OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``), which
the ``openai`` client turns into ``BadRequestError`` and friends.

Log-probs: ``top_logprobs=k`` (chat) and ``logprobs=k`` (completions) list the k most likely
tokens of each position, as the engine gives them (``SamplingParams.top_logprobs``: the
transformers engine does, from the same distribution as the sampled token's log-prob); where an
engine gives none they list the sampled token alone (the OpenAI API allows fewer entries than
asked).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

MAX_N = 16  # choices per request at most


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        code = "invalid_api_key" if self.status == 401 else None
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}


@dataclass(frozen=True)
class Asked:
    """What a request asks for beside its prompt (sampling, logprobs, streaming)."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _get(body: dict[str, Any], key: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise ApiError(400, f"'{key}' must be {what}, got {json.dumps(value)[:60]}", key)
    return value


def _bounded(body: dict[str, Any], key: str, low: float, high: float, kind: type) -> Any:
    kinds: tuple[type, ...] = (int, float) if kind is float else (int,)
    value = _get(body, key, kinds, "a number" if kind is float else "an integer")
    if value is not None and not low <= value <= high:
        raise ApiError(400, f"'{key}' must be between {low:g} and {high:g}, got {value}", key)
    return value


def read_asked(body: dict[str, Any], *, chat: bool) -> Asked:
    """Sampling and output options of a chat or text completion request."""
    stream = bool(_get(body, "stream", (bool,), "true or false"))
    options = _get(body, "stream_options", (dict,), "an object") or {}
    stop = _get(body, "stop", (str, list), "a string or a list of strings") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of non-empty strings", "stop")
    max_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    if chat:
        logprobs = bool(_get(body, "logprobs", (bool,), "true or false"))
        top = _bounded(body, "top_logprobs", 0, 20, int) or 0
    else:
        top = _bounded(body, "logprobs", 0, 5, int)
        logprobs, top = top is not None, top or 0
    return Asked(
        n=_bounded(body, "n", 1, MAX_N, int) or 1,
        temperature=_bounded(body, "temperature", 0, 2, float),
        top_p=_bounded(body, "top_p", 0, 1, float),
        max_tokens=_bounded(body, max_key, 1, 1 << 30, int),
        seed=_get(body, "seed", (int,), "an integer"),
        stop=tuple(stop),
        logprobs=logprobs,
        top_logprobs=top,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
    )


def read_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages, each content a string (text parts joined) as chat templates want."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"'messages[{i}]' must be an object with a 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = [p.get("text") if isinstance(p, dict) else None for p in content]
            if not all(isinstance(t, str) for t in texts):
                raise ApiError(
                    400, f"'messages[{i}].content': only text parts are served", "messages"
                )
            content = "".join(str(t) for t in texts)
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"'messages[{i}].content' must be a string or parts", "messages")
        out.append({**m, "content": content if content is not None else ""})
    return out


def read_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = _get(body, "tools", (list,), "a list of tools")
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(
                400,
                f"'tools[{i}]' must be {{'type': 'function', 'function': "
                "{'name': ..., 'parameters': ...}}",
                "tools",
            )
    return tools or None


def read_prompt(body: dict[str, Any]) -> str | list[int]:
    """A text completion's prompt: a string, or token ids (one prompt per request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return list(prompt)
    raise ApiError(
        400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt"
    )


# --- responses ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """One choice as the endpoint answers it: its text, tokens (as strings) and log-probs."""

    text: str
    tokens: list[str]  # each completion token's own text
    log_probs: list[float]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    reasoning: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()
    alternatives: list[list[tuple[str, float]]] = field(default_factory=list)  # per token


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def envelope(kind: str, rid: str, model: str) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


Alternatives = list[list[tuple[str, float]]]  # per token: (text, log-prob), most likely first


def _top(
    tokens: list[str], log_probs: list[float], top: int, alternatives: Alternatives | None
) -> list[list[tuple[str, float]]]:
    """Per token its ``top`` alternatives: the engine's, else the sampled token alone."""
    if alternatives and len(alternatives) == len(tokens):
        return [found[:top] for found in alternatives]
    return [[(t, lp)] for t, lp in zip(tokens, log_probs, strict=True)]


def chat_logprobs(
    tokens: list[str], log_probs: list[float], top: int, alternatives: Alternatives | None = None
) -> dict[str, Any]:
    """Chat ``logprobs.content``: per token its log-prob and its ``top`` alternatives."""

    def entry(token: str, lp: float) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    tops = _top(tokens, log_probs, top, alternatives) if top else [[] for _ in tokens]
    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(a, x) for a, x in found]}
            for t, lp, found in zip(tokens, log_probs, tops, strict=True)
        ]
    }


def text_logprobs(
    tokens: list[str],
    log_probs: list[float],
    top: int,
    offset: int = 0,
    alternatives: Alternatives | None = None,
) -> dict[str, Any]:
    """Text completion ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset)."""
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    tops = _top(tokens, log_probs, top, alternatives) if top else None
    return {
        "tokens": tokens,
        "token_logprobs": log_probs,
        "top_logprobs": [dict(found) for found in tops] if tops is not None else None,
        "text_offset": offsets,
    }


def chat_message(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    if choice.reasoning is not None:
        message["reasoning_content"] = choice.reasoning
    if choice.tool_calls:
        message["tool_calls"] = list(choice.tool_calls)
    return message


def chat_response(
    rid: str, model: str, choices: list[Choice], asked: Asked, counts: tuple[int, int]
) -> dict[str, Any]:
    return {
        **envelope("chat.completion", rid, model),
        "choices": [
            {
                "index": i,
                "message": chat_message(c),
                "logprobs": chat_logprobs(c.tokens, c.log_probs, asked.top_logprobs, c.alternatives)
                if asked.logprobs
                else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage(*counts),
    }


def text_response(
    rid: str, model: str, choices: list[Choice], asked: Asked, counts: tuple[int, int]
) -> dict[str, Any]:
    return {
        **envelope("text_completion", rid, model),
        "choices": [
            {
                "index": i,
                "text": c.text,
                "logprobs": text_logprobs(
                    c.tokens, c.log_probs, asked.top_logprobs, alternatives=c.alternatives
                )
                if asked.logprobs
                else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage(*counts),
    }


# --- streaming (server-sent events) --------------------------------------------------------------


def chat_chunk(
    head: dict[str, Any], i: int, delta: dict[str, Any], finish: str | None = None, lp: Any = None
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of choice ``i`` (``head``: :func:`envelope`'s)."""
    return {
        **head,
        "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}],
    }


def text_chunk(
    head: dict[str, Any], i: int, text: str, finish: str | None = None, lp: Any = None
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk of choice ``i``."""
    return {
        **head,
        "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}],
    }


def usage_chunk(head: dict[str, Any], counts: tuple[int, int]) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``."""
    return {**head, "choices": [], "usage": usage(*counts)}


@dataclass(frozen=True)
class Part:
    """A streamed piece of a choice: its text, tokens, their log-probs and alternatives."""

    text: str
    tokens: list[str]
    log_probs: list[float]
    alternatives: Alternatives


def piece_chunks(
    head: dict[str, Any],
    i: int,
    part: Part,
    finish: str | None,
    asked: Asked,
    *,
    chat: bool,
    offset: int = 0,
) -> list[dict[str, Any]]:
    """The chunks of a piece of choice ``i`` streamed as generated: its text with its
    log-probs, then (``finish``: its last piece) the finish reason; ``offset``: where the
    piece starts in the choice's text (text completions' ``text_offset``)."""
    out = []
    if part.text or part.tokens:
        top, alternatives = asked.top_logprobs, part.alternatives
        if chat:
            lp = chat_logprobs(part.tokens, part.log_probs, top, alternatives)
            out.append(
                chat_chunk(head, i, {"content": part.text}, lp=lp if asked.logprobs else None)
            )
        else:
            lp = text_logprobs(part.tokens, part.log_probs, top, offset, alternatives)
            out.append(text_chunk(head, i, part.text, lp=lp if asked.logprobs else None))
    if finish is not None:
        out.append(chat_chunk(head, i, {}, finish) if chat else text_chunk(head, i, "", finish))
    return out


def chat_chunks(
    rid: str, model: str, choices: list[Choice], asked: Asked, counts: tuple[int, int]
) -> Iterator[dict[str, Any]]:
    """The chunks of a chat completion parsed whole (tool calls, reasoning) and then streamed,
    choice after choice: its reasoning, its content in one chunk, its tool calls."""
    head = envelope("chat.completion.chunk", rid, model)
    for i, c in enumerate(choices):
        yield chat_chunk(head, i, {"role": "assistant", "content": ""})
        if c.reasoning is not None:
            yield chat_chunk(head, i, {"reasoning_content": c.reasoning})
        if c.text or c.tokens:
            lp = None
            if asked.logprobs:
                lp = chat_logprobs(c.tokens, c.log_probs, asked.top_logprobs, c.alternatives)
            yield chat_chunk(head, i, {"content": c.text}, lp=lp)
        if c.tool_calls:
            calls = [{"index": k, **call} for k, call in enumerate(c.tool_calls)]
            yield chat_chunk(head, i, {"tool_calls": calls})
        yield chat_chunk(head, i, {}, c.finish_reason)
    if asked.include_usage:
        yield usage_chunk(head, counts)


def sse(event: dict[str, Any] | None) -> bytes:
    """One server-sent event; None: the closing ``[DONE]``."""
    data = "[DONE]" if event is None else json.dumps(event, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
