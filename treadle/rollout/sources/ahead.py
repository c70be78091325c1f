"""Generating ahead (``trainer.mode`` one_step_off and async): :class:`AsyncSource`.

In a synchronous step the trainer waits for the rollout and the rollout for the trainer. Here
a producer runs on the rollout client's loop, in a thread of its own, that keeps drawing
prompts and generating, and a bounded buffer of finished groups sits between it and the
trainer, which takes a batch as soon as one is there.

- **The unit of generation** is a step-batch: the ``data.batch_size`` prompts the sampler gives
  for step ``s``, sampled with step ``s``'s seed and sent together, exactly as a synchronous
  step sends them. Its groups enter the buffer when they finish; the trainer takes them oldest
  first (the oldest finished ones, with ``admission: drop``).
- **Staleness** and when a step-batch may start: :mod:`.admission`.
- **Weight sync** after every ``async.sync_every`` updates. Without partial rollouts the client
  stops sending, the requests in flight finish, the weights load, sending resumes; with
  ``async.partial_rollout`` the replicas pause what is in flight, load, and go on (each token
  keeps its version, :mod:`treadle.serving.server`).
- **Evaluation** runs on the replicas beside training, on the weights of a named version:
  when it is due after step ``s``'s update, the replicas get version ``s`` (a sync, if they are
  behind) and the evaluation's requests go out with the producer's, while the trainer goes on
  with step ``s + 1``. The next sync waits until they are answered (``async/eval_wait``, its
  seconds), so every evaluated token is version ``s`` (``eval/weight_version``); their metrics
  are collected when done and logged with step ``s``'s record, which waits for them
  (:meth:`late_metrics`; the driver's log keeps steps in order).
- **Dynamic sampling** drops groups of equal rewards as they are taken and takes more; a
  trainer that waits with nothing in flight may start the next step-batch whatever the room
  and the bound (``bounded``: it is within the bound anyway), so it never waits forever.
- **Resume.** A checkpoint keeps the sampler's position at the oldest step-batch not wholly
  trained and which of its groups (and later ones') were trained; a resumed run draws those
  step-batches again and generates the groups not yet trained. Whatever was in flight or in the
  buffer is generated again, with the resumed weights: an async run resumes where it was, but
  not bit for bit.

Metrics (``async/``): staleness mean and max of the batch, the version lag of the replicas
behind the learner, samples dropped as stale (this step and in all), buffer occupancy, and the
idle fractions of the trainer (waiting for a batch) and of the replicas (no request in flight).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treadle.config import Config
from treadle.data import PromptDataset, PromptSampler, pad_prompts, prompt_batch
from treadle.protocol import Batch
from treadle.rollout.fleet import Rollout
from treadle.rollout.sources.admission import Admission, Group
from treadle.rollout.sources.group_filter import GroupFilter
from treadle.rollout.sources.source import EvalRequests, EvalScores, Score, sampling_params


@dataclass(eq=False)
class _Eval:
    step: int  # the step that asked for it (its record gets the metrics)
    generated: concurrent.futures.Future[Any]  # its requests, answered
    scores: EvalScores


class AsyncSource:
    """The producer, the buffer and the sync policy of the modes that generate ahead
    (one_step_off, async); see the module docstring."""

    def __init__(
        self,
        cfg: Config,
        rollout: Rollout,
        dataset: PromptDataset,
        sampler: PromptSampler,
        score: Score,
        start: int,
    ) -> None:
        """``start``: the step the run starts after (the replicas' and learner's version)."""
        a, self.cfg = cfg.async_, cfg
        if cfg.trainer.mode == "one_step_off":
            self.max_staleness, self.sync_every, self.partial = 1, 1, False
        else:
            self.max_staleness, self.sync_every = a.max_staleness, a.sync_every
            self.partial = a.partial_rollout
        self.batch_size = cfg.data.batch_size
        bounded = a.admission == "bounded"
        self.admission = Admission(bounded, self.max_staleness, self.batch_size)
        self.capacity = a.buffer_groups or (self.max_staleness + 1) * self.batch_size
        self.rollout, self.client = rollout, rollout.client
        self.dataset, self.sampler, self.score = dataset, sampler, score
        self.version = self.learner = start  # the replicas' weights; the actor's
        self.next_step = start + 1
        self.at = (start + 1, 0)  # the step the trainer takes groups for; groups it took so far
        self.consumed: set[tuple[int, int]] = set()  # (step-batch, group) trained
        self.drawn: dict[int, dict[str, int]] = {}  # open step-batch -> sampler state before it
        self.open: dict[int, int] = {}  # step-batch -> its groups not yet taken
        self.buffer: list[Group] = []
        self.in_flight = 0  # groups
        self.flying: set[int] = set()  # step-batches generating
        self.waiting = 0  # groups the trainer waits for (0: not waiting)
        self.error: BaseException | None = None
        self.dropped_total = 0
        self.waited = 0.0  # seconds the last sample waited for the buffer
        self._producer: Any = None
        self.evals: list[_Eval] = []  # sent, not yet collected
        self._busy: list[float | None] | None = None
        self._clock = time.perf_counter()

    # ------------------------------------------------------------------ producer (client loop)

    def start(self) -> None:
        if self._producer is None:
            self.client.start_background()
            self._busy = self.rollout.busy_seconds()
            self._clock = time.perf_counter()
            self._producer = self.client.spawn(self._produce())

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await asyncio.sleep(0.005)

    def _may_start(self, step: int) -> bool:
        count = self.batch_size - sum(1 for c in self.consumed if c[0] == step)
        ahead = len(self.buffer) + self.in_flight
        fresh = self.admission.fresh(step, count, self.version, ahead, self.at, self.waiting)
        room = ahead + self.batch_size <= self.capacity
        starving = self.waiting > len(self.buffer) and self.in_flight == 0
        return (fresh and room) or starving

    async def _produce(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                step = self.next_step
                await self._until(functools.partial(self._may_start, step))
                before = self.sampler.state_dict()
                prompts = prompt_batch(
                    self.dataset, self.sampler.next_indices(), self.dataset.pad_id
                )
                self.next_step += 1
                keep = [i for i in range(len(prompts)) if (step, i) not in self.consumed]
                if not keep:
                    continue
                self.drawn[step], self.open[step] = before, len(keep)
                self.in_flight += len(keep)
                self.flying.add(step)
                task = asyncio.ensure_future(self._generate(step, prompts, keep))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            raise
        except BaseException as e:
            self.error = e

    async def _generate(self, step: int, prompts: Batch, keep: list[int]) -> None:
        try:
            part = prompts if len(keep) == len(prompts) else prompts.select(keep)
            batch = await self.rollout.agenerate(part, sampling_params(self.cfg, step))
            uids = list(batch["uid"])
            for j, i in enumerate(keep):
                rows = [k for k, uid in enumerate(uids) if uid == part["uid"][j]]
                # a prompt whose every run failed is an empty group (taken, then skipped)
                self.buffer.append(Group(step, i, batch.select(rows)))
            self.buffer.sort(key=lambda g: (g.step, g.index))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.error = e
        finally:
            self.in_flight -= len(keep)
            self.flying.discard(step)

    async def _take(self, count: int) -> list[Group]:
        self.waiting = count
        try:
            ready = self.admission.ready
            await self._until(lambda: ready(self.buffer, count, self.flying) or bool(self.error))
        finally:
            self.waiting = 0
        if self.error is not None:
            raise self.error
        taken, self.buffer = self.buffer[:count], self.buffer[count:]
        self.at = (self.at[0], self.at[1] + len(taken))
        for g in taken:
            self.consumed.add((g.step, g.index))
            self.open[g.step] -= 1
            if not self.open[g.step]:  # the step-batch is wholly taken: forget it
                del self.open[g.step], self.drawn[g.step]
                self.consumed = {c for c in self.consumed if c[0] != g.step}
        return taken

    async def _state(self) -> dict[str, Any]:
        first = min(self.open, default=self.next_step)
        sampler = self.drawn[first] if self.open else self.sampler.state_dict()
        return self._position(sampler, first)

    def _position(self, sampler: dict[str, Any], first: int) -> dict[str, Any]:
        consumed = [list(c) for c in sorted(self.consumed) if c[0] >= first]
        return {"sampler": sampler, "async": {"next_step": first, "consumed": consumed}}

    # ------------------------------------------------------------------ the trainer's side

    def state(self) -> dict[str, Any]:
        """Where a resumed run starts generating: ``sampler`` (the sampler's state before the
        oldest step-batch not wholly trained) and ``async``: ``next_step`` (that step-batch)
        and ``consumed`` (its groups, and later ones', already trained)."""
        if self._producer is None:
            return self._position(self.sampler.state_dict(), self.next_step)
        return self.client.run(self._state())

    def load_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        ahead = state.get("async")  # none: a checkpoint of a synchronous run
        if ahead:
            self.next_step = int(ahead["next_step"])
            self.consumed = {(int(s), int(i)) for s, i in ahead["consumed"]}

    def sample(self, step: int, m: dict[str, float]) -> Batch:
        """The next ``data.batch_size`` groups, scored: stale ones dropped, and with
        ``algorithm.filter_groups`` groups of equal rewards too."""
        self.start()
        self.at = (step, 0)
        groups = GroupFilter(self.cfg)
        stale = 0
        self.waited = 0.0
        while not groups.done():
            started = time.perf_counter()
            taken = self.client.run(self._take(groups.missing()))
            self.waited += time.perf_counter() - started
            made = [g for g in taken if len(g.batch)]  # (a group whose every run failed: empty)
            fresh = [g.batch for g in made if self.learner - _oldest(g) <= self.max_staleness]
            stale += sum(len(g.batch) for g in made) - sum(map(len, fresh))
            batch = pad_prompts(fresh) if fresh else None
            if batch is not None:  # (the async modes do not log reward/rule_mean)
                batch["token_level_scores"] = self.score(batch, None)
            groups.add(batch, stale=len(made) - len(fresh), failed=len(taken) - len(made))
        self.at = (step + 1, 0)  # (one assignment: the producer reads it from its thread)
        batch = groups.batch(m)
        lag = self.learner - batch["weight_version"]
        self.dropped_total += stale
        m.update(
            {
                "async/staleness_mean": float(lag.float().mean()),
                "async/staleness_max": float(lag.max()),
                "async/version_lag": float(self.learner - self.version),
                "async/dropped": float(stale),
                "async/dropped_total": float(self.dropped_total),
                "async/buffer_groups": float(len(self.buffer)),
                "timing/wait_rollout": self.waited,
                **self.rollout.take_counters(),
            }
        )
        return batch

    def after_update(self, step: int) -> dict[str, float]:
        """The actor's weights are now version ``step``: sync them if one is due."""
        self.learner = step
        if step % self.sync_every:
            return {}
        return self.sync()

    def sync(self) -> dict[str, float]:
        """Push the learner's weights to the replicas now (see the module docstring), once
        the evaluations of the weights they hold have been answered."""
        if self.version == self.learner:
            return {}
        waited = _answered(self.evals)
        if self._producer is None:  # nothing generates yet
            out = self.rollout.sync_weights(self.learner)
        elif self.partial:
            out = self.rollout.sync_weights(self.learner, interrupt=True)
        else:
            self.client.run(self.client.pause())
            try:
                out = self.rollout.sync_weights(self.learner)
            finally:
                self.client.run(self.client.resume())
        self.version = self.learner
        return {**out, "async/eval_wait": waited} if waited is not None else out

    def evaluate(self, step: int, requests: EvalRequests, scores: EvalScores) -> dict[str, float]:
        """Send the evaluation of the learner's weights beside training: the replicas get them
        now (a sync, if they are behind: its metrics are returned), its requests go out with
        the producer's, and the next sync waits until they are answered, so that every
        evaluated token comes from the learner's version. Its metrics come from
        :meth:`late_metrics`, for step ``step``."""
        self.start()
        synced = self.sync()
        self.evals.append(_Eval(step, self.client.spawn(requests()), scores))
        return synced

    def late_metrics(self, wait: bool) -> dict[int, dict[str, float]]:
        done: list[_Eval] = []
        for e in list(self.evals):
            if wait or e.generated.done():  # (checked once: it may finish meanwhile)
                done.append(e)
                self.evals.remove(e)
        return {e.step: e.scores(e.generated.result()) for e in done}

    def evaluating(self) -> set[int]:
        return {e.step for e in self.evals}

    def metrics(self, step_seconds: float) -> dict[str, float]:
        """The idle fractions of the trainer and of the replicas since the last call."""
        out = {"async/trainer_idle_frac": self.waited / max(step_seconds, 1e-9)}
        if self._busy is not None:
            now, busy = time.perf_counter(), self.rollout.busy_seconds()
            idle = _idle_fraction(self._busy, busy, max(now - self._clock, 1e-9))
            if idle is not None:
                out["async/rollout_idle_frac"] = idle
            self._busy, self._clock = busy, now
        return out


def _idle_fraction(
    before: list[float | None], after: list[float | None], wall: float
) -> float | None:
    """The replicas' mean idle fraction over ``wall`` seconds from their busy seconds
    ``before`` and ``after``; a replica that died, or started afresh (its count from 0), in
    between is left out (None: none is left)."""
    idle = [
        1 - (b - b0) / wall
        for b0, b in zip(before, after, strict=True)
        if b is not None and b0 is not None and b >= b0
    ]
    return min(max(sum(idle) / len(idle), 0.0), 1.0) if idle else None


def _answered(evals: list[_Eval]) -> float | None:
    """Wait until every evaluation's requests are answered; the seconds it took (None: none
    was in flight)."""
    pending = [e.generated for e in evals if not e.generated.done()]
    if not pending:
        return None
    started = time.perf_counter()
    concurrent.futures.wait(pending)
    return time.perf_counter() - started


def _oldest(group: Group) -> int:
    """The oldest weight version of a group's tokens."""
    return int(group.batch["weight_version"].min())
