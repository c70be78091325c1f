"""The endpoint streams a completion as it is generated (``stream: true``), chunk by chunk,
and records it exactly; the real openai client reads it.

A test double replica answers each chunk with the next tokens of a scripted text (as many as
the chunk asks for), so a test can hold a chunk back and see the earlier ones arrive first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from treadle.serving import Request, Response, RolloutClient
from treadle.serving.endpoint import Endpoint
from treadle.serving.streaming import (
    FIRST_CHUNK_TOKENS,
    MAX_CHUNK_TOKENS,
    LiveCompletion,
    TextStream,
)

MESSAGES = [{"role": "user", "content": "Count."}]


@pytest.fixture(scope="module")
def tok(tiny_task):
    return AutoTokenizer.from_pretrained(tiny_task["model"])


class ChunkedReplica:
    """Answers a request with the next ``max_new_tokens`` tokens of its script after what the
    request's prompt already holds of it (then EOS: stop). ``held``: chunk numbers answered
    only once ``release`` is set; ``version``: the weight version it reports."""

    def __init__(self, tok: Any, text: str, held: tuple[int, ...] = ()) -> None:
        self.name, self.tok = "chunked", tok
        self.script = [*tok.encode(text), tok.eos_token_id]
        self.held, self.release = held, asyncio.Event()
        self.requests: list[Request] = []
        self.answered = 0
        self.base: dict[str, int] = {}  # route -> its first prompt's length
        self.version = 0

    async def generate(self, requests: list[Request]) -> list[Response]:
        out = []
        for r in requests:
            chunk = len(self.requests)
            self.requests.append(r)
            if chunk in self.held:
                await self.release.wait()
            start = len(r.prompt_ids) - self.base.setdefault(r.session_id, len(r.prompt_ids))
            ids = self.script[start : start + r.params.max_new_tokens]
            lps = [-0.01 * (start + k + 1) for k in range(len(ids))]
            reason = "stop" if ids and ids[-1] == self.tok.eos_token_id else "length"
            out.append(Response(r.request_id, ids, lps, reason, self.version, self.name))
            self.answered += 1
        return out

    async def score(self, requests: list[Any]) -> list[Any]:
        raise NotImplementedError


def serve(
    replica: ChunkedReplica, tok: Any, scenario: Callable[[Endpoint], Coroutine[Any, Any, Any]]
) -> Any:
    client = RolloutClient([replica])

    async def main() -> Any:
        endpoint = Endpoint(client, tok, model="tiny", max_new_tokens=64)
        await endpoint.start()
        try:
            return await scenario(endpoint)
        finally:
            await endpoint.stop()

    try:
        return client.run(main())
    finally:
        client.close()


def oai(endpoint: Endpoint, url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=endpoint.api_key, max_retries=0)


TEXT = "one two three four five six seven eight nine ten"


def test_chunks_arrive_while_the_rest_is_generated_and_the_call_is_recorded_whole(tok):
    replica = ChunkedReplica(tok, TEXT, held=(2,))

    async def scenario(ep: Endpoint) -> Any:
        stream = await oai(ep, ep.session_url("s")).chat.completions.create(
            model="tiny", messages=MESSAGES, stream=True, logprobs=True
        )
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            if len(text) > 0 and not replica.release.is_set():  # chunk 2 is still held back
                assert replica.answered <= 2 and ep.take_calls("s") == []
                before = text
                replica.version = 5  # a weight sync between two chunks
                replica.release.set()
        return before, chunks, ep.take_calls("s")

    before, chunks, (call,) = serve(replica, tok, scenario)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == TEXT and TEXT.startswith(before) and len(before) < len(TEXT)
    assert call.completion_ids == replica.script  # every chunk's tokens, in order
    assert call.prompt_ids == list(replica.requests[0].prompt_ids)  # the prompt, once
    assert call.log_probs == [-0.01 * (k + 1) for k in range(len(replica.script))]
    assert call.token_versions[:3] == [0, 0, 0] and set(call.token_versions[3:]) == {5}
    assert call.stop_reason == "stop" and chunks[-1].choices[0].finish_reason == "stop"
    sizes = [r.params.max_new_tokens for r in replica.requests]
    assert sizes[:4] == [FIRST_CHUNK_TOKENS, 2, 4, 8] and max(sizes) <= MAX_CHUNK_TOKENS
    assert len({r.params.seed for r in replica.requests}) == len(replica.requests)
    streamed_lps = [
        t.logprob for c in chunks if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]  # fmt: skip
    assert streamed_lps == call.log_probs


def test_a_stop_string_across_chunks_ends_the_stream_there(tok):
    replica = ChunkedReplica(tok, TEXT)

    async def scenario(ep: Endpoint) -> Any:
        stream = await oai(ep, ep.session_url("s")).completions.create(
            model="tiny", prompt="count", stream=True, stop=["three f"], max_tokens=40
        )
        return [c async for c in stream], ep.take_calls("s")

    chunks, (call,) = serve(replica, tok, scenario)
    assert "".join(c.choices[0].text for c in chunks) == "one two "
    assert chunks[-1].choices[0].finish_reason == "stop" and call.stop_reason == "stop"
    kept = tok.decode(call.completion_ids)
    assert kept.startswith("one two three f") and "five" not in kept  # cut after the stop
    asked = sum(r.params.max_new_tokens for r in replica.requests)
    assert asked < len(replica.script)  # nothing generated past the chunk that stopped


def test_two_choices_stream_interleaved_and_the_budget_holds(tok):
    replica = ChunkedReplica(tok, TEXT)

    async def scenario(ep: Endpoint) -> Any:
        stream = await oai(ep, ep.session_url("n")).completions.create(
            model="tiny", prompt="count", stream=True, n=2, max_tokens=5
        )
        return [c async for c in stream], ep.take_calls("n")

    chunks, calls = serve(replica, tok, scenario)
    assert len(calls) == 2
    for i, call in enumerate(calls):
        text = "".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
        assert len(call.completion_ids) == 5 and call.stop_reason == "length"
        assert text == tok.decode(call.completion_ids, skip_special_tokens=True)


def test_a_client_that_leaves_mid_stream_stops_it_unrecorded(tok, monkeypatch):
    replica = ChunkedReplica(tok, " ".join([TEXT] * 10), held=(1,))  # ~8 chunks in all
    closed = asyncio.Event()
    close = LiveCompletion.close

    async def closing(self: LiveCompletion) -> None:
        await close(self)
        closed.set()

    monkeypatch.setattr(LiveCompletion, "close", closing)

    async def scenario(ep: Endpoint) -> Any:
        stream = await oai(ep, ep.session_url("gone")).chat.completions.create(
            model="tiny", messages=MESSAGES, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break  # the first token: leave
        await stream.close()
        replica.release.set()
        await asyncio.wait_for(closed.wait(), timeout=60)  # the endpoint saw it and stopped
        return ep.take_calls("gone")

    assert serve(replica, tok, scenario) == []
    assert len(replica.requests) <= 4  # the chunks in flight when it left, none after


def test_text_is_held_inside_a_character_and_before_a_possible_stop(tok):
    ids = tok.encode("né 5 + 6 → 11")
    stream = TextStream(tok, stops=("→ 12",))
    sent = [stream.add([i])[0] for i in ids]
    assert all("\ufffd" not in piece for piece in sent)
    assert "".join(sent) + stream.rest() == tok.decode(ids)
    assert "".join(sent) == tok.decode(ids)[:-3]  # the last 3 wait: they may begin "→ 12"
