"""A ``tool_choice`` that forces a call: held to its JSON schema by structured output where the
engine does it (vLLM: tests/engines/test_vllm.py), a clear 400 where it does not (the
transformers engine)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import torch
from transformers import AutoTokenizer

from treadle.engines.inference import HFRolloutEngine
from treadle.models.loading import load_causal_lm
from treadle.serving import LocalReplica, Request, Response, RolloutClient, RolloutServer
from treadle.serving.endpoint import Endpoint

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.fixture(scope="module")
def tok(tiny_task):
    return AutoTokenizer.from_pretrained(tiny_task["model"])


class JsonReplica:
    """Answers with the next scripted text (then EOS), keeping each request's json_schema."""

    def __init__(self, tok: Any, texts: list[str]) -> None:
        self.name, self.tok, self.texts = "json", tok, list(texts)
        self.schemas: list[Any] = []

    async def generate(self, requests: list[Request]) -> list[Response]:
        out = []
        for r in requests:
            self.schemas.append(json.loads(r.json_schema) if r.json_schema else None)
            ids = [*self.tok.encode(self.texts.pop(0)), self.tok.eos_token_id]
            out.append(Response(r.request_id, ids, [-0.5] * len(ids), "stop", 0, self.name))
        return out

    async def score(self, requests: list[Any]) -> list[Any]:
        raise NotImplementedError


def ask(client: RolloutClient, tok: Any, structured: bool, **request: Any) -> Any:
    async def main() -> Any:
        ep = Endpoint(client, tok, model="tiny", max_new_tokens=8, structured_output=structured)
        await ep.start()
        try:
            api = openai.AsyncOpenAI(
                base_url=ep.session_url("t"), api_key=ep.api_key, max_retries=0
            )
            try:
                answer = await api.chat.completions.create(
                    model="tiny", messages=MESSAGES, tools=[ADD], **request
                )
            except openai.BadRequestError as e:
                return e, ep.take_calls("t")
            return answer, ep.take_calls("t")
        finally:
            await ep.stop()

    return client.run(main())


def test_the_hf_engine_refuses_a_forced_tool_choice_with_one_clear_400(tiny_task, tok):
    model = load_causal_lm(tiny_task["model"], torch.float32)
    engine = HFRolloutEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    client = RolloutClient([LocalReplica(RolloutServer(engine, "hf"))])
    try:
        for choice in ("required", NAMED):
            error, calls = ask(client, tok, False, tool_choice=choice)
            assert isinstance(error, openai.BadRequestError) and calls == []
            message = error.body["message"]
            assert "transformers engine (rollout.engine=hf) does not do" in message
            assert "use rollout.engine=vllm, or tool_choice 'auto'" in message
        # the server refuses too, should a request carry a schema to such an engine
        request = Request("r0", (1, 2, 3), engine_params(), json_schema="{}")
        with pytest.raises(ValueError, match="does not do structured output"):
            client.generate([request])
    finally:
        client.close()


def engine_params() -> Any:
    from treadle.engines.inference import SamplingParams

    return SamplingParams(max_new_tokens=2)


def test_a_named_function_is_asked_with_its_arguments_schema_and_answered_as_a_call(tok):
    replica = JsonReplica(tok, ['{"a": 2, "b": 3}'])
    client = RolloutClient([replica])
    try:
        answer, (call,) = ask(client, tok, True, tool_choice=NAMED)
    finally:
        client.close()
    assert replica.schemas == [ADD["function"]["parameters"]]
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "add"
    assert json.loads(tool_call.function.arguments) == {"a": 2, "b": 3}
    assert tok.decode(call.completion_ids, skip_special_tokens=True) == '{"a": 2, "b": 3}'


def test_required_asks_for_a_list_of_calls_and_unknown_names_are_400(tok):
    text = '[{"name": "add", "parameters": {"a": 1, "b": 1}}]'
    replica = JsonReplica(tok, [text])
    client = RolloutClient([replica])
    try:
        answer, _ = ask(client, tok, True, tool_choice="required")
        other = {"type": "function", "function": {"name": "mul"}}
        error, _ = ask(client, tok, True, tool_choice=other)
    finally:
        client.close()
    (schema,) = replica.schemas
    assert schema["type"] == "array" and schema["minItems"] == 1
    (tool_call,) = answer.choices[0].message.tool_calls
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == (
        "add",
        {"a": 1, "b": 1},
    )
    assert isinstance(error, openai.BadRequestError)
    assert "does not match any of the specified `tools`" in error.body["message"]
