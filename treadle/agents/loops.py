"""Agent loops: async functions that turn one sample into one trajectory over the rollout client.

::

    async def my_loop(client: AgentClient, sample: Sample, tools: Toolbox) -> Trajectory

``rollout.agent_loop`` picks one: ``single_turn`` (one response, the classic RL rollout),
``tools`` (multi-turn: the model calls ``rollout.tools`` in Hermes ``<tool_call>`` blocks and
reads their results until it answers, at most ``rollout.max_turns`` turns), or a custom loop by
path (``module:function`` or ``path/to/file.py:function``). A loop calls the model as often
as it likes with :meth:`AgentClient.generate` (token ids in, a
:class:`~treadle.serving.server.Response` out) and appends what it wants the model to read with
:meth:`AgentClient.encode_messages` and :meth:`Trajectory.add_tokens`.

:func:`run_agents` runs the loops of a batch concurrently (at most
``rollout.max_concurrent_trajectories``), each turn a request to the client. Requests issued
in the same event-loop tick go to the client together, so the single-turn loop sends the whole
batch as one fan-out, as the driver did before agent loops: same routing, same engine batches,
same numbers. A later turn's requests join the engine while others run (continuous batching).
The samples of one prompt share a session, so every turn of a group lands on one replica,
whose prefix cache holds the prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from treadle.agents.tools import (
    CallParser,
    Toolbox,
    ToolCall,
    numbered,
    parse_tool_calls,
    result_messages,
)
from treadle.agents.trajectory import Trajectory
from treadle.data.templating import (
    end_of_turn,
    render,
    shared_length,
    special_pattern,
    special_strings,
    supports_tools,
    template_end_of_turn,
)
from treadle.engines.inference import SamplingParams
from treadle.models.folders import template_key
from treadle.runtime.errors import TreadleError
from treadle.serving.client import RolloutClient, RolloutError
from treadle.serving.server import Request, Response


@dataclass(frozen=True)
class Sample:
    """One row of the prompt data: its rendered prompt tokens and every column of the file."""

    uid: str
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: str
    row: dict[str, Any]
    # a vision-language prompt's pictures [images, 3, H, W]; every turn's request carries them
    pixel_values: torch.Tensor | None = None


@dataclass(frozen=True)
class Limits:
    max_turns: int = 1
    max_response_length: int = 32  # tokens after the prompt, model and tool tokens together
    max_tool_response_tokens: int = 256


class AgentLoopError(TreadleError):
    """An agent loop raised, or returned something that is not a consistent trajectory."""


AgentLoop = Callable[["AgentClient", Sample, Toolbox], Awaitable["Trajectory | list[Trajectory]"]]
"""A loop returns its trajectory, or one per unbroken segment of a session (all one reward)."""

log = logging.getLogger(__name__)


class _Batcher:
    """Requests made in the same event-loop tick go to the client as one ``submit_many``."""

    def __init__(self, client: RolloutClient) -> None:
        self.client = client
        self.pending: list[tuple[Request, asyncio.Future[Response]]] = []
        self.running: set[asyncio.Future[list[Response]]] = set()

    def submit(self, request: Request) -> asyncio.Future[Response]:
        future = asyncio.get_running_loop().create_future()
        if not self.pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self.pending.append((request, future))
        return future

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        requests = [r for r, _ in batch]
        task = asyncio.ensure_future(self.client.submit_many(requests))
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        task.add_done_callback(lambda t: _deliver(t, [f for _, f in batch]))


def _deliver(task: asyncio.Future[list[Response]], futures: list[asyncio.Future[Response]]) -> None:
    for i, future in enumerate(futures):
        if future.done():
            continue
        if task.cancelled():
            future.cancel()
        elif task.exception() is not None:
            future.set_exception(task.exception())  # type: ignore[arg-type]
        else:
            future.set_result(task.result()[i])


class AgentClient:
    """What a loop sees of the model for one trajectory: generate, tokenizer, limits."""

    def __init__(
        self,
        batcher: _Batcher,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        limits: Limits,
        session_id: str,
        endpoint: Any = None,
        pixel_values: torch.Tensor | None = None,
        parse_calls: CallParser = parse_tool_calls,
    ) -> None:
        """``endpoint``: the run's OpenAI-compatible endpoint
        (:class:`~treadle.serving.endpoint.Endpoint`), for loops that run black-box agents.
        ``pixel_values``: the sample's pictures, sent with every request (their image tokens
        are at the start of the conversation). ``parse_calls``: the tool calls in a turn's
        text (``rollout.tool_parser``'s, :func:`~treadle.agents.tools.call_parser`)."""
        self._batcher, self.tokenizer = batcher, tokenizer
        self.params, self.limits, self.session_id = params, limits, session_id
        self.endpoint = endpoint
        self.pixel_values = pixel_values
        self.parse_calls = parse_calls

    def new_session(self) -> str:
        """A session id of its own (one trajectory's recorded calls on the endpoint)."""
        return self._batcher.client.new_id(f"{self.session_id}.")

    async def generate(
        self, token_ids: Sequence[int], max_new_tokens: int | None = None
    ) -> Response:
        """One turn: the model continues ``token_ids`` (the whole conversation so far)."""
        params = self.params
        if max_new_tokens is not None and max_new_tokens != params.max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=max_new_tokens)
        client = self._batcher.client
        request = Request(
            client.new_id(), tuple(token_ids), params, self.session_id, self.pixel_values
        )
        return await self._batcher.submit(request)

    def encode_messages(
        self,
        messages: list[dict[str, Any]],
        after: Sequence[int] = (),
        calls: Sequence[ToolCall] = (),
    ) -> list[int]:
        """Tokens of chat ``messages`` appended to a conversation, then the header of the
        model's next turn. ``after``: the model's last turn; if it ended with the template's
        end-of-turn token, the template's text that follows that token (ChatML's newline)
        comes first, and if it was cut by its length, that token does (where the template
        writes one). ``calls``: the tool calls of that turn, which the messages
        answer: a template with tool support reads them as an assistant message with
        ``tool_calls`` before the messages (gpt-oss's and Mistral's refuse a tool message
        without one; Gemma 4's writes the results into that turn); the turn's tokens stay the
        model's own."""
        tok = self.tokenizer
        if calls and supports_tools(tok):
            ids = _after_calls(tok, messages, after, calls)
            if ids is not None:
                return ids
        _check_shown(tok, messages)
        base = _base_conversation(tok, template_key(tok))
        full_ids = _encode(tok, render(tok, [*base.messages, *messages], generation=True))
        if full_ids[: len(base.ids)] != base.ids:  # the date a template writes moved on
            base = _base_conversation.__wrapped__(tok, template_key(tok))
        if full_ids[: len(base.ids)] != base.ids:
            raise AgentLoopError(
                "the chat template renders the start of a conversation differently once these "
                f"messages follow it (roles {[m.get('role') for m in messages]}), so they "
                "cannot be appended to the model's turn token for token"
            )
        if not after or (after[-1] != base.end_id and after[-1] in tok.all_special_ids):
            return full_ids[len(base.ids) :]  # (stopped at another of its stop tokens)
        writes_end = template_end_of_turn(tok) is not None
        closed = [base.end_id] if after[-1] != base.end_id and writes_end else []
        return closed + base.after_end + full_ids[len(base.ids) :]

    def remaining(self, trajectory: Trajectory) -> int:
        """Tokens of the trajectory's budget still free."""
        return self.limits.max_response_length - len(trajectory.token_ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))


