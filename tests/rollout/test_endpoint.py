"""The OpenAI-compatible endpoint, through the real ``openai`` client.

The model is the tiny task's, served by the transformers engine in this process (a
LocalReplica on the rollout client's loop, which the endpoint and the openai client share).
Tool calls, reasoning and stop strings need text a random model does not write: there a test
double replica answers with the tokens of a scripted text.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import openai
import pytest
import torch
from transformers import AutoTokenizer

from treadle.config import load_config
from treadle.engines.inference import HFRolloutEngine, SamplingParams
from treadle.models.loading import load_causal_lm
from treadle.runtime.errors import ConfigError
from treadle.serving import LocalReplica, Request, Response, RolloutClient, RolloutServer
from treadle.serving import openai_api as api
from treadle.serving.endpoint import Endpoint

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def tok(tiny_task):
    return AutoTokenizer.from_pretrained(tiny_task["model"])


@pytest.fixture(scope="module")
def client(tiny_task, tok):
    model = load_causal_lm(tiny_task["model"], torch.float32)
    engine = HFRolloutEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    c = RolloutClient([LocalReplica(RolloutServer(engine, "tiny"))])
    yield c
    c.close()


class ScriptedReplica:
    """Answers each request with the tokens of the next scripted text (then EOS)."""

    def __init__(self, tok: Any, texts: list[str]) -> None:
        self.name, self.tok, self.texts = "scripted", tok, list(texts)
        self.requests: list[Request] = []

    async def generate(self, requests: list[Request]) -> list[Response]:
        out = []
        for r in requests:
            self.requests.append(r)
            ids = [*self.tok.encode(self.texts.pop(0)), self.tok.eos_token_id]
            lps = [-0.25 - 0.01 * i for i in range(len(ids))]
            out.append(Response(r.request_id, ids, lps, "stop", 3, self.name))
        return out


def serve(
    client: RolloutClient,
    tok: Any,
    scenario: Callable[[Endpoint], Coroutine[Any, Any, Any]],
    **options: Any,
) -> Any:
    """Run ``scenario(endpoint)`` on the client's loop with the endpoint listening."""

    async def main() -> Any:
        endpoint = Endpoint(client, tok, model="tiny", max_new_tokens=8, **options)
        await endpoint.start()
        try:
            return await scenario(endpoint)
        finally:
            await endpoint.stop()

    return client.run(main())


def oai(endpoint: Endpoint, url: str | None = None, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=url or endpoint.url, api_key=endpoint.api_key, max_retries=0, **kw
    )


def text_of(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


# --- chat and completions on the tiny model ---------------------------------------------------


def test_a_server_that_does_not_record_keeps_no_calls(client, tok):
    """``treadle serve``'s endpoint (record=False): a session's calls are answered, not kept."""

    async def scenario(ep: Endpoint) -> Any:
        answer = await oai(ep, ep.session_url("s/2")).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4
        )
        return answer, ep.take_calls("s/2"), dict(ep.recorder.calls)

    answer, calls, kept = serve(client, tok, scenario, record=False)
    assert answer.choices[0].message.content is not None
    assert calls == [] and kept == {}


