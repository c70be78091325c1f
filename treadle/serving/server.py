"""A rollout server: one inference engine serving token-in, token-out requests.

A request is prompt token ids, sampling parameters, a request id and an optional session id;
its response is the sampled token ids, the log-prob of each, the stop reason and the version of
the weights that produced it. Requests arrive from many callers at once (the driver's fan-out,
agent loops); one thread owns the engine and runs it: it adds whatever has arrived, steps the
engine over everything in flight (vLLM batches it continuously) and answers each request as it
finishes. The server is what a rollout replica serves, in a Ray actor of its own
(:class:`~treadle.serving.replica.RolloutReplica`, split placement) or inside each actor rank's
process (colocated).

Choices:

- **The engine runs in the thread that made it, on an event loop.** :meth:`RolloutServer.generate`
  is a coroutine: the first request starts a pump task on the running loop, which adds what has
  arrived, runs one engine step (blocking the loop for that step), answers what finished and
  yields, until nothing is in flight. In a Ray actor that loop is the actor's own (an async
  actor: its ``__init__``, training methods and the pump share one thread); in the local
  backend it is the rollout client's, run by the driver's thread. Measured on the 2-core CPU:
  stepping vLLM's CPU engine from a second thread of the same process made every later phase
  of a GRPO step ~40% slower (update, log-probs and generation alike: 5.4-5.7 s a step against
  3.8-4.1 s on the tiny demo), so no thread of its own.
- **Requests that arrive together are added together**: a list submitted in one call enters the
  engine before its next step, so the driver's synchronous batch is batched exactly as before.
- **Sampling noise.** vLLM draws it from the global torch RNG on CPU; on CUDA treadle's vLLM
  engine gives each request a seed of its own, drawn from that RNG (see
  :mod:`treadle.engines.vllm`); the transformers engine draws from it too. When the engine goes
  from idle to busy the server saves the RNG's states and seeds it from the first request's
  ``params.seed`` and the replica's index (replicas must not draw the same noise); when it is
  idle again the states are put back. A batch submitted at once into an idle replica is
  therefore sampled reproducibly (resume stays bit-identical), and the host process's own
  random stream (the actor's, when colocated) does not move. Requests that overlap others are
  sampled correctly but not reproducibly, as in any serving engine.
- **Weights change between requests, or pause them.** :meth:`update_weights` refuses while a
  request is in flight (the synchronous trainer syncs between rollouts), loads, and sets the
  version. With ``interrupt=True`` (partial rollouts, ``async.partial_rollout``) it pauses what
  is in flight instead: each request is aborted in the engine with the tokens it has so far,
  the new weights load, and it goes on as a new engine request whose prompt is its prompt plus
  those tokens (their KV cache is recomputed with the new weights, as AReaL does) and whose
  budget is what is left. Every response reports the version of each of its tokens
  (``token_versions``) and the oldest of them (``weight_version``).
- **Busy time.** :attr:`RolloutServer.busy_seconds` counts the time the engine had work, so
  the driver can report how much of the run a replica idled.
- **Sleep.** Colocated on a GPU the engine sleeps whenever it is idle, so the actor trains with
  the memory; on CPU sleep is a no-op.
- **Scoring runs between two steps.** :meth:`RolloutServer.score` (a teacher's per-token
  log-probs and top-k of given sequences, :class:`ScoreRequest`) calls the engine's ``score``
  directly, in the loop's thread, while the pump (if any) waits at its ``await`` between two
  steps: the engine is never entered twice at once, and no step is needed to answer. The
  engine keeps generation in flight correct across it (vLLM's scores go through its own
  queue and keep the outputs they step past for the next ``step``, see
  :mod:`treadle.engines.vllm`). Requests of one call with the same ``top_k`` go to the engine
  in one call (micro-batched, or batched by vLLM). A score does not touch the sampling RNG.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from treadle.engines.inference import Finished, RolloutEngine, SamplingParams, Scored
from treadle.runtime.errors import raise_if_signalled
from treadle.tracking.profiler import phase

HostRng = list[torch.Tensor]  # torch's RNG states: the CPU's, then each CUDA device's


@dataclass(frozen=True)
class Request:
    """One sample to generate: token ids in (``params.n`` must be 1)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    session_id: str | None = None
    # a vision-language model's pictures [images, 3, H, W], their image tokens in prompt_ids
    pixel_values: torch.Tensor | None = None
    # a JSON schema (as text) the response must follow: structured output, for an engine that
    # does it (add_request takes json_schema: vLLM's guided decoding), refused by one that not
    json_schema: str | None = None