@dataclass(frozen=True)
class _Base:
    """A short conversation that appended messages are cut from: its messages, the tokens
    every longer conversation starts with, the template's end-of-turn token and the tokens
    the template writes after it before the next turn."""

    messages: tuple[dict[str, str], ...]
    ids: list[int]
    end_id: int
    after_end: list[int]
    text: str  # the conversation's rendering (as the last one)


# Tried in turn (Gemma 2's template takes no system message and alternates user and model
# turns, so it takes the second).
_BASES = (
    ({"role": "system", "content": "x"}, {"role": "user", "content": "x"}),
    ({"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}),
)


@functools.lru_cache(maxsize=8)
def _base_conversation(tok: PreTrainedTokenizerBase, template: Any) -> _Base:
    """The first base conversation the template renders, and goes on from, up to its last
    end-of-turn token at least (rendered once per tokenizer and template). Its tokens are
    those it shares with a longer conversation: Phi-3's template ends a conversation that does
    not go on with its EOS."""
    end_id = end_of_turn(tok)[0]
    for messages in _BASES:
        try:
            text = render(tok, list(messages), generation=False)
            longer = [*messages, {"role": "user", "content": "y"}]
            longer_ids = _encode(tok, render(tok, longer, generation=True))
        except TemplateError:
            continue
        ids = _encode(tok, text)
        shared = shared_length(ids, longer_ids)
        if end_id in ids[:shared]:
            last = shared - 1 - ids[:shared][::-1].index(end_id)
            return _Base(messages, ids[:shared], end_id, ids[last + 1 : shared], text)
        if shared == len(ids):  # a template that writes no end-of-turn token
            return _Base(messages, ids, end_id, [], text)
    raise AgentLoopError(
        "the tokenizer's chat template renders no conversation that a longer one starts with "
        "(tried a system and a user message, then a user and an assistant message), so an "
        "agent loop cannot append tool results or observations to a turn"
    )


_MARK = "treadlemark"  # a message's content where the loops look for where it is written


def _marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**messages[0], "content": _MARK}, *messages[1:]]