def test_chat_returns_what_was_sampled_and_records_it(client, tok):
    async def scenario(ep: Endpoint) -> Any:
        answer = await oai(ep, ep.session_url("s/1")).chat.completions.create(
            model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=3, n=2, max_tokens=6
        )
        return answer, ep.take_calls("s/1"), ep.take_calls("s/1")

    answer, calls, again = serve(client, tok, scenario)
    expected_prompt = tok.encode(
        tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert [c.index for c in calls] == [0, 1] and again == []
    assert len(answer.choices) == 2
    for choice, call in zip(answer.choices, calls, strict=True):
        assert call.session == "s/1"
        assert call.prompt_ids == expected_prompt
        assert choice.message.content == text_of(tok, call.completion_ids)
        assert 0 < len(call.completion_ids) <= 6 and call.token_versions == [0] * len(
            call.log_probs
        )
        got = choice.logprobs.content
        assert [t.logprob for t in got] == call.log_probs
        assert [t.token for t in got] == [tok.decode([i]) for i in call.completion_ids]
        assert all(len(t.top_logprobs) == 3 for t in got)  # (their values: a test below)
        reason = "stop" if call.completion_ids[-1] == tok.eos_token_id else "length"
        assert choice.finish_reason == call.stop_reason == reason
    assert answer.usage.prompt_tokens == len(expected_prompt)
    assert answer.usage.completion_tokens == sum(len(c.completion_ids) for c in calls)


def test_top_logprobs_are_the_most_likely_tokens_of_the_sampled_distribution(client, tok):
    """top_logprobs=k: per completion token the k most likely tokens there and their log-probs,
    from the distribution the token was sampled from (temperature 0.7 here), as a forward pass
    of the model gives them."""

    async def scenario(ep: Endpoint) -> Any:
        answer = await oai(ep, ep.session_url("top")).chat.completions.create(
            model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=4, max_tokens=5,
            temperature=0.7,
        )  # fmt: skip
        return answer, ep.take_calls("top")

    answer, (call,) = serve(client, tok, scenario)
    model = client.replicas[0].server.engine.model
    ids = torch.tensor([call.prompt_ids + call.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(call.prompt_ids) - 1 : -1].float() / 0.7
    expected = torch.log_softmax(logits, -1).topk(4, -1)
    got = answer.choices[0].logprobs.content
    assert len(got) == len(call.completion_ids)
    for j, entry in enumerate(got):
        tops = entry.top_logprobs
        assert [t.token for t in tops] == [tok.decode([i]) for i in expected.indices[j].tolist()]
        assert [t.logprob for t in tops] == pytest.approx(expected.values[j].tolist(), abs=1e-4)
        sampled = torch.log_softmax(logits[j], -1)[call.completion_ids[j]]
        assert entry.logprob == pytest.approx(float(sampled), abs=1e-4)


def test_completions_from_text_and_from_token_ids(client, tok):
    async def scenario(ep: Endpoint) -> Any:
        api_client = oai(ep, ep.session_url("c"))
        by_text = await api_client.completions.create(
            model="tiny", prompt="12 + 7 =", max_tokens=5, logprobs=2
        )
        by_ids = await api_client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3)
        return by_text, by_ids, ep.take_calls("c")

    by_text, by_ids, calls = serve(client, tok, scenario)
    assert calls[0].prompt_ids == tok.encode("12 + 7 =") and calls[1].prompt_ids == [5, 6, 7]
    assert by_text.choices[0].text == text_of(tok, calls[0].completion_ids)
    lp = by_text.choices[0].logprobs
    assert lp.token_logprobs == calls[0].log_probs
    assert all(0 < len(top) <= 2 for top in lp.top_logprobs)  # (tokens of one text: one key)
    for top, x in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert max(top.values()) >= x - 1e-5  # the most likely is at least the sampled one
    assert by_ids.choices[0].text == text_of(tok, calls[1].completion_ids)
    assert len(calls[1].completion_ids) <= 3


def test_streams_concatenate_to_the_recorded_answer(client, tok):
    async def scenario(ep: Endpoint) -> Any:
        api_client = oai(ep, ep.session_url("st"))
        chat = await api_client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            stream=True,
            logprobs=True,
            max_tokens=8,
            stream_options={"include_usage": True},
        )
        chat_chunks = [c async for c in chat]
        text = await api_client.completions.create(
            model="tiny", prompt="3 + 4 =", max_tokens=8, stream=True
        )
        text_chunks = [c async for c in text]
        return chat_chunks, text_chunks, ep.take_calls("st")

    chat_chunks, text_chunks, (chat_call, text_call) = serve(client, tok, scenario)
    deltas = [c.choices[0].delta for c in chat_chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == text_of(tok, chat_call.completion_ids)
    streamed = [
        t.logprob
        for c in chat_chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert streamed == chat_call.log_probs
    assert chat_chunks[-1].usage.completion_tokens == len(chat_call.completion_ids)
    finishes = [c.choices[0].finish_reason for c in chat_chunks if c.choices]
    assert finishes[-1] == chat_call.stop_reason and set(finishes[:-1]) == {None}
    assert "".join(c.choices[0].text for c in text_chunks) == text_of(tok, text_call.completion_ids)


def test_sessions_by_header_and_calls_without_one_are_not_recorded(client, tok):
    async def scenario(ep: Endpoint) -> Any:
        headed = oai(ep, default_headers={"X-Treadle-Session": "h1"})
        await headed.chat.completions.create(model="any", messages=MESSAGES, max_tokens=2)
        await oai(ep).chat.completions.create(model="any", messages=MESSAGES, max_tokens=2)
        models = await oai(ep).models.list()
        return ep.take_calls("h1"), dict(ep.recorder.calls), models

    calls, rest, models = serve(client, tok, scenario)
    assert len(calls) == 1 and calls[0].session == "h1"
    assert rest == {}
    assert [m.id for m in models.data] == ["tiny"]


def test_an_open_session_samples_as_the_run_does(client, tok):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=3)

    async def scenario(ep: Endpoint) -> Any:
        url = ep.open_session("train", greedy)
        answers = [
            await oai(ep, url).chat.completions.create(
                model="tiny", messages=MESSAGES, temperature=1.7, max_tokens=30, seed=11
            )
            for _ in range(2)
        ]
        return answers, ep.take_calls("train")

    answers, calls = serve(client, tok, scenario)
    assert all(len(c.completion_ids) <= 3 for c in calls)  # capped at max_new_tokens
    assert calls[0].completion_ids == calls[1].completion_ids  # greedy, not temperature 1.7
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


def test_a_three_turn_chat_extends_its_own_tokens(client, tok):
    """Each turn's prompt is the previous prompt + completion, token for token (what the
    trainer merges into one sample), with the tiny model's ChatML template."""
    replica = ScriptedReplica(tok, ["5", "Seven.", "Done"])
    scripted = RolloutClient([replica])
    try:

        async def scenario(ep: Endpoint) -> Any:
            messages = list(MESSAGES)
            for follow_up in ("And 3 + 4?", "Thanks"):
                answer = await oai(ep, ep.session_url("t")).chat.completions.create(
                    model="tiny", messages=messages
                )
                messages += [
                    {"role": "assistant", "content": answer.choices[0].message.content},
                    {"role": "user", "content": follow_up},
                ]
            await oai(ep, ep.session_url("t")).chat.completions.create(
                model="tiny", messages=messages
            )
            return ep.take_calls("t")

        calls = serve(scripted, tok, scenario)
    finally:
        scripted.close()
    assert [text_of(tok, c.completion_ids) for c in calls] == ["5", "Seven.", "Done"]
    for before, after in itertools.pairwise(calls):
        done = before.prompt_ids + before.completion_ids
        assert after.prompt_ids[: len(done)] == done
    assert [r.session_id for r in replica.requests] == ["t"] * 3
    assert calls[0].token_versions == [3] * len(calls[0].completion_ids)


def three_turns(tok: Any) -> list[Any]:
    """A three-turn chat over a scripted replica, recorded under session "t"."""
    scripted_client = RolloutClient([ScriptedReplica(tok, ["5", "Seven.", "Done"])])

    async def scenario(ep: Endpoint) -> Any:
        messages = list(MESSAGES)
        for follow_up in ("And 3 + 4?", "Thanks", None):
            answer = await oai(ep, ep.session_url("t")).chat.completions.create(
                model="tiny", messages=messages
            )
            if follow_up is not None:
                messages += [
                    {"role": "assistant", "content": answer.choices[0].message.content},
                    {"role": "user", "content": follow_up},
                ]
        return ep.take_calls("t")

    try:
        return serve(scripted_client, tok, scenario)
    finally:
        scripted_client.close()


def test_recorded_turns_merge_into_one_sample_or_split_where_history_is_dropped(tok):
    from treadle.agents.sessions import merge_calls

    calls = three_turns(tok)
    (t,) = merge_calls(calls, width=512)
    assert t.prompt_ids == calls[0].prompt_ids
    assert t.model_token_ids == [i for c in calls for i in c.completion_ids]
    sampled = [lp for lp, m in zip(t.log_probs, t.loss_mask, strict=True) if m]
    assert sampled == [lp for c in calls for lp in c.log_probs]
    # A template that shows the model only the last user message drops the history: each
    # turn is then a sample of its own, with its own prompt.
    forgetful = copy.deepcopy(tok)
    forgetful.chat_template = (
        "{% set last = messages | selectattr('role', 'equalto', 'user') | list | last %}"
        "<|im_start|>user\n{{ last['content'] }}<|im_end|>\n"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    calls = three_turns(forgetful)
    parts = merge_calls(calls, width=512)
    assert len(parts) == 3 and [p.prompt_ids for p in parts] == [c.prompt_ids for c in calls]
    assert [p.token_ids for p in parts] == [c.completion_ids for c in calls]
    assert all(p.loss_mask == [1] * len(p.token_ids) for p in parts)


# --- tool calls, reasoning, stop strings (scripted text) ------------------------------------------


def scripted(tok: Any, texts: list[str], scenario: Any, **options: Any) -> Any:
    client = RolloutClient([ScriptedReplica(tok, texts)])
    try:
        return serve(client, tok, scenario, **options)
    finally:
        client.close()


CALL_TEXT = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def test_tool_calls_are_parsed_by_the_hermes_parser(tok):
    async def scenario(ep: Endpoint) -> Any:
        api_client = oai(ep, ep.session_url("tools"))
        plain = await api_client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS
        )
        streamed = await api_client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, stream=True
        )
        return plain, [c async for c in streamed], ep.take_calls("tools")

    plain, chunks, calls = scripted(tok, [CALL_TEXT, CALL_TEXT], scenario)
    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me add."
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert call.id
    deltas = [c.choices[0].delta for c in chunks]
    (streamed_call,) = [t for d in deltas for t in d.tool_calls or []]
    assert streamed_call.function.name == "add" and streamed_call.index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert text_of(tok, calls[0].completion_ids) == CALL_TEXT  # the record keeps the raw text
    # the schemas reached the template's prompt (the tiny template has no tools: system block)
    assert '"name": "add"' in tok.decode(calls[0].prompt_ids)


