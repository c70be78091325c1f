"""A completion streamed as it is generated (``stream: true`` without parsers), and recorded
exactly.

The rollout service answers whole requests (the engines step many requests at once and return
each when it ends), so a streamed choice is generated in **chunks**: a request for the first
``FIRST_CHUNK_TOKENS`` tokens, then one whose prompt is the prompt plus every token so far for
twice as many, and so on up to ``MAX_CHUNK_TOKENS`` a chunk, until the model stops or the budget
is spent. Each chunk's tokens are sent as soon as it is answered: the first token comes after
one engine step, and a long answer costs a handful of requests (log2 of its length, then one
per ``MAX_CHUNK_TOKENS``), each re-reading the tokens before it (vLLM's prefix cache keeps that
cheap; the transformers engine recomputes it). The chunks of one choice go to one replica (its
session's, or a route of their own).

The choice is exactly what was sampled: the tokens of its chunks in order, each token's
log-prob and weight version as the engine returned them (a weight sync between two chunks shows
in the versions), recorded once as one call when every choice has finished, before the closing
``[DONE]`` (so an agent that read the whole stream finds its call recorded). Every chunk
samples with a seed of its own, derived from the call's. A stream the client leaves is not
recorded: nobody saw its answer.

Text goes out as the tokens decode: a token that ends inside a character waits for the next,
and with ``stop`` strings the last ``len(longest stop) - 1`` characters wait until they cannot
begin one; a stop string ends the choice there (the token that completed it stays in the
record, the text ends before it, as :func:`treadle.serving.completions.finish` does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from treadle.engines.inference import SamplingParams
from treadle.serving import completions as cmp
from treadle.serving import openai_api as api
from treadle.serving.client import RolloutClient
from treadle.serving.server import Request, Response

logger = logging.getLogger("treadle.serving.endpoint")
FIRST_CHUNK_TOKENS = 1
MAX_CHUNK_TOKENS = 32


class TextStream:
    """A choice's text as its tokens arrive: what may be sent so far, and where a stop string
    cuts it."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) - 1 for s in stops), default=0)
        self.ids: list[int] = []
        self.text = ""  # sent so far

    def add(self, ids: list[int]) -> tuple[str, int | None]:
        """The text ``ids`` let out, and, when a stop string completed, how many of all the
        tokens so far are kept (the choice ends there)."""
        self.ids += ids
        cut = cmp.cut_at_stop(self.tokenizer, self.ids, self.stops) if self.stops else None
        if cut is not None:
            keep, text = cut
            return self._send(text, len(text)), keep
        text = cmp.decode(self.tokenizer, self.ids)
        return self._send(text, len(text.rstrip("\ufffd")) - self.hold), None

    def rest(self) -> str:
        """The text not sent yet, once the choice has ended without a stop string."""
        text = cmp.decode(self.tokenizer, self.ids)
        return self._send(text, len(text))

    def _send(self, text: str, upto: int) -> str:
        if upto <= len(self.text):
            return ""
        piece = text[len(self.text) : upto]
        self.text += piece
        return piece


@dataclass
class Piece:
    """Tokens of one choice sent in one chunk; ``done``: the whole choice, on its last."""

    choice: int
    text: str
    token_ids: list[int]
    log_probs: list[float]
    top_ids: list[list[int]] = field(default_factory=list)
    top_log_probs: list[list[float]] = field(default_factory=list)
    done: cmp.Sampled | None = None


