"""An OpenAI-compatible HTTP endpoint over the rollout client, recording every call by session.

Agents and environments written against the OpenAI API (``openai.AsyncOpenAI``, any HTTP
client) reach the model through it, during training or under ``treadle serve``:

=================================  ===========================================================
``GET  /v1/models``                the one model served (``rollout.endpoint.model_name``)
``POST /v1/chat/completions``      messages rendered with the model's chat template (``tools=``)
``POST /v1/completions``           a prompt as text (BOS added) or token ids
=================================  ===========================================================

Both completions stream (``stream: true``: server-sent events ``data: {...}`` then
``data: [DONE]``; ``stream_options.include_usage`` adds a usage chunk) as the tokens are
generated, in chunks of 1, 2, 4, ... up to 32 tokens (:mod:`treadle.serving.streaming`), the
call recorded whole; a chat answer whose tool calls or reasoning are parsed is generated whole,
then streamed. Every request carries
``Authorization: Bearer <api_key>`` (401 otherwise); a malformed body is a 400 whose message
names the field; errors have OpenAI's JSON shape. Any model name is accepted: there is one.

**Sessions and recording.** A call belongs to a session when its URL is the session's base URL
(``/sessions/<session>/v1``, :meth:`Endpoint.session_url`) or it carries the header
``X-Treadle-Session``. The session goes to the router as the request's ``session_id`` (so a
conversation stays on one replica, its prefix cache warm) and each of its calls is recorded as
a :class:`Call`: the exact prompt ids sent, and per choice the completion ids, log-probs and
weight versions the engine returned. :meth:`Endpoint.take_calls` hands them over in arrival
order. Calls without a session are served and not recorded; under ``treadle serve`` nothing is
recorded (nobody takes the calls: a server's memory must not grow with its sessions).

**Sampling.** In training a session is opened with the run's sampling
(:meth:`Endpoint.open_session`, or ``sampling=`` for every call): temperature, top_p, top_k and
seed come from it (the trainer's log-probs assume ``rollout.temperature``) and the request's
``max_tokens`` is capped at its ``max_new_tokens``; the request's own sampling is ignored.
Otherwise (``treadle serve``) the request's temperature, top_p, max_tokens (or
``max_completion_tokens``), seed and n are honoured. ``n`` choices are ``n`` requests. A call
without its own seed gets one derived from the sampling's seed and its number, so the same
question asked twice is sampled anew (and a run replays the same).

**Parsing.** ``tool_calls`` come from vLLM's tool parser ``rollout.tool_parser`` (hermes by
default; finish_reason ``tool_calls``), ``reasoning_content`` from its reasoning parser
``rollout.reasoning_parser`` when one is set (:mod:`treadle.serving.parsers`). Tools reach
the chat template as ``tools=`` (or, for a template without them, as Hermes instructions in
the system message, as treadle's own tools loop shows them). A ``tool_choice`` of
``required`` or a named function is enforced by structured output, as ``vllm serve`` does it:
the answer is generated under vLLM's guided decoding to the JSON of the calls (``required``: a
list of ``{"name", "parameters"}``, a named function: its arguments; vLLM's own schema), and
returned as ``tool_calls`` with empty content; the record keeps that JSON as sampled (the
recorded log-probs are the engine's, under the grammar). The transformers engine does no
guided decoding: there such a request is a 400 that says so. ``auto`` parses the model's text
for calls; ``none`` returns the text as content.

**Log-probs.** ``logprobs`` gives each token's log-prob as the engine sampled it;
``top_logprobs: k`` (chat, up to 20) or ``logprobs: k`` (completions, up to 5) the k most likely
tokens of each position, from the same distribution, where the engine gives them (the
transformers engine does; one that does not lists the sampled token alone).

**Limitations.** ``stop`` strings cut the completion after the token that completes one (that
token stays in the record, the text ends before the stop string). No images, audio, ``echo``,
``logit_bias``, penalties or ``response_format`` (structured output beyond a forced tool
choice): those fields are ignored.

The server is aiohttp's, run on the rollout client's own event loop (the loop that steps a
local engine): no thread of its own, and no signal handlers of its own (uvicorn's would take
Ctrl-C from treadle's, :mod:`treadle.runtime.errors`).
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import itertools
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from aiohttp import web

from treadle.config.endpoint import listen_error
from treadle.engines.inference import SamplingParams
from treadle.runtime.errors import ConfigError, signalled
from treadle.serving import completions as cmp
from treadle.serving import openai_api as api
from treadle.serving.client import RolloutClient
from treadle.serving.parsers import ChatParsers
from treadle.serving.server import Request, Response
from treadle.serving.streaming import SSE_HEADERS, LiveCompletion, stream_live

logger = logging.getLogger(__name__)
SESSION_HEADER = "X-Treadle-Session"


@dataclass(frozen=True)
class Call:
    """One model call as the engine sampled it (one per choice)."""

    session: str | None
    index: int  # arrival order over the endpoint's lifetime
    prompt_ids: list[int]  # exactly what was sent to the engine
    completion_ids: list[int]  # exactly what it sampled (cut after a stop string)
    log_probs: list[float]  # one per completion token
    token_versions: list[int]  # the weight version of each completion token
    stop_reason: str  # "stop" | "length"


class Recorder:
    """Calls by session, and the sampling each open session is held to."""

    def __init__(self, sampling: SamplingParams | None, keep: bool = True) -> None:
        self.sampling, self.keep = sampling, keep
        self.calls: dict[str, list[Call]] = {}
        self.forced: dict[str, SamplingParams] = {}
        self._count = itertools.count()
        self._draws = itertools.count()

    def params(self, session: str | None, asked: api.Asked, default_max: int) -> SamplingParams:
        """The sampling of one choice: the session's (or the endpoint's), else the request's."""
        held = self.forced.get(session, self.sampling) if session is not None else self.sampling
        top = asked.top_logprobs if asked.logprobs else 0  # (an output: not the sampling)
        if held is not None:
            cap = held.max_new_tokens
            return dataclasses.replace(
                held,
                n=1,
                max_new_tokens=min(asked.max_tokens or cap, cap),
                seed=self._seed(held.seed),
                top_logprobs=top,
            )
        return SamplingParams(
            n=1,
            temperature=1.0 if asked.temperature is None else asked.temperature,
            top_p=1.0 if asked.top_p is None else asked.top_p,
            max_new_tokens=asked.max_tokens or default_max,
            seed=self._seed(0) if asked.seed is None else asked.seed,
            top_logprobs=top,
        )

    def _seed(self, base: int) -> int:
        """A seed per call: the server seeds its noise from the request that finds it idle, so
        one seed for all would sample the same answer to the same prompt each time it is
        asked alone. Derived from ``base`` and the call's number: a run replays the same."""
        return (base * 1_000_003 + next(self._draws)) % (1 << 31)

    def record(
        self, session: str | None, prompt_ids: list[int], sampled: list[cmp.Sampled]
    ) -> None:
        if session is None or not self.keep:
            return
        calls = self.calls.setdefault(session, [])
        for s in sampled:
            calls.append(
                Call(
                    session,
                    next(self._count),
                    list(prompt_ids),
                    s.token_ids,
                    s.log_probs,
                    s.versions,
                    s.stop_reason,
                )
            )

    def take(self, session: str) -> list[Call]:
        return self.calls.pop(session, [])