def test_a_tool_call_in_history_is_rendered_for_the_next_turn(tok):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]

    async def scenario(ep: Endpoint) -> Any:
        answer = await oai(ep, ep.session_url("h")).chat.completions.create(
            model="tiny", messages=history, tools=TOOLS
        )
        return answer, ep.take_calls("h")

    answer, (call,) = scripted(tok, ["It is 5."], scenario)
    assert answer.choices[0].message.content == "It is 5."
    assert answer.choices[0].finish_reason == "stop"
    # (the tiny model's ChatML template has no tool support: the tools loop's Hermes text)
    sent = tok.decode(call.prompt_ids)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in sent
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in sent


@pytest.mark.parametrize("family", ["gemma3", "phi3_5"])
def test_tool_turns_on_a_template_without_tool_support_are_written_as_hermes_text(tok, family):
    """Gemma 3's template raises on a tool message and Phi-3.5's writes none (the result was
    lost); the model was told Hermes' format in the system message, so its calls go back as
    <tool_call> blocks in its turn and a run of results as one user turn of <tool_response>
    blocks, as the tools loop writes them."""
    from tiny_models import shipped_style

    from treadle.serving.completions import chat_prompt_ids

    styled = shipped_style(tok, family)
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    history = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c1", "content": "6"},
    ]
    text = styled.decode(chat_prompt_ids(styled, history, TOOLS))
    assert "<tool_call>\n{" in text.split("What is 2+3?")[0]  # (Hermes' instructions)
    turns = text.split("What is 2+3?")[1]
    assert 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>' in turns
    results = "<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response>"
    user = {"gemma3": "<start_of_turn>user\n", "phi3_5": "<|user|>\n"}[family]
    assert user + results in turns