@dataclass(frozen=True)
class Response:
    """What a request produced, and by which weights and replica."""

    request_id: str
    token_ids: list[int]
    log_probs: list[float]
    stop_reason: str  # "stop" | "length"
    weight_version: int  # the oldest version of its tokens
    replica: str
    token_versions: tuple[int, ...] = ()  # per token; empty: every token is weight_version
    # per token the params.top_logprobs most likely ids and log-probs (empty: none given)
    top_ids: list[list[int]] = field(default_factory=list)
    top_log_probs: list[list[float]] = field(default_factory=list)

    def versions(self) -> list[int]:
        """The version of the weights that sampled each token."""
        return list(self.token_versions) or [self.weight_version] * len(self.token_ids)


@dataclass(frozen=True)
class ScoreRequest:
    """One sequence to score: log-probs of ``token_ids[start:]`` and the ``top_k`` most likely
    ids at each of those positions (``start >= 1``)."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    top_k: int


@dataclass(frozen=True)
class ScoreResponse:
    """What a score request computed (positions ``start..len-1``), by which replica."""

    request_id: str
    log_probs: list[float]
    topk_ids: list[list[int]]
    topk_log_probs: list[list[float]]
    replica: str
    weight_version: int


@dataclass
class _Progress:
    """What a request paused by a weight update had generated, and with which versions."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass
class _Group:
    """Requests submitted in one call, answered together."""

    requests: list[Request]
    future: asyncio.Future
    done: dict[str, Response] = field(default_factory=dict)


