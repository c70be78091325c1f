"""Where the driver's batches come from: one :class:`RolloutSource`, whatever ``trainer.mode``.

The driver asks a source for a step's scored batch (:meth:`~RolloutSource.sample`), tells it
when the actor's weights changed (:meth:`~RolloutSource.after_update`), has it evaluate the
learner's weights (:meth:`~RolloutSource.evaluate`: now, or beside training with the metrics
later, :meth:`~RolloutSource.late_metrics`), and saves and restores its position with the
checkpoint (:meth:`~RolloutSource.state` / :meth:`~RolloutSource.load_state`). It never asks
which mode runs; :func:`make_source` picks the source once.

- :class:`SyncSource` (``trainer.mode=sync``): the step draws its prompts, generates with the
  learner's weights, scores, and syncs the weights after the update.
- :class:`AsyncSource` (one_step_off, async): the split replicas generate ahead into a bounded
  buffer the step takes its batch from; weights are synced as ``async.sync_every`` says.

Both hand the scored groups to one :class:`GroupFilter`, DAPO's dynamic sampling
(``algorithm.filter_groups``, arXiv 2503.14476): groups whose rewards are all equal are
dropped and more are generated (or taken), at most ``algorithm.max_gen_rounds`` batches' worth;
if that does not fill the batch, dropped groups top it up (their advantage is zero under a
group baseline).

Sampling seeds are derived from (seed, step, round) (:func:`sampling_params`), so a resumed
synchronous run draws the same samples as an uninterrupted one.

**Generating ahead** (:class:`AsyncSource`). In a synchronous step the trainer waits for the
rollout and the rollout for the trainer. Here a producer runs on the rollout client's loop, in a
thread of its own, that keeps drawing prompts and generating, and a bounded buffer of finished
groups sits between it and the trainer, which takes a batch as soon as one is there.

- **The unit of generation** is a step-batch: the ``data.batch_size`` prompts the sampler gives
  for step ``s``, sampled with step ``s``'s seed and sent together, exactly as a synchronous
  step sends them. Its groups enter the buffer when they finish; the trainer takes them oldest
  first (the oldest finished ones, with ``admission: drop``).
- **Staleness.** A sample's version is the oldest weight version of its tokens; its staleness
  is the learner's version (the step of the actor's last update) minus that. A step-batch
  starts only while the buffer, with what is in flight, has room (``async.buffer_groups``,
  default ``(max_staleness + 1) x data.batch_size``), and ``async.admission`` says how the
  bound ``async.max_staleness`` is kept:

  - ``bounded`` (the default) admits work so that it cannot go stale. The trainer takes groups
    oldest first, waiting for an older group still generating rather than take a newer one
    past it, and every step takes at least ``data.batch_size`` groups, so the group ``p``
    places behind the front of those started and not yet taken is trained by step
    :func:`trained_by` at the latest. A step-batch starts only when its last group will be
    trained by then within the bound of the replicas' version now (its oldest token's version
    at worst, with partial rollouts too). Groups dynamic sampling takes on top only come
    earlier; a trainer waiting for them takes them in its current step, which the sync rule
    (``sync_every <= max_staleness + 1``) keeps within the bound. Nothing is dropped (tinker
    cookbook PR 822: dropping favours prompts that finish fast).
  - ``drop`` starts step-batch ``s`` once the replicas hold version ``s - 1 - max_staleness``
    or newer; the trainer takes whichever groups finished first, and a sample that is older
    than the bound when taken (it finished after a later step-batch, or waited behind others)
    is dropped and counted.

  Either way a sample still outside the bound when taken is dropped and counted
  (``async/dropped``). ``max_staleness: 0`` is synchronous training, sample for sample;
  ``one_step_off`` is ``max_staleness: 1`` with a sync after every update and no partial
  rollouts: step t+1's samples are generated with the weights before step t's update while
  step t trains.
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
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from treadle.algorithms import ADV_ESTIMATORS
from treadle.algorithms.shaping import varied_groups
from treadle.config import Config
from treadle.data import PromptDataset, ResumableSampler, pad_prompts, prompt_batch
from treadle.engines.inference import SamplingParams
from treadle.protocol import Batch
from treadle.rollout.fleet import Rollout
from treadle.tracking.tracker import timed

Score = Callable[[Batch, dict[str, float] | None], torch.Tensor]
"""The driver's scorer: token-level scores [B, R] of a generated batch; it may log into the
metrics it is given (None: nothing)."""

EvalRequests = Callable[[], Coroutine[Any, Any, Any]]
"""An evaluation's generation: a coroutine on the client's loop (made in the caller's thread)."""
EvalScores = Callable[[Any], dict[str, float]]
"""An evaluation's metrics from what its generation returned (called in the trainer's thread)."""


class RolloutSource(Protocol):
    """What the driver takes its batches from, in every ``trainer.mode``."""

    def sample(self, step: int, m: dict[str, float]) -> Batch:
        """Step ``step``'s ``data.batch_size`` groups of ``rollout.n`` samples, scored
        (``token_level_scores``); its metrics (timings, rollout/, async/) go into ``m``."""
        ...

    def after_update(self, version: int) -> dict[str, float]:
        """The actor's weights are now ``version``: sync them to the replicas (when due)."""
        ...

    def evaluate(self, step: int, requests: EvalRequests, scores: EvalScores) -> dict[str, float]:
        """Evaluate the learner's weights (those of step ``step``): ``requests`` generate on
        the replicas, ``scores`` make the metrics of what they return. Now, the metrics
        returned; or beside training, ``{}`` returned and the metrics by :meth:`late_metrics`."""
        ...

    def late_metrics(self, wait: bool) -> dict[int, dict[str, float]]:
        """The metrics of the evaluations finished since the last call, by the step whose
        weights they evaluated; ``wait``: every one in flight (at the end of a run)."""
        ...

    def evaluating(self) -> set[int]:
        """The steps whose evaluation is in flight."""
        ...

    def metrics(self, step_seconds: float) -> dict[str, float]:
        """Metrics of the whole step (``step_seconds`` long), after it ran."""
        ...

    def state(self) -> dict[str, Any]:
        """The data position a checkpoint keeps (``sampler``, and ``async`` when ahead)."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state` of the checkpoint a run resumes from."""
        ...


def make_source(
    cfg: Config,
    rollout: Rollout,
    dataset: PromptDataset,
    sampler: ResumableSampler,
    score: Score,
    version: int,
) -> RolloutSource:
    """The source ``trainer.mode`` names; ``version``: the weights the replicas start with."""
    if cfg.trainer.mode == "sync":
        return SyncSource(cfg, rollout, dataset, sampler, score)
    return AsyncSource(cfg, rollout, dataset, sampler, score, version)


def sampling_params(cfg: Config, step: int, round_: int = 0) -> SamplingParams:
    """``rollout``'s sampling for step ``step``, round ``round_`` (its own seed)."""
    r = cfg.rollout
    return SamplingParams(
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        seed=cfg.trainer.seed * 100_003 + step + round_ * 1_000_003,
        ignore_eos=r.ignore_eos,
    )


# ----------------------------------------------------------------------------- prompt batches


# ----------------------------------------------------------------------------- group filter


class GroupFilter:
    """DAPO's dynamic sampling for one batch (see the module docstring); without
    ``algorithm.filter_groups`` it keeps every group."""

    def __init__(self, cfg: Config) -> None:
        alg = cfg.algorithm
        self.on, self.want = alg.filter_groups, cfg.data.batch_size
        self.budget = alg.max_gen_rounds * self.want if self.on else math.inf  # groups to look at
        self.kept: list[Batch] = []
        self.dropped: list[Batch] = []
        self.kept_groups = self.examined = 0

    def missing(self) -> int:
        """Groups still wanted."""
        return self.want - self.kept_groups

    def done(self) -> bool:
        return self.kept_groups >= self.want or self.examined >= self.budget

    def add(self, batch: Batch | None, stale: int = 0, failed: int = 0) -> None:
        """Scored groups (consecutive rows of one ``uid``: ``rollout.n``, fewer where agent
        runs failed, more where a session split); ``stale``: groups looked at and dropped
        before scoring, ``failed``: groups whose every run failed (both count against the
        budget)."""
        groups = len(set(batch["uid"])) if batch is not None else 0
        self.examined += groups + stale + failed
        if batch is None:
            return
        if not self.on:
            self.kept.append(batch)
            self.kept_groups += groups
            return
        varied = varied_groups(batch["token_level_scores"].sum(-1), list(batch["uid"]))
        self.kept.append(batch.select(varied.numpy()))
        self.dropped.append(batch.select((~varied).numpy()))
        self.kept_groups += len(set(batch.select(varied.numpy())["uid"]))

    def batch(self, m: dict[str, float]) -> Batch:
        """The first ``data.batch_size`` groups, kept ones first; ``rollout/kept_group_frac``."""
        if self.on:
            m["rollout/kept_group_frac"] = self.kept_groups / max(self.examined, 1)
        parts = [b for b in self.kept + self.dropped if len(b)]
        batch = pad_prompts(parts)
        return batch.slice(0, _rows_of_groups(list(batch["uid"]), self.want))


def _rows_of_groups(uids: list[str], groups: int) -> int:
    """How many leading rows the first ``groups`` groups (runs of one uid) take."""
    seen: set[str] = set()
    for i, uid in enumerate(uids):
        if uid not in seen and len(seen) == groups:
            return i
        seen.add(uid)
    return len(uids)


# ----------------------------------------------------------------------------- synchronous


@dataclass
class SyncSource:
    """Generation inside the step, with the learner's weights (``trainer.mode=sync``)."""

    cfg: Config
    rollout: Rollout
    dataset: PromptDataset
    sampler: ResumableSampler
    score: Score

    def __post_init__(self) -> None:
        # ReMax's baseline: the scores of greedy responses, generated here
        self.greedy = "baseline_rewards" in ADV_ESTIMATORS.needs(self.cfg.algorithm.adv_estimator)

    def sample(self, step: int, m: dict[str, float]) -> Batch:
        """Rounds of fresh prompts (one without dynamic sampling), each generated and scored."""
        groups = GroupFilter(self.cfg)
        rounds = 0
        while not groups.done():
            ds = self.dataset
            prompts = prompt_batch(ds, self.sampler.next_indices(), ds.pad_id)
            if rounds:  # a prompt drawn again in a later round is a group of its own
                prompts["uid"] = [f"{u}/{rounds}" for u in prompts["uid"]]
            with timed(m, "generate"):
                batch = self.rollout.generate(prompts, sampling_params(self.cfg, step, rounds))
            with timed(m, "reward"):
                batch["token_level_scores"] = self.score(batch, m)
            if self.greedy:
                with timed(m, "generate_greedy"):
                    batch["baseline_scores"] = self.greedy_scores(prompts, list(batch["uid"]))
            groups.add(batch, failed=len(prompts) - len(set(batch["uid"])))
            rounds += 1
        if groups.on:
            m["rollout/gen_rounds"] = float(rounds)
        m.update(self.rollout.take_counters())
        return groups.batch(m)

    def greedy_scores(self, prompts: Batch, uids: list[str]) -> torch.Tensor:
        """ReMax's baseline: the score of the greedy response to each prompt, for each of the
        rows ``uids`` (a prompt whose greedy run failed: 0)."""
        r = self.cfg.rollout
        out = self.rollout.generate(
            prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=r.max_new_tokens)
        )
        scores = dict(zip(out["uid"], self.score(out, None).sum(-1).tolist(), strict=True))
        return torch.tensor([scores.get(uid, 0.0) for uid in uids])

    def after_update(self, version: int) -> dict[str, float]:
        return self.rollout.sync_weights(version=version)

    def evaluate(self, step: int, requests: EvalRequests, scores: EvalScores) -> dict[str, float]:
        return scores(self.rollout.client.run(requests()))  # synced after every update

    def late_metrics(self, wait: bool) -> dict[int, dict[str, float]]:
        return {}

    def evaluating(self) -> set[int]:
        return set()

    def metrics(self, step_seconds: float) -> dict[str, float]:
        return {}

    def state(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


# ----------------------------------------------------------------------------- ahead of training


@dataclass(eq=False)
class _Eval:
    step: int  # the step that asked for it (its record gets the metrics)
    generated: concurrent.futures.Future[Any]  # its requests, answered
    scores: EvalScores


@dataclass
class _Group:
    step: int  # the step-batch it was drawn for (and sampled with the seed of)
    index: int  # its prompt's place in that step-batch
    batch: Batch  # its rollout.n samples


@dataclass(frozen=True)
class Admission:
    """``async.admission``: whether a step-batch may start now for the staleness bound, and
    whether the trainer may take the buffer's first groups (see the module docstring)."""

    bounded: bool
    max_staleness: int
    batch_size: int

    def fresh(
        self, step: int, count: int, version: int, ahead: int, at: tuple[int, int], waiting: int
    ) -> bool:
        """Step-batch ``step``'s ``count`` groups, started now with the replicas' ``version``
        behind the ``ahead`` groups started and not yet taken; ``at``: the step the trainer
        takes groups for and how many it took, ``waiting``: how many more it waits for."""
        if not self.bounded:  # within its own step's bound (taken later, it may be dropped)
            return version >= step - 1 - self.max_staleness
        last = trained_by(ahead + count - 1, *at, waiting, self.batch_size)
        return last <= version + self.max_staleness + 1  # its oldest token: ``version``

    def ready(self, buffer: list[_Group], count: int, flying: set[int]) -> bool:
        """Whether the buffer's first ``count`` groups may be taken (``flying``: the step-batches
        generating): bounded, only when no older group is still generating."""
        if len(buffer) < count:
            return False
        return not self.bounded or buffer[count - 1].step < min(flying, default=math.inf)


class AsyncSource:
    """The producer, the buffer and the sync policy of the modes that generate ahead
    (one_step_off, async); see the module docstring."""

    def __init__(
        self,
        cfg: Config,
        rollout: Rollout,
        dataset: PromptDataset,
        sampler: ResumableSampler,
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
        self.buffer: list[_Group] = []
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
                self.buffer.append(_Group(step, i, batch.select(rows)))
            self.buffer.sort(key=lambda g: (g.step, g.index))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.error = e
        finally:
            self.in_flight -= len(keep)
            self.flying.discard(step)

    async def _take(self, count: int) -> list[_Group]:
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


def trained_by(position: int, step: int, taken: int, waiting: int, batch_size: int) -> int:
    """The latest step that trains the group ``position`` places behind the front of those
    admitted and not yet taken (0: the next to be taken), when the trainer takes groups oldest
    first for step ``step``, has taken ``taken`` of them and waits for ``waiting`` more. Every
    step takes at least ``batch_size`` groups (dynamic sampling may take more: earlier, never
    later)."""
    now = max(batch_size - taken, waiting)  # groups step ``step`` is still sure to take
    if position < now:
        return step
    return step + 1 + (position - now) // batch_size


def _oldest(group: _Group) -> int:
    """The oldest weight version of a group's tokens."""
    return int(group.batch["weight_version"].min())