def test_stop_strings_cut_the_text_and_keep_the_sampled_tokens(tok):
    async def scenario(ep: Endpoint) -> Any:
        answer = await oai(ep, ep.session_url("s")).completions.create(
            model="tiny", prompt="count", stop=["three"], logprobs=0
        )
        return answer, ep.take_calls("s")

    answer, (call,) = scripted(tok, ["one two three four five"], scenario)
    assert answer.choices[0].text == "one two "
    assert answer.choices[0].finish_reason == "stop" and call.stop_reason == "stop"
    kept = text_of(tok, call.completion_ids)
    assert kept.startswith("one two three") and "four" not in kept
    assert len(call.log_probs) == len(call.completion_ids)
    assert answer.choices[0].logprobs.token_logprobs == call.log_probs


def test_reasoning_content_through_a_reasoning_parser(tiny_task, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_task["model"])
    tok.add_tokens(["<think>", "</think>"])

    async def scenario(ep: Endpoint) -> Any:
        return await oai(ep).chat.completions.create(model="tiny", messages=MESSAGES)

    answer = scripted(
        tok, ["<think>2 and 3 make 5</think>It is 5."], scenario, reasoning_parser="deepseek_r1"
    )
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] == "2 and 3 make 5"
    assert message.content == "It is 5."


# --- errors -----------------------------------------------------------------------------------