class LiveCompletion:
    """The chunks of one streamed request (``asked.n`` choices at once), then its choices as
    recorded (:attr:`sampled`)."""

    def __init__(
        self,
        client: RolloutClient,
        tokenizer: Any,
        prompt: list[int],
        params: SamplingParams,
        asked: api.Asked,
        session: str | None,
    ) -> None:
        self.client, self.tokenizer, self.prompt = client, tokenizer, prompt
        self.params, self.asked, self.session = params, asked, session
        self.sampled: list[cmp.Sampled] = []
        self._queue: asyncio.Queue[Piece | BaseException] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def pieces(self) -> AsyncIterator[Piece]:
        """Every piece as it is generated, choices interleaved; :attr:`sampled` is set when
        the last one has come."""
        n = self.asked.n
        self._tasks = [asyncio.create_task(self._choice(i)) for i in range(n)]
        done: dict[int, cmp.Sampled] = {}
        while len(done) < n:
            piece = await self._queue.get()
            if isinstance(piece, BaseException):
                raise piece
            if piece.done is not None:
                done[piece.choice] = piece.done
            yield piece
        self.sampled = [done[i] for i in range(n)]

    async def close(self) -> None:
        """Stop whatever is still generating (the client left)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _choice(self, index: int) -> None:
        try:
            await self._generate(index)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the writer hears of it (it waits on the queue)
            self._queue.put_nowait(e)

    async def _generate(self, index: int) -> None:
        """Choice ``index``, chunk after chunk, each piece into the queue."""
        budget = self.params.max_new_tokens
        route = self.session or self.client.new_id("stream-")  # the chunks stay on one replica
        stream = TextStream(self.tokenizer, self.asked.stop)
        s = cmp.Sampled([], [], [], "length", "")
        size, chunk = FIRST_CHUNK_TOKENS, 0
        try:
            while True:
                r = await self._chunk(index, chunk, s, min(size, budget - len(s.token_ids)), route)
                text, keep = stream.add(list(r.token_ids))
                start, s = len(s.token_ids), _extended(s, r, keep)
                reason = "stop" if keep is not None or r.stop_reason == "stop" else None
                if reason is None and (not r.token_ids or len(s.token_ids) >= budget):
                    reason = "length"
                if reason is not None:
                    text += stream.rest() if keep is None else ""
                    s = dataclasses.replace(s, stop_reason=reason, text=stream.text)
                self._queue.put_nowait(_piece(index, text, s, start, s if reason else None))
                if reason is not None:
                    return
                size, chunk = min(2 * size, MAX_CHUNK_TOKENS), chunk + 1
        finally:
            if self.session is None:
                self.client.end_session(route)

    async def _chunk(
        self, index: int, chunk: int, so_far: cmp.Sampled, tokens: int, route: str
    ) -> Response:
        """The next ``tokens`` tokens of choice ``index`` after ``so_far`` (a seed of their
        own, derived from the call's)."""
        seed = (self.params.seed * 1_000_003 + 7919 * index + chunk) % (1 << 31)
        params = dataclasses.replace(self.params, max_new_tokens=tokens, seed=seed)
        prompt = (*self.prompt, *so_far.token_ids)
        request = Request(self.client.new_id("endpoint-"), prompt, params, route)
        (response,) = await self.client.submit_many([request])
        return response


def _extended(so_far: cmp.Sampled, r: Response, keep: int | None) -> cmp.Sampled:
    """``so_far`` with the chunk ``r``'s tokens (the first ``keep`` of them all, when a stop
    string cut the choice); top log-probs only while every chunk has them."""
    ids = so_far.token_ids + list(r.token_ids)
    lps = so_far.log_probs + list(r.log_probs)
    versions = so_far.versions + r.versions()
    tops = len(so_far.top_ids) == len(so_far.token_ids) and len(r.top_ids) == len(r.token_ids)
    top_ids = so_far.top_ids + list(r.top_ids) if tops else []
    top_lps = so_far.top_log_probs + list(r.top_log_probs) if tops else []
    k = len(ids) if keep is None else keep
    return cmp.Sampled(
        ids[:k], lps[:k], versions[:k], so_far.stop_reason, "", top_ids[:k], top_lps[:k]
    )


def _piece(index: int, text: str, s: cmp.Sampled, start: int, done: cmp.Sampled | None) -> Piece:
    has_tops = len(s.top_ids) == len(s.token_ids)
    return Piece(
        index,
        text,
        s.token_ids[start:],
        s.log_probs[start:],
        s.top_ids[start:] if has_tops else [],
        s.top_log_probs[start:] if has_tops else [],
        done,
    )


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def stream_live(
    request: Any, live: LiveCompletion, model: str, record: Callable[[list[cmp.Sampled]], None],
    *, chat: bool,
) -> Any:  # fmt: skip
    """``live``'s chunks as server-sent events answering ``request`` (aiohttp's), its choices
    given to ``record`` before the closing ``[DONE]``; a client that leaves stops them,
    unrecorded."""
    from aiohttp import web

    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        await _write(response, live, model, chat=chat)
        record(live.sampled)
        await response.write(api.sse(None))
        await response.write_eof()
    except ConnectionResetError:  # the client left: nothing more is generated for it
        logger.debug("endpoint: %s %s: the client left mid-stream", request.method, request.path)
    finally:
        await live.close()
    return response


async def _write(response: Any, live: LiveCompletion, model: str, *, chat: bool) -> None:
    """``live``'s chunks, up to the usage chunk."""
    kind = ("chat.completion.chunk", "chatcmpl") if chat else ("text_completion", "cmpl")
    head = api.envelope(kind[0], api.new_id(kind[1]), model)
    if chat:
        for i in range(live.asked.n):
            role = api.chat_chunk(head, i, {"role": "assistant", "content": ""})
            await response.write(api.sse(role))
    offsets = [0] * live.asked.n
    async for piece in live.pieces():
        part = api.Part(
            piece.text,
            cmp.token_texts(live.tokenizer, piece.token_ids),
            piece.log_probs,
            cmp.alternatives(live.tokenizer, piece.top_ids, piece.top_log_probs),
        )
        finish = piece.done.stop_reason if piece.done is not None else None
        i = piece.choice
        events = api.piece_chunks(head, i, part, finish, live.asked, chat=chat, offset=offsets[i])
        for event in events:
            await response.write(api.sse(event))
        offsets[i] += len(piece.text)
    if live.asked.include_usage:
        counts = (len(live.prompt), sum(len(s.token_ids) for s in live.sampled))
        await response.write(api.sse(api.usage_chunk(head, counts)))
