"""A rollout server: one inference engine serving token-in, token-out requests.

A request is prompt token ids, sampling parameters, a request id and an optional session id;
its response is the sampled token ids, the log-prob of each, the stop reason and the version of
the weights that produced it. Requests arrive from many callers at once (the driver's fan-out,
agent loops); one thread owns the engine and runs it: it adds whatever has arrived, steps the
engine over everything in flight (vLLM batches it continuously) and answers each request as it
finishes. The server is what a rollout replica serves, in a Ray actor of its own
(:class:`~treadle.workers.rollout.RolloutReplica`, split placement) or inside each actor rank's
process (colocated).

Choices:

- **One engine thread.** The engine is not thread-safe and its steps are compute-bound, so a
  single thread adds, steps and answers (with the creating thread's torch thread count);
  callers get :class:`concurrent.futures.Future` objects (awaitable with
  ``asyncio.wrap_future``), so the Ray actor serving them can be asynchronous and take
  thousands of requests in flight.
- **Requests that arrive together are added together**: a list submitted in one call enters the
  engine before its next step, so the driver's synchronous batch is batched exactly as before.
- **Sampling noise.** vLLM draws it from the global torch RNG (per-request seeds crash vLLM 0.32
  on CPU, see :mod:`treadle.engines.vllm_rollout`). When the engine goes from idle to busy the
  server saves the RNG state and seeds it from the first request's ``params.seed`` and the
  replica's index (replicas must not draw the same noise); when it is idle again the state is
  put back. A batch submitted at once into an idle replica is therefore
  sampled reproducibly (resume stays bit-identical), and the host process's own random stream
  (the actor's, when colocated) does not move. Requests that overlap others are sampled
  correctly but not reproducibly, as in any serving engine.
- **Weights change between requests, not inside one.** :meth:`update_weights` waits until no
  request is in flight (new ones wait for it), loads, and sets the version; every response
  reports the version it was generated with. (Partial rollouts, issue 3/6, will relax this.)
- **Sleep.** Colocated on a GPU the engine sleeps whenever it is idle, so the actor trains with
  the memory; on CPU sleep is a no-op.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from treadle.engines.rollout import Finished, RolloutEngine, SamplingParams


@dataclass(frozen=True)
class Request:
    """One sample to generate: token ids in (``params.n`` must be 1)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    session_id: str | None = None


@dataclass(frozen=True)
class Response:
    """What a request produced, and by which weights and replica."""

    request_id: str
    token_ids: list[int]
    log_probs: list[float]
    stop_reason: str  # "stop" | "length"
    weight_version: int
    replica: str


@dataclass
class _Group:
    """Requests submitted in one call, answered together."""

    requests: list[Request]
    future: Future
    done: dict[str, Response] = dataclasses.field(default_factory=dict)


class RolloutServer:
    """Serves ``engine`` on a thread of its own; ``name`` appears in every response and error."""

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
        self._inbox: queue.Queue[_Group | None] = queue.Queue()
        self._groups: dict[str, _Group] = {}  # request id -> its group, while in flight
        self._lock = threading.Lock()  # held by the engine thread while the engine works
        self._idle = threading.Condition(self._lock)
        self._rng: list[torch.Tensor] | None = None  # the host's RNG states while busy
        self._error: BaseException | None = None
        self._threads = torch.get_num_threads()  # the creator's; OpenMP's count is per thread
        self._thread = threading.Thread(target=self._run, name=f"treadle {name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers

    def submit(self, requests: list[Request]) -> Future:
        """A future of the responses to ``requests``, in their order."""
        future: Future = Future()
        if self._error is not None:
            future.set_exception(RuntimeError(f"{self.name}: engine failed: {self._error}"))
        elif not requests:
            future.set_result([])
        else:
            self._inbox.put(_Group(list(requests), future))
        return future

    def generate(self, requests: list[Request]) -> list[Response]:
        """:meth:`submit` and wait."""
        responses: list[Response] = self.submit(requests).result()
        return responses

    def update_weights(
        self,
        load: Callable[[RolloutEngine], None] | Iterable[tuple[str, torch.Tensor]],
        version: int,
    ) -> None:
        """Once no request is in flight: load new weights (named tensors, or ``load(engine)``)
        and stamp later responses with ``version``."""
        with self._idle:
            self._idle.wait_for(lambda: not self._groups)
            if callable(load):
                load(self.engine)
            else:
                self.engine.update_weights(load)
            self.version = version

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        error: BaseException = RuntimeError(f"{self.name} was closed")
        # A new thread starts at OpenMP's default count; vLLM's CPU attention checks that the
        # thread running a step has the count its metadata was built for (torch's).
        torch.set_num_threads(self._threads)
        try:
            while self._serve_once():
                pass
        except BaseException as e:  # answer everyone: nobody waits forever on a dead engine
            error = self._error = e
        with self._lock:
            groups = {id(g): g for g in self._groups.values()}
            self._groups.clear()
            self._idle.notify_all()
        for g in groups.values():
            g.future.set_exception(RuntimeError(f"{self.name}: engine failed: {error}"))

    def _serve_once(self) -> bool:
        """Add what has arrived (waiting for it when idle), step the engine once; False: stop."""
        item = self._next_nowait() if self._groups else self._inbox.get()
        with self._lock:
            while item is not _NOTHING:
                if item is None:
                    return False
                self._add(item)
                item = self._next_nowait()
            if self._groups:
                self._step()
            if not self._groups:
                self._become_idle()
        return True

    def _next_nowait(self) -> Any:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return _NOTHING

    def _add(self, group: _Group) -> None:
        if not self._groups:  # idle -> busy: seed the sampling noise, keep the host's stream
            self._rng = _rng_state()
            torch.manual_seed(group.requests[0].params.seed * 9973 + self.index)
            if self.sleep_when_idle:
                self.engine.wake()
        ids = [r.request_id for r in group.requests]
        taken = [i for k, i in enumerate(ids) if i in self._groups or i in ids[:k]]
        if taken:
            group.future.set_exception(
                ValueError(f"{self.name}: request id {taken[0]!r} is already in flight")
            )
            return
        for r in group.requests:
            self._groups[r.request_id] = group
            self.engine.add_request(r.request_id, list(r.prompt_ids), r.params)

    def _step(self) -> None:
        for f in self.engine.step():
            self._answer(f)

    def _answer(self, f: Finished) -> None:
        group = self._groups.pop(f.request_id)
        group.done[f.request_id] = Response(
            f.request_id, f.token_ids, f.log_probs, f.stop_reason, self.version, self.name
        )
        if len(group.done) == len(group.requests):
            group.future.set_result([group.done[r.request_id] for r in group.requests])

    def _become_idle(self) -> None:
        if self._rng is not None:
            _set_rng_state(self._rng)
            self._rng = None
            if self.sleep_when_idle:
                self.engine.sleep()
        self._idle.notify_all()


_NOTHING: Any = object()


def _rng_state() -> list[torch.Tensor]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return [torch.random.get_rng_state(), *cuda]


def _set_rng_state(state: list[torch.Tensor]) -> None:
    torch.random.set_rng_state(state[0])
    if len(state) > 1:
        torch.cuda.set_rng_state_all(state[1:])