def test_a_wrong_or_missing_token_is_401(client, tok):
    async def scenario(ep: Endpoint) -> Any:
        wrong = openai.AsyncOpenAI(base_url=ep.url, api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            await wrong.chat.completions.create(model="tiny", messages=MESSAGES)
        async with aiohttp.ClientSession() as http, http.get(f"{ep.url}/models") as r:
            return e.value, r.status, await r.json()

    error, status, body = serve(client, tok, scenario)
    assert error.status_code == 401 and "API key" in str(error.message)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("chat/completions", b"{not json", "not valid JSON"),
        ("chat/completions", b'{"model": "tiny"}', "'messages'"),
        ("chat/completions", b'{"messages": [{"content": "hi"}]}', "'messages[0]'"),
        ("chat/completions", b'{"messages": [{"role": "user", "content": 3}]}', "content"),
        (
            "chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
            "'temperature'",
        ),
        ("chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "'n'"),
        (
            "chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
            "'tools[0]'",
        ),
        (
            "chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
            b'"function": {"name": "f"}}], "tool_choice": 7}',
            "'tool_choice",
        ),
        ("completions", b'{"model": "tiny"}', "'prompt'"),
        ("completions", b'{"prompt": [1, 99999]}', "vocabulary"),
        ("completions", b'{"prompt": "x", "max_tokens": -1}', "'max_tokens'"),
        ("completions", b'{"prompt": "x", "stop": [""]}', "'stop'"),
    ],
)
def test_a_malformed_body_is_400_naming_the_field(client, tok, path, body, field):
    async def scenario(ep: Endpoint) -> Any:
        headers = {"Authorization": f"Bearer {ep.api_key}", "Content-Type": "application/json"}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{ep.url}/{path}", data=body, headers=headers) as r,
        ):
            return r.status, await r.json()

    status, answer = serve(client, tok, scenario)
    assert status == 400, answer
    assert field in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"


def test_the_openai_client_sees_400_and_a_prompt_too_long(client, tok):
    async def scenario(ep: Endpoint) -> Any:
        errors = []
        for kwargs in ({"temperature": 5}, {"messages": [{"role": "user", "content": "9" * 80}]}):
            with pytest.raises(openai.BadRequestError) as e:
                await oai(ep).chat.completions.create(
                    model="tiny", **{"messages": MESSAGES, **kwargs}
                )
            errors.append(e.value.message)
        return errors

    errors = serve(client, tok, scenario, max_model_len=64)
    assert "'temperature' must be between 0 and 2" in errors[0]
    assert "the model takes 64 tokens in all" in errors[1]


# --- pieces, config -----------------------------------------------------------------------------


def test_asked_reads_max_completion_tokens_and_stop():
    asked = api.read_asked({"max_completion_tokens": 7, "stop": "x", "n": 2}, chat=True)
    assert (asked.max_tokens, asked.stop, asked.n) == (7, ("x",), 2)
    assert api.read_asked({"logprobs": 0}, chat=False).logprobs


def test_endpoint_keys_in_config_and_overrides():
    cfg = load_config(None, ["rollout.endpoint.port=8123", "rollout.endpoint.api_key=k"])
    assert (cfg.rollout.endpoint.port, cfg.rollout.endpoint.api_key) == (8123, "k")
    assert cfg.rollout.tool_parser == "hermes" and cfg.rollout.reasoning_parser is None
    with pytest.raises(ConfigError, match=r"did you mean 'rollout.endpoint.port'"):
        load_config(None, ["rollout.endpoint.prot=1"])
    with pytest.raises(ConfigError, match=r"rollout.endpoint.port"):
        load_config(None, ["rollout.endpoint.port=70000"])


def test_from_config_forces_the_runs_sampling(client, tok):
    cfg = load_config(
        None,
        [
            "rollout.temperature=0.7",
            "rollout.max_new_tokens=5",
            "rollout.endpoint.api_key=secret",
            "model.path=/m/tiny",
        ],
    )
    ep = Endpoint.from_config(cfg, client, tok)
    assert ep.api_key == "secret" and ep.model == "tiny"
    params = ep.recorder.params(
        "any", api.read_asked({"max_tokens": 50, "temperature": 2}, chat=True), 8
    )
    assert (params.temperature, params.max_new_tokens) == (0.7, 5)
    served = Endpoint.from_config(cfg, client, tok, force_sampling=False)
    params = served.recorder.params(None, api.read_asked({"temperature": 2}, chat=True), 8)
    assert (params.temperature, params.max_new_tokens) == (2, 8)
    assert Endpoint(client, tok, model="m").api_key != Endpoint(client, tok, model="m").api_key