def _check_shown(tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> None:
    """A template that renders the first message without its content (Gemma 4's writes a tool
    message only inside the assistant turn of its call) fails the trajectory, named."""
    if not messages:
        return
    base = _base_conversation(tok, template_key(tok))
    if _MARK not in render(tok, [*base.messages, *_marked(messages)], generation=True):
        raise AgentLoopError(
            f"the chat template renders a {messages[0].get('role')!r} message here without its "
            "content, so the model would never read it"
            + (
                " (pass the turn's tool calls: encode_messages(..., calls=))"
                if supports_tools(tok)
                else ""
            )
        )


def _after_calls(
    tok: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    after: Sequence[int],
    calls: Sequence[ToolCall],
) -> list[int] | None:
    """:meth:`AgentClient.encode_messages` after an assistant message holding ``calls``: the
    template's text from the token that ends that turn to the next turn's header. That token
    is the one the model stopped at or the template's end of turn, found after the turn's
    start; else (a turn cut by its length on gpt-oss's template, which closes a call with
    ``<|call|>``) the last special token the template writes for the turn, which then goes
    first. None where the template renders no such turn (the caller then appends the
    messages as after any turn)."""
    if not messages:
        return None
    base = _base_conversation(tok, template_key(tok))
    specials = set(tok.all_special_ids)
    stops = [after[-1]] if after and after[-1] in specials else []
    stops += [base.end_id] if base.end_id not in stops else []
    for turn in (_calls_turn(calls, as_json=False), _calls_turn(calls, as_json=True)):
        conversation = [*base.messages, turn]
        try:
            marked = render(tok, [*conversation, *_marked(messages)], generation=True)
            text = render(tok, [*conversation, *messages], generation=True)
            closing = render(tok, conversation, generation=False)
        except (TemplateError, TypeError):  # (DeepSeek V3's adds arguments to a string)
            continue
        at = marked.find(_MARK)
        if at < 0:
            raise AgentLoopError(
                f"the chat template renders a {messages[0].get('role')!r} message after a tool "
                "call without its content, so the model would never read it"
            )
        turn_start = shared_length(base.text, marked)
        ends = [(s, marked.rfind(_token(tok, s), turn_start, at)) for s in stops]
        ends = [(s, where + len(_token(tok, s))) for s, where in ends if where >= 0]
        ends += _specials_in(tok, closing, turn_start, shared_length(closing, marked))[-1:]
        for stop, cut in ends:
            if text[:cut] == marked[:cut]:
                ids = _encode(tok, text[cut:])
                # (not closed again where the model stopped at another of its stop tokens)
                ended = after and (after[-1] == stop or (after[-1] in specials and stop in stops))
                return ids if ended else [stop, *ids]
        return None
    return None


def _token(tok: PreTrainedTokenizerBase, token_id: int) -> str:
    return str(tok.convert_ids_to_tokens(token_id))


def _specials_in(
    tok: PreTrainedTokenizerBase, text: str, start: int, end: int
) -> list[tuple[int, int]]:
    """``(token id, where it ends)`` of the special tokens ``text[start:end]`` writes."""
    strings = special_strings(tok)
    if not strings:
        return []
    pattern = special_pattern(strings)
    found = [
        (tok.convert_tokens_to_ids(m.group()), m.end()) for m in pattern.finditer(text, start, end)
    ]
    return [(token_id, at) for token_id, at in found if isinstance(token_id, int)]


def _calls_turn(calls: Sequence[ToolCall], *, as_json: bool) -> dict[str, Any]:
    """The assistant message of a turn's calls, their arguments as an object (as templates
    write them) or a JSON string (DeepSeek V3's)."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "id": c.id,
                "function": {
                    "name": c.name or "",
                    "arguments": json.dumps(c.arguments) if as_json else c.arguments,
                },
            }
            for c in calls
        ],
    }


def _encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


# ----------------------------------------------------------------------------- built-in loops


async def single_turn(client: AgentClient, sample: Sample, tools: Toolbox) -> Trajectory:
    """One response to the prompt."""
    trajectory = Trajectory(list(sample.prompt_ids))
    trajectory.add_response(await client.generate(sample.prompt_ids))
    return trajectory


async def tool_loop(client: AgentClient, sample: Sample, tools: Toolbox) -> Trajectory:
    """Generate; run the turn's ``<tool_call>`` blocks; append their results; until the model
    answers without a call (``response_text`` is that answer), the budget runs out, or
    ``max_turns`` turns are used. A turn cut by its length ends the trajectory unless it holds
    complete calls (the text after them is kept: it was sampled)."""
    t = Trajectory(list(sample.prompt_ids))
    calls = errors = 0
    seconds = 0.0
    while True:
        budget = client.remaining(t)
        response = await client.generate(t.all_token_ids, min(client.params.max_new_tokens, budget))
        t.add_response(response)
        text = client.decode(response.token_ids)
        t.response_text = text
        requested = client.parse_calls(text)
        # A turn cut by its length still made the calls it closed (small models ramble on).
        if response.stop_reason == "length":
            requested = [c for c in requested if c.error is None]
        if not requested:
            break
        if t.turns >= client.limits.max_turns:
            t.stop_reason = "max_turns"
            break
        results = await asyncio.gather(*(tools.call(c) for c in requested))
        calls += len(results)
        errors += sum(r.error for r in results)
        seconds += sum(r.seconds for r in results)
        contents = [_cut(client, r.content) for r in results]
        requested = numbered(requested)
        messages = result_messages(client.tokenizer, contents, requested)
        ids = client.encode_messages(messages, after=response.token_ids, calls=requested)
        if len(ids) >= client.remaining(t):  # no room left for the model to read and answer
            t.stop_reason = "length"
            break
        t.add_tokens(ids)
    t.info.update(tool_calls=calls, tool_errors=errors, tool_seconds=seconds)
    return t


def _cut(client: AgentClient, content: str) -> str:
    """A tool result cut to ``max_tool_response_tokens`` tokens."""
    limit = client.limits.max_tool_response_tokens
    ids = _encode(client.tokenizer, content)
    if len(ids) <= limit:
        return content
    return client.decode(ids[:limit]) + " ...(cut)"


# ----------------------------------------------------------------------------- running a batch


@dataclass
class AgentRuns:
    """What :func:`run_agents` made of a batch: per run (sample-major, ``copies`` consecutive
    runs per sample) its trajectories (one, or one per unbroken segment of a black-box agent's
    session; none where the loop failed), and one line per failed run."""

    trajectories: list[list[Trajectory]]
    errors: list[str] = field(default_factory=list)

    def rows(self) -> list[tuple[int, Trajectory]]:
        """(run index, trajectory) for every trajectory, in order."""
        return [(i, t) for i, ts in enumerate(self.trajectories) for t in ts]

    @property
    def prefix_breaks(self) -> int:
        """Trajectories beyond the first of each run: a session whose prefix broke."""
        return sum(max(len(ts) - 1, 0) for ts in self.trajectories)

    def counters(self) -> dict[str, float]:
        return {"agent/errors": float(len(self.errors)), "agent/prefix_breaks": self.prefix_breaks}


@dataclass(frozen=True)
class Failures:
    """When a failed agent run is dropped and when it stops the run (``rollout.*``)."""

    timeout_s: float | None = None  # a loop running longer fails (None: no bound)
    max_frac: float = 0.0  # more failed runs than this fraction of a batch stop the run


async def run_agents(
    loop: AgentLoop,
    client: RolloutClient,
    samples: Sequence[Sample],
    copies: int,
    params: SamplingParams,
    *,
    tokenizer: PreTrainedTokenizerBase,
    tools: Toolbox,
    limits: Limits,
    max_concurrent: int,
    failures: Failures = Failures(),
    endpoint: Any = None,
    parse_calls: CallParser = parse_tool_calls,
) -> AgentRuns:
    """``copies`` runs of ``loop`` on every sample (consecutive), run concurrently.

    A run that raises, returns something that is not a trajectory or runs past
    ``failures.timeout_s`` is dropped with a warning naming the loop and the sample; when more
    than ``failures.max_frac`` of the batch's runs (or all of them) failed, the batch fails with
    one :class:`AgentLoopError`. A replica that fails stops the batch at once."""
    batcher = _Batcher(client)
    gate = asyncio.Semaphore(max_concurrent)
    single = dataclasses.replace(params, n=1)
    sessions = [client.new_id("s") for _ in samples]
    name = getattr(loop, "__qualname__", repr(loop))
    errors: list[str] = []
    agent_client = functools.partial(AgentClient, batcher, tokenizer, single, limits)

    async def one(sample: Sample, session: str) -> list[Trajectory]:
        async with gate:
            agent = agent_client(session, endpoint, sample.pixel_values, parse_calls)
            outcome = await _attempt(loop(agent, sample, tools), failures, client)
        if isinstance(outcome, list):
            return outcome
        errors.append(f"agent loop {name!r} failed on sample {sample.uid}: {outcome}")
        log.warning("%s; its sample is dropped", errors[-1])
        return []

    tasks = [
        asyncio.ensure_future(one(s, session))
        for s, session in zip(samples, sessions, strict=True)
        for _ in range(copies)
    ]
    try:
        runs = AgentRuns(list(await asyncio.gather(*tasks)), errors)
    except BaseException:
        for task in tasks:  # one replica failed: the others' trajectories are not wanted
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        for session in sessions:
            client.end_session(session)
    if errors and (len(errors) > failures.max_frac * len(tasks) or len(errors) == len(tasks)):
        raise AgentLoopError(
            f"{len(errors)} of {len(tasks)} agent runs failed in this batch, more than "
            f"rollout.max_agent_error_frac={failures.max_frac:g}; the first: {errors[0]}"
        )
    return runs


async def _attempt(
    running: Awaitable[Any], failures: Failures, client: RolloutClient
) -> list[Trajectory] | str:
    """A run's trajectories, or what went wrong with it (a replica's failure is raised)."""
    try:
        if failures.timeout_s is not None:
            running = asyncio.wait_for(running, failures.timeout_s)
        return _checked(await running)
    except (RolloutError, asyncio.CancelledError):
        raise
    except TimeoutError:
        return f"ran longer than rollout.agent_timeout_s={failures.timeout_s:g} s"
    except Exception as e:
        if client.failure is not None:  # a replica failed under the agent's call
            raise client.failure from e
        return f"{type(e).__name__}: {e}"


def _checked(result: Any) -> list[Trajectory]:
    """A loop's trajectory, or its non-empty list of them, each consistent."""
    out = result if isinstance(result, list) and result else [result]
    for t in out:
        if not isinstance(t, Trajectory):
            raise TypeError(f"it returned {type(t).__name__}, not a Trajectory")
        t.check()
    return out