class Endpoint:
    """The OpenAI-compatible server over ``client``; see the module docstring."""

    def __init__(
        self,
        client: RolloutClient,
        tokenizer: Any,
        *,
        model: str,
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 256,
        max_model_len: int | None = None,
        tool_parser: str = "hermes",
        reasoning_parser: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        record: bool = True,
        stop_grace_s: float = 5.0,
        structured_output: bool = False,
    ) -> None:
        """``sampling``: every call's sampling (training), None: the request's (serving);
        ``max_new_tokens``: a request's default budget then; ``max_model_len``: prompt plus
        completion at most (a longer prompt is a 400; the budget shrinks to fit); ``record``:
        keep sessions' calls for :meth:`take_calls` (``treadle serve``, where nobody takes
        them, does not: its memory stays flat however many sessions come); ``stop_grace_s``:
        how long :meth:`stop` waits for the requests in flight, then for them to end once cut
        (aiohttp's shutdown timeout: it must be positive, 0 is no limit there);
        ``structured_output``: the engine holds an answer to a JSON schema (vLLM), so a
        ``tool_choice`` that forces a call is enforced (else it is a 400)."""
        if stop_grace_s <= 0:
            raise ValueError(f"stop_grace_s must be positive, got {stop_grace_s}")
        self.client, self.tokenizer, self.model = client, tokenizer, model
        self.stop_grace_s, self.structured_output = stop_grace_s, structured_output
        self.recorder = Recorder(sampling, record)
        self.max_new_tokens, self.max_model_len = max_new_tokens, max_model_len
        self.parsers = ChatParsers(tokenizer, tool_parser, reasoning_parser)
        self.host, self.port = host, port
        self.api_key = api_key or f"treadle-{secrets.token_urlsafe(24)}"
        self._runner: web.AppRunner | None = None

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        client: RolloutClient,
        tokenizer: Any,
        *,
        force_sampling: bool = True,
        stop_grace_s: float = 5.0,
    ) -> Endpoint:
        """The endpoint ``rollout.endpoint`` describes; ``force_sampling``: every call samples
        as the run's rollout does (training), else as the request asks (``treadle serve``)."""
        r, e = cfg.rollout, cfg.rollout.endpoint
        sampling = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            seed=cfg.trainer.seed,
        )
        return cls(
            client,
            tokenizer,
            model=e.model_name or Path(str(cfg.model.path)).name or "model",
            sampling=sampling if force_sampling else None,
            max_new_tokens=r.max_new_tokens,
            max_model_len=cfg.data.max_prompt_length + cfg.response_length(),
            tool_parser=r.tool_parser,
            reasoning_parser=r.reasoning_parser,
            host=e.host,
            port=e.port,
            api_key=e.api_key,
            record=force_sampling,
            stop_grace_s=stop_grace_s,
            structured_output=r.engine == "vllm",
        )

    # ------------------------------------------------------------------ lifetime and sessions

    async def start(self) -> None:
        """Listen (on the running loop, the rollout client's); again: nothing."""
        if self._runner is not None:
            return
        app = web.Application(middlewares=[_guarded(self.api_key)], client_max_size=64 << 20)
        for prefix in ("", "/sessions/{session}"):
            app.router.add_get(f"{prefix}/v1/models", self._models)
            app.router.add_post(f"{prefix}/v1/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/v1/completions", self._completions)
        # stop() waits this long for requests in flight, then cuts them
        runner = web.AppRunner(
            app, handle_signals=False, access_log=None, shutdown_timeout=self.stop_grace_s
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:  # (the check tried it: taken since, or a run without the check)
            await runner.cleanup()
            raise ConfigError(listen_error(self.host, self.port, e)) from None
        self.port = int(runner.addresses[0][1])
        self._runner = runner

    def serve_always(self) -> None:
        """Listen from now on, between the driver's calls too: the client's loop goes to a
        thread of its own (``rollout.endpoint.enabled`` in the synchronous trainer, whose
        loop otherwise runs only while it generates)."""
        self.client.start_background(local=True)
        self.client.run(self.start())

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    @property
    def url(self) -> str:
        """The base URL (``http://HOST:PORT/v1``): calls without a session."""
        return f"http://{self.host}:{self.port}/v1"

    def session_url(self, session: str) -> str:
        """The base URL whose calls are recorded under ``session``."""
        return f"http://{self.host}:{self.port}/sessions/{quote(session, safe='')}/v1"

    def open_session(self, session: str, params: SamplingParams) -> str:
        """``session``'s base URL; its calls sample with ``params`` (``max_new_tokens``: the
        cap of a call's ``max_tokens``), whatever the request asks."""
        self.recorder.forced[session] = params
        return self.session_url(session)

    def close_session(self, session: str) -> list[Call]:
        """Forget ``session`` (its sampling, its routing); its calls not yet taken."""
        self.recorder.forced.pop(session, None)
        self.client.end_session(session)
        return self.recorder.take(session)

    def take_calls(self, session: str) -> list[Call]:
        """``session``'s calls since the last take, in arrival order (removed here)."""
        return self.recorder.take(session)

    # ------------------------------------------------------------------ HTTP

    async def _models(self, request: web.Request) -> web.StreamResponse:
        entry = {"id": self.model, "object": "model", "created": 0, "owned_by": "treadle"}
        return web.json_response({"object": "list", "data": [entry]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = api.parse_json(await request.read())
        messages, tools = api.read_messages(body), api.read_tools(body)
        asked = api.read_asked(body, chat=True)
        parsing = self.parsers.request(body)  # (a 400 before anything is sampled)
        schema = self.parsers.forced_schema(body, parsing, self.structured_output)
        prompt = cmp.chat_prompt_ids(self.tokenizer, messages, tools)
        if asked.stream and parsing is None:  # token by token (parsed answers: whole)
            return await self._stream_live(request, prompt, asked, chat=True)
        sampled = await self._sample(prompt, asked, _session(request), schema)
        choices = [self._chat_choice(s, body, asked, parsing, schema) for s in sampled]
        counts = (len(prompt), sum(len(s.token_ids) for s in sampled))
        rid = api.new_id("chatcmpl")
        if asked.stream:
            return await _stream(request, api.chat_chunks(rid, self.model, choices, asked, counts))
        return web.json_response(api.chat_response(rid, self.model, choices, asked, counts))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = api.parse_json(await request.read())
        if body.get("echo"):
            raise api.ApiError(400, "'echo' is not served", "echo")
        prompt = cmp.text_prompt_ids(self.tokenizer, api.read_prompt(body))
        asked = api.read_asked(body, chat=False)
        if asked.stream:
            return await self._stream_live(request, prompt, asked, chat=False)
        sampled = await self._sample(prompt, asked, _session(request))
        choices = [self._choice(s, asked) for s in sampled]
        counts = (len(prompt), sum(len(s.token_ids) for s in sampled))
        rid = api.new_id("cmpl")
        return web.json_response(api.text_response(rid, self.model, choices, asked, counts))

    # ------------------------------------------------------------------ generation

    async def _sample(
        self, prompt: list[int], asked: api.Asked, session: str | None, schema: str | None = None
    ) -> list[cmp.Sampled]:
        """``asked.n`` choices of ``prompt``, sent through the router, recorded under
        ``session``; ``schema``: the JSON schema they must follow (structured output)."""
        params = self._params(prompt, asked, session)
        requests = [
            Request(
                self.client.new_id("endpoint-"), tuple(prompt), params, session, json_schema=schema
            )
            for _ in range(asked.n)
        ]
        responses: list[Response] = await self.client.submit_many(requests)
        sampled = [cmp.finish(self.tokenizer, r, asked.stop) for r in responses]
        self.recorder.record(session, prompt, sampled)
        return sampled

    def _params(self, prompt: list[int], asked: api.Asked, session: str | None) -> SamplingParams:
        """The sampling of one choice, its budget within ``max_model_len``."""
        params = self.recorder.params(session, asked, self.max_new_tokens)
        return within(params, len(prompt), self.max_model_len)

    async def _stream_live(
        self, request: web.Request, prompt: list[int], asked: api.Asked, *, chat: bool
    ) -> web.StreamResponse:
        """``asked.n`` choices streamed as they are generated (:mod:`.streaming`)."""
        session = _session(request)
        params = self._params(prompt, asked, session)
        live = LiveCompletion(self.client, self.tokenizer, prompt, params, asked, session)
        record = functools.partial(self.recorder.record, session, prompt)
        return await stream_live(request, live, self.model, record, chat=chat)

    def _choice(self, s: cmp.Sampled, asked: api.Asked, **parsed: Any) -> api.Choice:
        text = parsed.pop("text", s.text)
        return api.Choice(
            text=text,
            tokens=cmp.token_texts(self.tokenizer, s.token_ids),
            log_probs=s.log_probs,
            finish_reason=s.stop_reason,
            alternatives=cmp.alternatives(self.tokenizer, s.top_ids, s.top_log_probs),
            **parsed,
        )

    def _chat_choice(
        self,
        s: cmp.Sampled,
        body: dict[str, Any],
        asked: api.Asked,
        parsing: Any,
        schema: str | None = None,
    ) -> api.Choice:
        """``parsing``: the parsers' request (:meth:`ChatParsers.request`); None: plain text;
        ``schema``: a forced tool choice's (the text is the calls' JSON)."""
        if parsing is None:
            return self._choice(s, asked)
        reasoning, content, calls = self.parsers.parse(s.text, body, parsing, schema)
        choice = self._choice(s, asked, text=content or "", reasoning=reasoning)
        if not calls:
            return choice
        return dataclasses.replace(choice, tool_calls=tuple(calls), finish_reason="tool_calls")


def within(params: SamplingParams, prompt: int, max_model_len: int | None) -> SamplingParams:
    """``params`` with a budget that fits ``prompt`` tokens in ``max_model_len`` (a 400 when
    the prompt alone does not)."""
    if max_model_len is None:
        return params
    room = max_model_len - prompt
    if room < 1:
        raise api.ApiError(
            400,
            f"the prompt has {prompt} tokens; the model takes {max_model_len} tokens in all, "
            "prompt and completion",
            "messages",
        )
    return dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))


def _guarded(api_key: str) -> Any:
    """The middleware every request goes through: the bearer token checked, errors answered
    in OpenAI's shape (a 500 names the engine's or the router's failure)."""

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise api.ApiError(401, "invalid or missing API key (Authorization: Bearer ...)")
            response: web.StreamResponse = await handler(request)
            return response
        except api.ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            error = api.ApiError(e.status, f"{request.method} {request.path}: {e.reason}")
            return web.json_response(error.body(), status=e.status)
        except Exception as e:  # the engine or the router failed: the caller hears why
            if signalled():  # a stop signal stopped the engine: the process says so itself
                error = api.ApiError(503, "the server is stopping")
                return web.json_response(error.body(), status=503)
            logger.exception("endpoint: %s %s failed", request.method, request.path)
            error = api.ApiError(500, f"{type(e).__name__}: {e}")
            return web.json_response(error.body(), status=500)

    return errors


def _session(request: web.Request) -> str | None:
    return request.match_info.get("session") or request.headers.get(SESSION_HEADER) or None


async def _stream(request: web.Request, events: Any) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        for event in events:
            await response.write(api.sse(event))
        await response.write(api.sse(None))
        await response.write_eof()
    except ConnectionResetError:  # the client left (or the server is closing): nobody to tell
        logger.debug("endpoint: %s %s: the client left mid-stream", request.method, request.path)
    return response
