"""Tools for agent loops: plain Python functions, their JSON schemas, Hermes-style calls.

A tool is a function with type hints and a Google-style docstring (an ``Args:`` section naming
every parameter); ``rollout.tools`` lists them as ``module:function`` or
``path/to/file.py:function``. Its schema comes from ``transformers.utils.get_json_schema``, the
same one a chat template's ``tools=`` argument takes.

How the model sees the tools (``treadle.data.tool_messages``, beside the prompts' rendering):
a chat template with tool support gets the schemas through ``tools=``; for a template without
(SmolLM2's, plain ChatML), the Hermes instructions used by Qwen2.5 and NousResearch's Hermes
models go into the system message. A call is a ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` block in the model's text (:func:`parse_tool_calls`); its result goes
back as a ``tool`` message, or, without tool support in the template, wrapped in
``<tool_response>`` tags, a turn's results together in one user message (what Qwen2.5's
template renders its tool messages as).

Calls never crash a rollout (:meth:`Toolbox.call`): malformed JSON, an unknown tool, wrong
arguments, an exception or a call over ``rollout.tool_timeout_s`` each become an ``Error: ...``
result the model reads. A synchronous tool runs on a thread of the toolbox's pool; a timed-out
call is abandoned, not killed (Python cannot kill a thread), so tools that may hang should be
async or run their work in a subprocess (as :mod:`treadle.sandbox` does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from treadle.data.templating import supports_tools, tool_responses
from treadle.runtime.errors import ConfigError
from treadle.runtime.plugins import load_callable
from treadle.serving.parsers import DEFAULT_TOOL_PARSER, ChatParsers

_CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """A parsed call; ``error`` says why a block could not be parsed (name/arguments unset)."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None
    id: str | None = None  # the call's id, where the parser gives one (vLLM's parsers)


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str
    error: bool
    seconds: float


def tool_schema(fn: Callable[..., Any], key: str = "rollout.tools") -> dict[str, Any]:
    """The JSON schema of ``fn`` as chat templates take it; a ConfigError says what is missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # TypeHintParsingException, DocstringParsingException
        name = getattr(fn, "__name__", repr(fn))
        raise ConfigError(
            f"{key}: tool {name!r} needs type hints on every parameter and a docstring with an "
            f"'Args:' section describing each ({e})"
        ) from e


class Toolbox:
    """The tools of a run, by name, each call timed and bounded."""

    def __init__(self, tools: Sequence[Tool], timeout_s: float = 10.0, threads: int = 8) -> None:
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._threads = threads

    @classmethod
    def load(cls, specs: Sequence[str], timeout_s: float = 10.0) -> Toolbox:
        tools = []
        for spec in specs:
            fn = load_callable(spec, "rollout.tools")
            schema = tool_schema(fn)
            tools.append(Tool(schema["function"]["name"], fn, schema))
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ConfigError(f"rollout.tools: two tools share a name ({', '.join(names)})")
        return cls(tools, timeout_s)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def __len__(self) -> int:
        return len(self.tools)

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call; every failure is an ``Error: ...`` result, never an exception."""
        name = call.name or "?"
        if call.error is not None:
            return ToolResult(name, f"Error: {call.error}", True, 0.0)
        tool = self.tools.get(name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return ToolResult(name, f"Error: unknown tool {name!r} (tools: {known})", True, 0.0)
        start = time.perf_counter()
        try:
            out = await asyncio.wait_for(self._run(tool, call.arguments), self.timeout_s)
        except TimeoutError:
            content, error = f"Error: {name} timed out after {self.timeout_s:g} s", True
        except Exception as e:
            content, error = f"Error: {name} raised {type(e).__name__}: {e}", True
        else:
            content, error = _as_text(out), False
        return ToolResult(name, content, error, time.perf_counter() - start)

    async def _run(self, tool: Tool, arguments: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(tool.fn):
            return await tool.fn(**arguments)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, "treadle-tool")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: tool.fn(**arguments))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` block in ``text`` (an unclosed last block too); an
    empty block is a mention of the tag (``within <tool_call></tool_call> tags``), not a call."""
    calls = []
    for body, closing in _CALL_RE.findall(text):
        if not body.strip():
            continue
        if not closing:
            calls.append(ToolCall(None, {}, "the <tool_call> block is not closed"))
            continue
        calls.append(_parse_call(body.strip()))
    return calls


CallParser = Callable[[str], list[ToolCall]]
"""The tool calls in a model turn's text."""


def call_parser(tokenizer: Any, name: str, schemas: list[dict[str, Any]]) -> CallParser:
    """``rollout.tool_parser``'s: :func:`parse_tool_calls` for hermes (no vLLM needed), else
    vLLM's parser of that name (llama3_json, mistral, ...), as the endpoint parses with it."""
    if name == DEFAULT_TOOL_PARSER:
        return parse_tool_calls
    parsers = ChatParsers(tokenizer, name, None)
    body = {"tools": schemas}
    try:  # builds vLLM's parser once: one that cannot read the tokenizer or tools fails here
        request = parsers.request(body)
        parsers.parse(" ", body, request)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"rollout.tool_parser={name}: {e}") from None

    def parse(text: str) -> list[ToolCall]:
        _, _, calls = parsers.parse(text, body, request)
        return [_from_openai(call) for call in calls]

    return parse


def _from_openai(call: dict[str, Any]) -> ToolCall:
    """A call as vLLM's parsers give it (OpenAI's JSON: id, function name and arguments)."""
    function, call_id = call.get("function", {}), call.get("id")
    name, arguments = function.get("name"), function.get("arguments") or "{}"
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as e:
        return ToolCall(name, {}, f"the arguments of {name} are not valid JSON ({e.msg})", call_id)
    if not isinstance(args, dict):
        return ToolCall(name, {}, f"the arguments of {name} must be a JSON object", call_id)
    return ToolCall(name, args, None, call_id)


def _parse_call(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, {}, f"the tool call is not valid JSON ({e.msg})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, {}, 'a tool call is {"name": <tool name>, "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models send the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args)
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, f"the arguments of {obj['name']} must be a JSON object")
    return ToolCall(obj["name"], args)


# ----------------------------------------------------------------------------- chat rendering


def numbered(calls: Sequence[ToolCall]) -> list[ToolCall]:
    """``calls`` with an id each: a call whose parser gave none (hermes) gets ``call00000``,
    ``call00001``, ... (nine letters and digits: Mistral's template refuses other ids)."""
    return [c if c.id is not None else replace(c, id=f"call{i:05d}") for i, c in enumerate(calls)]


def result_messages(
    tokenizer: PreTrainedTokenizerBase, contents: list[str], calls: Sequence[ToolCall] = ()
) -> list[dict[str, str]]:
    """A turn's tool results as chat messages (see the module docstring): one ``tool``
    message each (with its call's id and name where the parser gave an id), or one user
    message holding them all, as Qwen2.5's template renders consecutive tool messages (a
    template that alternates user and model turns takes it)."""
    if supports_tools(tokenizer):
        messages = [{"role": "tool", "content": c} for c in contents]
        for message, call in zip(messages, calls, strict=False):
            if call.id is not None:
                message.update(tool_call_id=call.id, name=call.name or "")
        return messages
    return [{"role": "user", "content": tool_responses(contents)}]
