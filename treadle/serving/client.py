"""The rollout client: one entry point to every replica, request by request.

The driver (and, later, agent loops) never picks a replica. :class:`RolloutClient` routes each
:class:`~treadle.serving.server.Request`:

- to the replica holding its **session** (``session_id``), whose prefix cache already has the
  conversation so far; a new session goes where a new request would;
- otherwise to the replica with the **fewest outstanding requests** (ties: the lowest index, so a
  batch spreads evenly and the same batch is always routed the same way);
- never more than ``max_inflight`` requests are outstanding on one replica: the rest wait.

Requests routed together to one replica travel in one call (the driver's fan-out costs one Ray
call per replica, not per sample) and enter its engine together. A replica that dies or does not
answer within ``timeout_s`` stops everything with one :class:`RolloutError` naming it, unless
the client has a ``restart`` (split replicas, ``rollout.max_restarts``): then, at most
``max_restarts`` times, the replica is marked down (no request is routed to it), ``restart``
starts it again in the background, and the requests of every call it failed are routed again
over the replicas that are up (waiting for one when none is); a failed call returned no answer,
so none is answered twice. ``restart`` puts the new handle in place with :meth:`replace`, up
at once or, when it must first get the weights of the next sync, later (:meth:`mark_up`).

The client is asynchronous (``await client.submit(request)``) and owns an event loop that the
synchronous driver runs in its own thread (:meth:`RolloutClient.run`,
:meth:`RolloutClient.generate`); agent loops run on it too. In the asynchronous training modes
the loop runs in a thread of its own (:meth:`RolloutClient.start_background`), generating
while the driver trains; ``run`` then hands coroutines to it and waits. :meth:`pause` stops
new requests from being sent and waits until those in flight are answered (a weight sync that
does not interrupt requests); :meth:`resume` lets them go. Replicas are reached through
:class:`ReplicaHandle`: a Ray actor (:class:`RayReplica`) or a server in this process
(:class:`LocalReplica`, the local backend, whose engine then steps in the driver's thread,
the one that made it: see :mod:`treadle.serving.server`).

Scoring (:class:`~treadle.serving.server.ScoreRequest`, a teacher's log-probs of given
sequences) goes the same way: :meth:`RolloutClient.score_many` routes each request to the
replica with the fewest outstanding requests (no sessions), under the same bound and timeout.
A Ray replica is called through named methods: ``rollout_generate``/``rollout_score`` of a
replica actor or an actor rank, ``teacher_generate``/``teacher_score`` of a colocated
teacher.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from treadle.controller import death_cause, pid_note
from treadle.runtime.errors import TreadleError, signalled
from treadle.serving.server import Request, Response, RolloutServer, ScoreRequest, ScoreResponse

T = TypeVar("T")
MAX_SESSIONS = 100_000  # sessions whose replica the router remembers


class RolloutError(TreadleError):
    """A rollout replica died or did not answer; the message names it."""


Restart = Callable[[int, "RolloutError"], Awaitable[None]]


class ReplicaHandle(Protocol):
    name: str

    async def generate(self, requests: list[Request]) -> list[Response]: ...

    async def score(self, requests: list[ScoreRequest]) -> list[ScoreResponse]: ...


class LocalReplica:
    """A :class:`RolloutServer` in this process."""

    def __init__(self, server: RolloutServer) -> None:
        self.server, self.name = server, server.name

    async def generate(self, requests: list[Request]) -> list[Response]:
        return await self.server.generate(requests)

    async def score(self, requests: list[ScoreRequest]) -> list[ScoreResponse]:
        return await self.server.score(requests)


class RayReplica:
    """A Ray actor serving requests through its async methods ``generate`` and ``score``
    name (a replica's ``rollout_generate``, a colocated teacher's ``teacher_generate``)."""

    def __init__(
        self,
        actor: Any,
        name: str,
        generate: str = "rollout_generate",
        score: str = "rollout_score",
    ) -> None:
        self.actor, self.name = actor, name
        self.methods = {"generate": generate, "score": score}

    async def generate(self, requests: list[Request]) -> list[Response]:
        responses: list[Response] = await self._call("generate", requests, "a rollout")
        return responses

    async def score(self, requests: list[ScoreRequest]) -> list[ScoreResponse]:
        responses: list[ScoreResponse] = await self._call("score", requests, "scoring")
        return responses

    async def _call(self, what: str, requests: list[Any], during: str) -> Any:
        import ray

        try:
            return await getattr(self.actor, self.methods[what]).remote(requests)
        except ray.exceptions.RayActorError as e:
            dead = f"{self.name}{pid_note(e)} died during {during}"
            raise RolloutError(f"{dead} ({death_cause(e)})") from None


class Restarts:
    """Which replicas of ``client`` are being restarted, and how many restarts are left."""

    def __init__(self, client: RolloutClient, max_restarts: int) -> None:
        self.client = client
        self.restart: Restart | None = None  # see the module docstring
        self.max_restarts = self.left = max_restarts
        self.tasks: dict[int, asyncio.Future[None]] = {}

    def failed(self, index: int, replica: ReplicaHandle, error: RolloutError) -> None:
        """``replica`` (at ``index``) failed with ``error``: restart it unless that is under
        way or done already; raise ``error`` when no restart is left."""
        c = self.client
        if replica is not c.replicas[index] or index in self.tasks:
            return  # another of its calls saw it fail first
        if self.left <= 0:
            if self.max_restarts:
                error = RolloutError(
                    f"{error}; rollout.max_restarts={self.max_restarts} restarts used already"
                )
            c.failure = c.failure or error
            raise error
        self.left -= 1
        c.down.add(index)
        self.tasks[index] = asyncio.ensure_future(self._restart(index, error))

    async def now(self, index: int, error: RolloutError) -> None:
        """Restart replica ``index``, found dead outside a call, and wait until it is done."""
        self.failed(index, self.client.replicas[index], error)
        if index in self.tasks:
            await self.tasks[index]
        if self.client.failure is not None:
            raise self.client.failure

    async def _restart(self, index: int, error: RolloutError) -> None:
        assert self.restart is not None
        try:
            await self.restart(index, error)
        except Exception as e:  # a failed restart stops the run: every caller hears it
            failure = RolloutError(f"{error}; its restart failed: {e}")
            self.client.failure = self.client.failure or failure
        finally:
            del self.tasks[index]


def _remember(sessions: OrderedDict[str, int], session: str, index: int) -> None:
    """``session`` is on replica ``index``, the most recently used; the least recently used
    is forgotten beyond ``MAX_SESSIONS``."""
    sessions[session] = index
    sessions.move_to_end(session)
    if len(sessions) > MAX_SESSIONS:
        sessions.popitem(last=False)


async def _cancel_all() -> None:
    """Cancel every other task of the running loop and wait for them to end."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class RolloutClient:
    """Routes requests over ``replicas``; see the module docstring."""

    def __init__(
        self,
        replicas: Sequence[ReplicaHandle],
        *,
        max_inflight: int = 256,
        timeout_s: float = 600.0,
        max_restarts: int = 0,
    ) -> None:
        if not replicas:
            raise ValueError("a rollout client needs at least one replica")
        self.replicas = list(replicas)
        self.max_inflight, self.timeout_s = max_inflight, timeout_s
        self.outstanding = [0] * len(self.replicas)
        # session -> replica, bounded (a server's callers never end theirs): see _remember
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        # One admission at a time per replica, each taking all its permits: no two partial
        # admissions can wait on each other.
        self._admit = [(asyncio.Lock(), asyncio.Semaphore(max_inflight)) for _ in self.replicas]
        self._open = asyncio.Event()  # cleared while paused
        self._open.set()
        self._thread: threading.Thread | None = None
        self.failure: RolloutError | None = None  # the first replica failure, once there is one
        self.restarts = Restarts(self, max_restarts)
        self.down: set[int] = set()  # replicas being restarted: nothing is routed to them

    # ------------------------------------------------------------------ sync entry points

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the client's loop until it is done: in this thread, or in the
        loop's own thread after :meth:`start_background` (this one waits). In this thread,
        restarts it began are waited for too (they may use the actor, idle only meanwhile)."""
        if self._thread is not None:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        result = self._loop.run_until_complete(coro)
        if self.restarts.tasks:
            while self.restarts.tasks:
                self._loop.run_until_complete(asyncio.wait(list(self.restarts.tasks.values())))
            if self.failure is not None:  # a restart failed
                raise self.failure
        return result

    def start_background(self, local: bool = False) -> None:
        """Run the loop in a thread of its own from now on (only Ray replicas, unless
        ``local``: a local engine then steps there, not in the thread that made it, which made
        vLLM's CPU engine ~40% slower, measured)."""
        if not local and any(isinstance(r, LocalReplica) for r in self.replicas):
            raise RuntimeError("a local replica's engine steps in the driver's thread")
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="treadle rollout client", daemon=True
            )
            self._thread.start()

    @property
    def background(self) -> bool:
        """Whether the loop runs in a thread of its own (:meth:`start_background`)."""
        return self._thread is not None

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the background loop; its result comes through the future."""
        assert self._thread is not None, "start_background first"
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def pause(self) -> None:
        """Send no new requests; return once those in flight have been answered."""
        self._open.clear()
        while any(self.outstanding):
            await asyncio.sleep(0.005)

    async def resume(self) -> None:
        self._open.set()

    def generate(self, requests: list[Request]) -> list[Response]:
        """All ``requests``, routed and answered; responses in request order."""
        return self.run(self.submit_many(requests))

    def score(self, requests: list[ScoreRequest]) -> list[ScoreResponse]:
        """All score ``requests``, routed and answered; responses in request order."""
        return self.run(self.score_many(requests))

    def new_id(self, prefix: str = "r") -> str:
        return f"{prefix}{next(self._ids)}"

    def close(self) -> None:
        """Cancel what is still in flight and stop the loop."""
        if self._loop.is_closed():
            return
        while True:
            closing = _cancel_all()
            try:
                self.run(closing)
                break
            except KeyboardInterrupt:
                # A Ctrl-C that landed inside a task stays in it and is raised again when the
                # task awaiting it is cancelled here: the run is stopping already (noted).
                if not signalled():
                    raise
                self._loop.set_exception_handler(lambda loop, context: None)  # what they hold
                # this try's task, if the Ctrl-C came before it ran, would cancel the next one
                # (in this thread's loop: a background loop has run it meanwhile)
                for task in asyncio.all_tasks(self._loop) if self._thread is None else ():
                    if task.get_coro() is closing:
                        task.cancel()
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._thread = None
        self._loop.close()

    # ------------------------------------------------------------------ async API

    async def submit(self, request: Request) -> Response:
        """One request, routed."""
        (response,) = await self.submit_many([request])
        return response

    async def submit_many(self, requests: Sequence[Request]) -> list[Response]:
        """Route each request, send each replica its share in calls of at most max_inflight."""
        await self._ready()
        return await self._fan_out("generate", requests, [self.route(r) for r in requests])

    async def score_many(self, requests: Sequence[ScoreRequest]) -> list[ScoreResponse]:
        """Each score request to the least loaded replica, as :meth:`submit_many` does."""
        await self._ready()
        return await self._fan_out("score", requests, [self._least_loaded() for _ in requests])

    async def _fan_out(self, what: str, requests: Sequence[Any], routes: list[int]) -> list[Any]:
        """``requests`` sent to the replicas ``routes`` names (counted outstanding there)."""
        shares: dict[int, list[int]] = {}
        for i, index in enumerate(routes):
            shares.setdefault(index, []).append(i)
        m = self.max_inflight
        chunks = [(k, idx[s : s + m]) for k, idx in shares.items() for s in range(0, len(idx), m)]
        calls = [
            asyncio.ensure_future(self._call(k, what, [requests[i] for i in chunk]))
            for k, chunk in chunks
        ]
        try:
            results = await asyncio.gather(*calls)
        except BaseException as e:
            for call in calls:  # one replica failed: the others' answers are not wanted
                call.cancel()
            if isinstance(e, RolloutError):  # kept: a caller over HTTP hears only a 500
                self.failure = self.failure or e
            raise
        out: list[Any] = [None] * len(requests)
        for (_, chunk), responses in zip(chunks, results, strict=True):
            for i, response in zip(chunk, responses, strict=True):
                out[i] = response
        return out

    def route(self, request: Request) -> int:
        """The replica for ``request``; counts it as outstanding there."""
        session = request.session_id
        index = self.sessions.get(session) if session is not None else None
        if index is None or index in self.down:
            index = self._least_loaded(count=False)
        if session is not None:
            _remember(self.sessions, session, index)
        self.outstanding[index] += 1
        return index

    def _least_loaded(self, count: bool = True) -> int:
        """The replica with the fewest outstanding requests (ties: the lowest index);
        ``count``: one more is outstanding there."""
        up = [k for k in range(len(self.replicas)) if k not in self.down] or range(
            len(self.replicas)
        )
        index = min(up, key=lambda k: (self.outstanding[k], k))
        if count:
            self.outstanding[index] += 1
        return index

    def end_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    async def _call(self, index: int, what: str, requests: list[Any]) -> list[Any]:
        """``replica.generate`` or ``replica.score`` (``what``) of ``requests``; when the
        replica fails and may be restarted, the requests routed again (module docstring)."""
        replica = self.replicas[index]
        try:
            return await self._send(index, replica, what, requests)
        except RolloutError as e:
            if self.restarts.restart is None:
                raise
            self.restarts.failed(index, replica, e)
        await self._ready()
        if what == "generate":
            return await self._fan_out(what, requests, [self.route(r) for r in requests])
        return await self._fan_out(what, requests, [self._least_loaded() for _ in requests])

    async def _ready(self) -> None:
        """Return once requests may be sent (not paused) and a replica is up to take them
        (the caller routes them before it awaits anything)."""
        while True:
            await self._wait_up()
            if self._open.is_set():
                return
            await self._open.wait()

    async def _wait_up(self) -> None:
        """Return once a replica is up: at once, unless all are being restarted."""
        while True:
            if self.failure is not None and self.restarts.restart is not None:
                raise self.failure
            if len(self.down) < len(self.replicas):
                return
            await asyncio.sleep(0.02)

    def replace(self, index: int, handle: ReplicaHandle, up: bool) -> None:
        """``handle`` serves replica ``index`` from now on; ``up``: route requests to it."""
        self.replicas[index] = handle
        if up:
            self.down.discard(index)

    def mark_up(self, indices: set[int]) -> None:
        """Route requests to the replicas ``indices`` again (from any thread)."""
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self.down.difference_update, set(indices))
        else:
            self.down.difference_update(indices)

    async def _send(
        self, index: int, replica: ReplicaHandle, what: str, requests: list[Any]
    ) -> list[Any]:
        """``replica.generate`` or ``replica.score`` (``what``) of ``requests``."""
        lock, permits = self._admit[index]
        held = 0
        try:
            async with lock:
                for _ in requests:
                    await permits.acquire()
                    held += 1
            call = replica.generate(requests) if what == "generate" else replica.score(requests)
            return await asyncio.wait_for(call, self.timeout_s)
        except TimeoutError:
            raise RolloutError(
                f"{replica.name} did not answer {len(requests)} request(s) within "
                f"rollout.request_timeout_s={self.timeout_s:g} s"
            ) from None
        finally:
            for _ in range(held):
                permits.release()
            self.outstanding[index] -= len(requests)


@contextlib.contextmanager
def held(client: RolloutClient) -> Iterator[None]:
    """Nothing in flight inside (a weight update) while ``client``'s loop runs in its own
    thread (its ``pause``, then ``resume``: the synchronous trainer's too, when its endpoint
    is served between steps, ``rollout.endpoint.enabled``); in the caller's nothing can be."""
    if not client.background:
        yield
        return
    client.run(client.pause())
    try:
        yield
    finally:
        client.run(client.resume())
