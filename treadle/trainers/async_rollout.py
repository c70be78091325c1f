"""Rollout that runs ahead of training: ``trainer.mode`` one_step_off and async.

In a synchronous step the trainer waits for the rollout and the rollout for the trainer. Here
the split replicas generate while the actor trains: :class:`AsyncRollout` runs a producer on the
rollout client's loop, in a thread of its own, that keeps drawing prompts and generating, and a
bounded buffer of finished groups between it and the trainer, which takes a batch as soon as
one is there.

- **The unit of generation** is a step-batch: the ``data.batch_size`` prompts the sampler gives
  for step ``s``, sampled with step ``s``'s seed and sent together, exactly as a synchronous
  step sends them. Its groups enter the buffer when they finish; the trainer takes the oldest
  first.
- **Staleness.** A sample's version is the oldest weight version of its tokens; its staleness
  is the learner's version (the step of the actor's last update) minus that. Step-batch ``s``
  starts only once the replicas hold version ``s - 1 - max_staleness`` or newer and the
  buffer, with what is in flight, has room (``async.buffer_groups``, default
  ``(max_staleness + 1) x data.batch_size``); a sample that is still older than the bound when
  the trainer takes it (it waited behind others) is dropped and counted. ``max_staleness: 0``
  is synchronous training, sample for sample; ``one_step_off`` is ``max_staleness: 1`` with a
  sync after every update and no partial rollouts: step t+1's samples are generated with the
  weights before step t's update while step t trains.
- **Weight sync** after every ``async.sync_every`` updates. Without partial rollouts the client
  stops sending, the requests in flight finish, the weights load, sending resumes; with
  ``async.partial_rollout`` the replicas pause what is in flight, load, and go on (each token
  keeps its version, :mod:`treadle.rollout.server`).
- **Dynamic sampling** (``algorithm.filter_groups``) drops groups of equal rewards as they are
  taken and takes more; a trainer that waits with nothing in flight may start the next
  step-batch whatever the bound, so it never waits forever.
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
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from treadle.algorithms.shaping import varied_groups
from treadle.config import Config
from treadle.data import PromptDataset, ResumableSampler
from treadle.engines.rollout import SamplingParams
from treadle.protocol import Batch
from treadle.trainers.prompts import left_pad, prompt_batch
from treadle.trainers.rollout import Rollout


@dataclass
class _Group:
    step: int  # the step-batch it was drawn for (and sampled with the seed of)
    index: int  # its prompt's place in that step-batch
    batch: Batch  # its rollout.n samples


def pad_prompts(batches: list[Batch]) -> Batch:
    """``batches`` concatenated, prompts left-padded to the widest."""
    width = max(b["prompts"].shape[1] for b in batches)
    return Batch.concat([left_pad(b, width) for b in batches])


class AsyncRollout:
    """The producer, the buffer and the sync policy of the asynchronous modes."""

    def __init__(
        self,
        cfg: Config,
        rollout: Rollout,
        dataset: PromptDataset,
        sampler: ResumableSampler,
        sampling: Callable[[int], SamplingParams],
        start: int,
        state: dict[str, Any] | None = None,
    ) -> None:
        """``start``: the step the run resumes after (the replicas' and learner's version);
        ``state``: :meth:`state` of the checkpoint it resumes from."""
        a, self.cfg = cfg.async_, cfg
        if cfg.trainer.mode == "one_step_off":
            self.max_staleness, self.sync_every, self.partial = 1, 1, False
        else:
            self.max_staleness, self.sync_every = a.max_staleness, a.sync_every
            self.partial = a.partial_rollout
        self.batch_size, self.n = cfg.data.batch_size, cfg.rollout.n
        self.capacity = a.buffer_groups or (self.max_staleness + 1) * self.batch_size
        self.rollout, self.client = rollout, rollout.client
        self.dataset, self.sampler, self.sampling = dataset, sampler, sampling
        self.version = self.learner = start  # the replicas' weights; the actor's
        self.next_step = int(state["next_step"]) if state else start + 1
        self.consumed: set[tuple[int, int]] = {
            (int(s), int(i)) for s, i in (state or {}).get("consumed", [])
        }
        self.drawn: dict[int, dict[str, int]] = {}  # open step-batch -> sampler state before it
        self.open: dict[int, int] = {}  # step-batch -> its groups not yet taken
        self.buffer: list[_Group] = []
        self.in_flight = 0  # groups
        self.waiting = 0  # groups the trainer waits for (0: not waiting)
        self.error: BaseException | None = None
        self.dropped_total = 0
        self._producer: Any = None
        self._busy: list[float] | None = None
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
        fresh = self.version >= step - 1 - self.max_staleness
        room = len(self.buffer) + self.in_flight + self.batch_size <= self.capacity
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
            batch = await self.rollout.agenerate(part, self.sampling(step))
            for j, i in enumerate(keep):
                rows = list(range(j * self.n, (j + 1) * self.n))
                self.buffer.append(_Group(step, i, batch.select(rows)))
            self.buffer.sort(key=lambda g: (g.step, g.index))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.error = e
        finally:
            self.in_flight -= len(keep)

    async def _take(self, count: int) -> list[_Group]:
        self.waiting = count
        try:
            await self._until(lambda: len(self.buffer) >= count or self.error is not None)
        finally:
            self.waiting = 0
        if self.error is not None:
            raise self.error
        taken, self.buffer = self.buffer[:count], self.buffer[count:]
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
        consumed = sorted(c for c in self.consumed if c[0] >= first)
        return {"sampler": sampler, "next_step": first, "consumed": [list(c) for c in consumed]}

    # ------------------------------------------------------------------ the trainer's side

    def state(self) -> dict[str, Any]:
        """Where a resumed run starts generating: ``sampler`` (the sampler's state before the
        oldest step-batch not wholly trained), ``next_step`` (that step-batch) and
        ``consumed`` (its groups, and later ones', already trained)."""
        if self._producer is None:
            first = self.next_step
            return {
                "sampler": self.sampler.state_dict(),
                "next_step": first,
                "consumed": [list(c) for c in sorted(self.consumed) if c[0] >= first],
            }
        return self.client.run(self._state())

    def sample(
        self, step: int, m: dict[str, float], score: Callable[[Batch], torch.Tensor]
    ) -> Batch:
        """The next ``data.batch_size`` groups, scored (``token_level_scores``): stale ones
        dropped, and with ``algorithm.filter_groups`` groups of equal rewards too."""
        self.start()
        alg = self.cfg.algorithm
        kept: list[Batch] = []
        uniform: list[Batch] = []
        stale = examined = 0
        wait = 0.0
        while len(kept) < self.batch_size:
            if alg.filter_groups and examined >= alg.max_gen_rounds * self.batch_size:
                break
            started = time.perf_counter()
            groups = self.client.run(self._take(self.batch_size - len(kept)))
            wait += time.perf_counter() - started
            examined += len(groups)
            fresh = []
            for g in groups:
                if self.learner - int(g.batch["weight_version"].min()) > self.max_staleness:
                    stale += len(g.batch)
                else:
                    fresh.append(g.batch)
            if not fresh:
                continue
            batch = pad_prompts(fresh)
            batch["token_level_scores"] = score(batch)
            if not alg.filter_groups:
                kept += [batch.slice(k * self.n, (k + 1) * self.n) for k in range(len(fresh))]
                continue
            varied = varied_groups(batch["token_level_scores"].sum(-1), list(batch["uid"]))
            for k in range(len(fresh)):
                group = batch.slice(k * self.n, (k + 1) * self.n)
                (kept if bool(varied[k * self.n]) else uniform).append(group)
        if alg.filter_groups:
            m["rollout/kept_group_frac"] = len(kept) / max(examined, 1)
        batch = pad_prompts((kept + uniform)[: self.batch_size])
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
                "timing/wait_rollout": wait,
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
        """Push the learner's weights to the replicas now (see the module docstring)."""
        if self.version == self.learner:
            return {}
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
        return out

    def idle_metrics(self, step_seconds: float, wait_seconds: float) -> dict[str, float]:
        """The idle fractions of the trainer and of the replicas since the last call."""
        out = {"async/trainer_idle_frac": wait_seconds / max(step_seconds, 1e-9)}
        if self._busy is not None:
            now, busy = time.perf_counter(), self.rollout.busy_seconds()
            wall = max(now - self._clock, 1e-9)
            idle = [1 - (b - b0) / wall for b, b0 in zip(busy, self._busy, strict=True)]
            out["async/rollout_idle_frac"] = min(max(sum(idle) / len(idle), 0.0), 1.0)
            self._busy, self._clock = busy, now
        return out
