"""The loop every driver shares: start-up, resume, steps, metrics, checkpoints, clean-up.

Kept out of the drivers so that each trainer's file reads as its dataflow. Start-up: the run
directory (:mod:`treadle.trainers.run_dir`), then the workers, the rollout and the side roles
(:mod:`treadle.trainers.launch`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from treadle.config import Config
from treadle.config.recorded import record
from treadle.config.rules import Kind
from treadle.controller import WorkerGroup, peer_lost
from treadle.models import checkpoint as ckpt
from treadle.rewards import Scorer
from treadle.rollout.fleet import Rollout
from treadle.runtime import startup
from treadle.runtime.errors import (
    Stopped,
    WorkerDied,
    raise_if_signalled,
    signalled,
    stop_cause,
    stop_line,
    whereabouts,
)
from treadle.runtime.faults import failpoint
from treadle.serving.client import RolloutError
from treadle.tracking import profiler
from treadle.tracking.sinks import ConsoleLogger, check_loggers
from treadle.tracking.tracker import Tracker, quiet_start
from treadle.trainers.evaluation import ValSet, close_sets, make_scorer
from treadle.trainers.launch import Launch
from treadle.trainers.run_dir import prepare_run_dir, resume_hint, save_checkpoint

Record = tuple[int, dict[str, float], list[dict[str, Any]]]  # step, metrics, samples


class HeldRecords:
    """The steps' records not logged yet. A step evaluated beside training is logged once its
    metrics are in (``late``: by step, as they come; ``wait``: all of them), with them, at its
    own step, and the steps after it wait for it (``running``: the steps whose evaluation still
    runs), so every tracker sees each step once and in order."""

    def __init__(
        self,
        tracker: Tracker,
        late: Callable[[bool], dict[int, dict[str, float]]],
        running: Callable[[], set[int]],
    ) -> None:
        self.tracker, self.late, self.running = tracker, late, running
        self.held: list[Record] = []

    def add(self, record: Record, wait: bool) -> None:
        """Hold ``record``, then log the held ones up to the first still evaluated."""
        self.held.append(record)
        late = self.late(wait)
        for step, metrics, _ in self.held:
            metrics.update(late.pop(step, {}))
        running = self.running()
        while self.held and self.held[0][0] not in running:
            self._log(self.held.pop(0))

    def flush_all(self) -> None:
        """Log every held record, evaluated or not."""
        while self.held:
            self._log(self.held.pop(0))

    def _log(self, record: Record) -> None:
        step, metrics, samples = record
        self.tracker.log(step, metrics)
        if samples:
            self.tracker.log_table(step, "samples", samples)


class Trainer(Launch):
    """The loop every driver shares: resume, steps, metrics, checkpoints, clean-up.

    A subclass loads its data, calls :meth:`start_workers` (on Ray, maybe
    :meth:`begin_workers` before its data), and defines :meth:`run_step` (one step's metrics)
    and ``total`` (the last step).
    """

    headline = "reward/mean"
    algorithm = "training"  # what the start-up line says it runs
    kind: Kind  # the command it runs, in every checkpoint's state.json (treadle check reads it)
    serves_rollout = True  # whether its workers serve a rollout (not the RM trainer's)

    def __init__(self, cfg: Config) -> None:
        startup.begin()
        check_loggers(cfg.trainer.loggers)  # a missing tracker library: before anything starts
        self.cfg = cfg
        self.out, self.lock = prepare_run_dir(cfg)
        self.total = cfg.trainer.total_steps
        self.start = 0
        self.resumed_from: Path | None = None
        # The side roles' groups (treadle.trainers.roles), and those whose state a checkpoint
        # holds, in <checkpoint>/<name>/.
        self.side: dict[str, WorkerGroup] = {}
        self.roles: dict[str, WorkerGroup] = {}
        self.rollout: Rollout  # set by start_workers, for workers that serve rollouts
        # rows for the trackers' "samples" table, left by run_step when they are due
        self.samples: list[dict[str, Any]] = []
        self.console: ConsoleLogger | None = None
        self.val_sets: dict[str, ValSet] = {}  # the validation sets, when the driver has some
        self.final_note = ""  # what final_model is, when it is not the last step's
        self._restore_logs = lambda: None

    def optimizer_steps(self) -> int:
        """The run's optimizer steps, where a decaying lr schedule ends: one a step (SFT, DPO,
        KTO, RM), ``total`` set by the driver before :meth:`start_workers`."""
        return self.total

    def run_step(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def driver_state(self) -> dict[str, Any]:
        """What the driver itself must keep across a resume (saved in state.json)."""
        return {"sampler": self.sampler.state_dict()}

    def load_driver_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def eval_due(self, step: int) -> bool:
        every = self.cfg.trainer.eval_every
        return step == self.total or bool(every and step % every == 0)

    def fit(self) -> dict[str, float]:
        """Run until ``total``; returns the last step's metrics. Ctrl-C (or SIGTERM, from the
        command line) stops it with :class:`Stopped`, after the workers are shut down."""
        self.at_step = self.start  # the step under way
        # what the line a stop ends with says, also where a clean-up after it overruns (cli)
        with whereabouts(lambda: f"during step {self.at_step}; {resume_hint(self.cfg)}"):
            try:
                with self.open_tracker() as tracker, self.held_records(tracker) as held:
                    metrics = self.run_steps(held)
            except KeyboardInterrupt as e:
                how, code = stop_cause(e)
                raise Stopped(stop_line(how), code) from None
            except Exception as e:
                if signalled():  # the stop, turned into another error where it landed
                    how, code = stop_cause()  # (vLLM's tokenizer pool: an UnboundLocalError)
                    raise Stopped(stop_line(how), code) from None
                if isinstance(e, (WorkerDied, RolloutError)):  # a process of the run is gone
                    raise type(e)(f"step {self.at_step}: {e}; {resume_hint(self.cfg)}") from None
                died = self.dead_peer(e)
                if died is None:
                    raise
                raise WorkerDied(f"step {self.at_step}: {died}; {resume_hint(self.cfg)}") from None
            finally:
                self.close()
        if self.console is not None:
            self.console.print(f"final model: {self.out / 'final_model'}{self.final_note}")
            if "jsonl" in self.cfg.trainer.loggers:
                self.console.print(f"report: treadle report {self.out}")
        return metrics

    def dead_peer(self, error: BaseException) -> WorkerDied | None:
        """When ``error`` is a rank's collective failing because a peer's process is gone,
        seen before the peer's death (a rollout or a call that no group's ``_get`` reads):
        the dead rank, named; else None."""
        if not peer_lost(error) or not hasattr(self, "group"):
            return None
        # Ray's task error begins "ray::<Class>.<method>() (pid=..."
        call = re.search(r"ray::\w+\.(\w+)\(\)", str(error))
        when = f"during {call.group(1) if call else 'a step'}"
        return next(filter(None, (g.find_dead(when) for g in self.worker_groups())), None)

    def worker_groups(self) -> list[WorkerGroup]:
        """The run's worker groups, each once (a side role may share the actor's group)."""
        return list({id(g): g for g in [self.group, *self.side.values()]}.values())

    def run_steps(self, held: HeldRecords) -> dict[str, float]:
        """The steps after ``start``, each logged and checkpointed as the config says; the last
        one's metrics."""
        t, metrics = self.cfg.trainer, {}
        started = startup.startup_metrics()
        for step in range(self.start + 1, self.total + 1):
            self.at_step = step
            failpoint("begin", step)
            with self.profiled(step):
                metrics = {**self.run_step(step), **started}
            raise_if_signalled()  # one whose exception was lost in the step
            started = {}
            last = step == self.total
            saving = last or bool(t.save_every and step % t.save_every == 0)
            # a checkpoint ranked by its step's evaluation waits for one running beside
            wait = last or (saving and t.keep_best is not None)
            held.add((step, metrics, self.samples), wait)
            self.samples = []
            if step in t.profile_steps and self.console is not None:
                self.console.print(f"profile of step {step}: {self.profile_folder(step)}")
            failpoint("step", step)
            if not all(math.isfinite(v) for v in metrics.values()):
                raise FloatingPointError(f"step {step}: a metric is not finite: {metrics}")
            if saving:
                self.save(step, metrics, last)
                failpoint("sealed", step)
        return metrics

    @contextlib.contextmanager
    def profiled(self, step: int) -> Iterator[None]:
        """The step under torch.profiler when ``trainer.profile_steps`` names it
        (:mod:`treadle.tracking.profiler`): the driver's process and, on Ray, every rank of the
        training groups and every split rollout replica. A step that fails stops the profiles
        and still writes the driver's."""
        if step not in self.cfg.trainer.profile_steps:
            yield
            return
        folder = self.profile_folder(step)
        groups: list[WorkerGroup | Rollout] = []
        if self.cfg.trainer.backend == "ray" and hasattr(self, "group"):
            groups = [*self.worker_groups()]
            if hasattr(self, "rollout"):
                groups.append(self.rollout)  # its split replicas
        for group in groups:
            group.start_profile(str(folder))
        with quiet_start():  # kineto's lines on stderr: to the run's log
            profiler.begin(str(folder), "driver")

        def stop() -> None:
            with quiet_start():
                profiler.end()
            for group in groups:
                group.stop_profile()

        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # the step's own error is the one to raise
                stop()
            raise
        stop()

    def profile_folder(self, step: int) -> Path:
        return self.out / "profile" / f"step_{step}"

    def save(self, step: int, metrics: dict[str, float], last: bool) -> None:
        """Checkpoint ``step`` (:func:`~treadle.trainers.run_dir.save_checkpoint`)."""
        state = {**self.driver_state(), "command": self.kind, "settings": record(self.cfg)}
        try:
            note = save_checkpoint(self.cfg, step, self.group, self.roles, state, metrics, last)
        except ckpt.CheckpointWriteError as e:  # disk full, no permission: say where to go on from
            raise ckpt.CheckpointWriteError(f"{e}; {resume_hint(self.cfg)}") from None
        if last:
            self.final_note = note

    def late_metrics(self, wait: bool) -> dict[int, dict[str, float]]:
        """Metrics of earlier steps that came since the last call (an evaluation that ran
        beside training), by step; ``wait``: wait for all of them."""
        return {}

    def evaluating(self) -> set[int]:
        """The steps whose evaluation still runs (their records wait for it)."""
        return set()

    @contextlib.contextmanager
    def held_records(self, tracker: Tracker) -> Iterator[HeldRecords]:
        """The steps' records on their way to ``tracker``; on the way out, what is still held
        is logged (a run stopped before an evaluation beside training came back: without it)."""
        held = HeldRecords(tracker, self.late_metrics, self.evaluating)
        try:
            yield held
        finally:
            held.flush_all()

    def open_tracker(self) -> Tracker:
        t = self.cfg.trainer
        config = self.cfg.model_dump(mode="json", by_alias=True)
        return Tracker(
            self.out,
            self.total,
            self.start,
            t.progress,
            self.headline,
            loggers=t.loggers,
            config=config,
            console=self.console,
        )

    def samples_due(self, step: int) -> bool:
        """Whether this step's samples go to samples.jsonl and the trackers' tables."""
        every = self.cfg.trainer.log_samples_every
        return bool(every) and (step == self.total or step % every == 0)

    @functools.cached_property
    def scorer(self) -> Scorer:
        """``reward.function``'s scorer (its worker processes start on first use)."""
        return make_scorer(self.cfg)

    def close(self) -> None:
        try:
            if "scorer" in self.__dict__:
                self.scorer.close()
            close_sets(self.val_sets)
            if hasattr(self, "rollout"):
                self.rollout.close()
            self.actors.close()
        finally:
            self._restore_logs()
            self.lock.release()