class RolloutServer:
    """Serves ``engine`` from the running event loop; ``name`` is in every response and error."""

    def __init__(
        self,
        engine: RolloutEngine,
        name: str,
        *,
        index: int = 0,
        sleep_when_idle: bool = False,
        version: int = 0,
    ) -> None:
        """``index``: the replica's number, mixed into its sampling seed (replicas given the
        same seed must not draw the same noise)."""
        self.engine, self.name, self.version, self.index = engine, name, version, index
        self.sleep_when_idle = sleep_when_idle
        self._arrived: list[_Group] = []
        self._groups: dict[str, _Group] = {}  # request id -> its group, while in flight
        self._requests: dict[str, Request] = {}  # request id -> the request, while in flight
        self._progress: dict[str, _Progress] = {}  # paused by a weight update, then resumed
        self._pump: asyncio.Task | None = None
        self._rng: HostRng | None = None  # the host's RNG states while busy
        self._busy = 0.0
        self._busy_since: float | None = None

    @property
    def busy_seconds(self) -> float:
        """Seconds this server has had requests in flight, in all."""
        now = time.perf_counter()
        return self._busy + (now - self._busy_since if self._busy_since is not None else 0.0)

    @property
    def in_flight(self) -> int:
        return len(self._groups) + sum(len(g.requests) for g in self._arrived)

    async def generate(self, requests: list[Request]) -> list[Response]:
        """The responses to ``requests``, in their order."""
        if not requests:
            return []
        group = _Group(list(requests), asyncio.get_running_loop().create_future())
        self._arrived.append(group)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run(), name=f"treadle {self.name}")
        responses: list[Response] = await group.future
        return responses

    async def score(self, requests: list[ScoreRequest]) -> list[ScoreResponse]:
        """The scores of ``requests``, in their order (see the module docstring)."""
        if not requests:
            return []
        idle = self._rng is None  # no generation in flight: the engine may be asleep
        if idle and self.sleep_when_idle:
            self.engine.wake()
        began = time.perf_counter()
        out: dict[int, Scored] = {}
        try:
            by_k: dict[int, list[int]] = {}
            for i, r in enumerate(requests):
                by_k.setdefault(r.top_k, []).append(i)
            for top_k, idx in by_k.items():
                sequences = [list(requests[i].token_ids) for i in idx]
                scored = self.engine.score(sequences, [requests[i].start for i in idx], top_k)
                out.update(zip(idx, scored, strict=True))
        finally:
            if idle:
                self._busy += time.perf_counter() - began
                if self.sleep_when_idle:
                    self.engine.sleep()
        return [
            ScoreResponse(
                r.request_id,
                out[i].log_probs,
                out[i].topk_ids,
                out[i].topk_log_probs,
                self.name,
                self.version,
            )
            for i, r in enumerate(requests)
        ]

    def update_weights(
        self,
        load: Callable[[RolloutEngine], None] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        interrupt: bool = False,
    ) -> None:
        """Load new weights (named tensors, or ``load(engine)``); later tokens carry
        ``version``. Only between requests, unless ``interrupt``: then the requests in the
        engine pause and go on with the new weights (see the module docstring)."""
        if self.in_flight and not interrupt:
            raise RuntimeError(
                f"{self.name}: a weight update with {self.in_flight} requests in flight; "
                "weights change between requests (or pass interrupt=True)"
            )
        paused = list(self._groups)
        for rid in paused:
            tokens, log_probs = self.engine.abort(rid)
            p = self._progress.setdefault(rid, _Progress())
            p.token_ids += tokens
            p.log_probs += log_probs
            p.versions += [self.version] * len(tokens)
        if callable(load):
            load(self.engine)
        else:
            self.engine.update_weights(load)
        self.version = version
        for rid in paused:
            self._resume(rid)

    def _resume(self, rid: str) -> None:
        """Send a paused request on with the tokens it has as part of its prompt."""
        r, p = self._requests[rid], self._progress[rid]
        left = r.params.max_new_tokens - len(p.token_ids)
        if left <= 0:  # its budget ran out exactly at the pause
            self._answer(Finished(rid, [], [], "length"))
            return
        params = dataclasses.replace(r.params, max_new_tokens=left)
        self.engine.add_request(rid, [*r.prompt_ids, *p.token_ids], params, r.pixel_values)

    # ------------------------------------------------------------------ the pump

    async def _run(self) -> None:
        try:
            while self._arrived or self._groups:
                while self._arrived:
                    self._add(self._arrived.pop(0))
                if self._groups:
                    with phase("engine_step"):  # blocks the loop for one step
                        done = self.engine.step()
                    for finished in done:
                        self._answer(finished)
                await asyncio.sleep(0)  # let new requests arrive
        except BaseException as e:  # answer everyone: nobody waits forever on a dead engine
            groups = {id(g): g for g in [*self._groups.values(), *self._arrived]}
            self._groups.clear()
            self._requests.clear()
            self._progress.clear()
            self._arrived.clear()
            for g in groups.values():
                if not g.future.done():
                    g.future.set_exception(RuntimeError(f"{self.name}: engine failed: {e}"))
            if not isinstance(e, Exception):
                raise
            # The stop, turned into another error where it landed (vLLM's tokenizer pool: an
            # UnboundLocalError), still unwinds the command (`treadle serve` served on). Only
            # the main thread takes a signal's exception; a client loop's own thread must not.
            if threading.current_thread() is threading.main_thread():
                raise_if_signalled()
        finally:
            self._become_idle()

    def _add(self, group: _Group) -> None:
        ids = [r.request_id for r in group.requests]
        taken = [i for k, i in enumerate(ids) if i in self._groups or i in ids[:k]]
        if taken:
            group.future.set_exception(
                ValueError(f"{self.name}: request id {taken[0]!r} is already in flight")
            )
            return
        if any(r.json_schema for r in group.requests) and not takes_json_schema(self.engine):
            group.future.set_exception(
                ValueError(f"{self.name}: its engine does not do structured output (json_schema)")
            )
            return
        if self._rng is None:  # idle -> busy: seed the sampling noise, keep the host's stream
            self._rng = _rng_state()
            torch.manual_seed(group.requests[0].params.seed * 9973 + self.index)
            if self.sleep_when_idle:
                self.engine.wake()
            self._busy_since = time.perf_counter()
        for r in group.requests:
            self._groups[r.request_id] = group
            self._requests[r.request_id] = r
            schema = {"json_schema": r.json_schema} if r.json_schema else {}
            self.engine.add_request(
                r.request_id, list(r.prompt_ids), r.params, r.pixel_values, **schema
            )

    def _answer(self, f: Finished) -> None:
        group = self._groups.pop(f.request_id)
        del self._requests[f.request_id]
        p = self._progress.pop(f.request_id, None)
        if p is None:
            response = Response(
                f.request_id,
                f.token_ids,
                f.log_probs,
                f.stop_reason,
                self.version,
                self.name,
                top_ids=f.top_ids,
                top_log_probs=f.top_log_probs,
            )
        else:  # (no top log-probs: a paused request's first part has none)
            versions = p.versions + [self.version] * len(f.token_ids)
            response = Response(
                f.request_id,
                p.token_ids + f.token_ids,
                p.log_probs + f.log_probs,
                f.stop_reason,
                min(versions, default=self.version),
                self.name,
                tuple(versions),
            )
        group.done[f.request_id] = response
        if len(group.done) == len(group.requests) and not group.future.done():
            group.future.set_result([group.done[r.request_id] for r in group.requests])

    def _become_idle(self) -> None:
        if self._busy_since is not None:
            self._busy += time.perf_counter() - self._busy_since
            self._busy_since = None
        if self._rng is not None:
            _set_rng_state(self._rng)
            self._rng = None
            if self.sleep_when_idle:
                self.engine.sleep()


def takes_json_schema(engine: RolloutEngine) -> bool:
    """Whether ``engine.add_request`` takes ``json_schema=`` (structured output: vLLM's)."""
    return "json_schema" in inspect.signature(engine.add_request).parameters


def _rng_state() -> HostRng:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return [torch.random.get_rng_state(), *cuda]


def _set_rng_state(state: HostRng) -> None:
    torch.random.set_rng_state(state[0])
    if len(state) > 1:
        torch.cuda.set_rng_state_all(state[1:])