def test_check_names_the_parser_keys_and_their_choices(tiny_task):
    from treadle.check.run import check

    base = [f"model.path={tiny_task['model']}", "data.max_prompt_length=64"]
    bad = load_config(None, [*base, "rollout.tool_parser=hermez", "rollout.reasoning_parser=r9"])
    with pytest.raises(ConfigError) as e:
        check(bad, "serve")
    lines = str(e.value).splitlines()
    assert lines[0].startswith("rollout.tool_parser=hermez is not one of vLLM's tool parsers: ")
    assert "hermes" in lines[0] and "llama3_json" in lines[0]
    assert lines[1].startswith("rollout.reasoning_parser=r9 is not one of vLLM's reasoning ")
    assert "deepseek_r1" in lines[1]
    good = load_config(None, [*base, "rollout.tool_parser=llama3_json"])
    assert "rollout.tool_parser: llama3_json, reasoning: None" in check(good, "serve")


def test_the_same_question_asked_twice_is_sampled_anew_unless_seeded(client, tok):
    async def scenario(ep: Endpoint) -> Any:
        answers = []
        for seed in (None, None, 5, 5):
            answer = await oai(ep, ep.session_url("r")).chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=8, seed=seed
            )
            answers.append(answer.choices[0].message.content)
        return answers

    first, second, seeded, again = serve(client, tok, scenario)
    assert first != second  # 8 tokens of a random model: equal only by the same noise
    assert seeded == again


def test_a_taken_port_is_one_line_at_check_and_at_start(client, tok, tiny_task):
    """`treadle serve` on a port in use stopped with a 30-line OSError traceback once the model
    had loaded: the check binds the port as the endpoint will, and the endpoint's own start
    (the port taken since) says the same line."""
    from treadle.check.run import check

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        said = (
            f"rollout.endpoint.port={port}: 127.0.0.1:{port} is in use by another process: "
            "choose another port, or 0 for a free one"
        )
        base = [f"model.path={tiny_task['model']}", "data.max_prompt_length=64"]
        cfg = load_config(None, [*base, f"rollout.endpoint.port={port}"])
        with pytest.raises(ConfigError) as e:
            check(cfg, "serve")
        assert str(e.value) == said
        with pytest.raises(ConfigError) as e:
            serve(client, tok, lambda endpoint: asyncio.sleep(0), port=port)
        assert str(e.value) == said
    away = load_config(
        None, [*base, "rollout.endpoint.host=192.0.2.1", "rollout.endpoint.port=8000"]
    )
    with pytest.raises(ConfigError, match=r"^rollout\.endpoint\.host=192\.0\.2\.1: not an address"):
        check(away, "serve")
    check(load_config(None, base), "serve")  # port 0: a free one, never checked


class SilentReplica:
    """Takes each request and never answers (a request whose task a stop signal ended)."""

    def __init__(self) -> None:
        self.name, self.asked = "silent", asyncio.Event()

    async def generate(self, requests: list[Request]) -> list[Response]:
        self.asked.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@pytest.mark.parametrize("grace", [0.2, 1.0])
def test_stop_cuts_a_request_that_never_ends_after_its_grace(tok, grace):
    """`stop_grace_s` (`treadle serve`: 1 s) bounds how long a stop waits for a request in
    flight, then for it to end once cut (a fixed 5 s took 10 s here: 5 before the cut, 5 after)."""
    replica = SilentReplica()
    client = RolloutClient([replica])

    async def main() -> tuple[float, BaseException | None]:
        endpoint = Endpoint(client, tok, model="tiny", max_new_tokens=8, stop_grace_s=grace)
        await endpoint.start()
        ask = asyncio.ensure_future(
            oai(endpoint, timeout=120).chat.completions.create(model="tiny", messages=MESSAGES)
        )
        await asyncio.wait_for(replica.asked.wait(), timeout=60)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await endpoint.stop()
        took = loop.time() - start
        done, _ = await asyncio.wait([ask], timeout=60)  # the client sees the connection cut
        return took, ask.exception() if done else None

    try:
        took, error = client.run(main())
    finally:
        client.close()
    assert grace <= took < grace + 3.0, took  # waited its grace, not the 5 s default
    assert isinstance(error, openai.APIConnectionError), error


def test_a_stop_grace_of_zero_is_refused(client, tok):
    # aiohttp reads a shutdown timeout of 0 as no limit: a stop would wait for every client
    with pytest.raises(ValueError, match=r"stop_grace_s must be positive, got 0"):
        Endpoint(client, tok, model="tiny", stop_grace_s=0)
