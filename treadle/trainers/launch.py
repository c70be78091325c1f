"""A trainer's start-up: its workers, its rollout and its side roles, in order.

:class:`Launch` is the part of :class:`~treadle.trainers.base.Trainer` that starts things:
the resume point, the start-up lines, the logs routed, the placement
(:class:`~treadle.controller.Placement`, decided once), a split rollout's pool and replicas
(:func:`~treadle.rollout.fleet.spawn_rollout`, not waited for: their processes import and
start their engines while the actors' group starts), the actors' group, then, once it is
ready, the checkpoint restored into it, the rollout over it (the split replicas waited for)
and the side roles (:mod:`treadle.trainers.roles`).

On Ray, a driver may call :meth:`Launch.begin_workers` before it reads its data: the workers'
processes (imports, model loads, engines) then start while it reads and tokenizes, and
:meth:`Launch.start_workers` waits for them (measured on SmolLM2 with vLLM: the prompts'
tokenizer, templating and tokens take the driver 2-3 s). Without it (the local backend, the
drivers that do not call it) :meth:`Launch.start_workers` starts them itself, after the data.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.config import Config
from treadle.config.recorded import Change, changes
from treadle.controller import Actors, Placement, WorkerGroup
from treadle.controller.cluster import ray_address, use_gpus
from treadle.data import PromptSampler
from treadle.models import checkpoint as ckpt
from treadle.rollout.fleet import Rollout, Spawned, spawn_rollout, start_rollout
from treadle.runtime import startup
from treadle.runtime.faults import failpoint
from treadle.serving.replica import ServesRollout
from treadle.tracking.sinks import ConsoleLogger
from treadle.tracking.tracker import quiet_start, route_logs
from treadle.trainers.roles import Layout, build_actors, start_roles
from treadle.trainers.run_dir import resume_point

log = logging.getLogger("treadle")


def _on_ray(cfg: Config) -> str:
    """Where the headline says a Ray run trains: its actor ranks, their device and parallel
    layout. On a cluster it joins, the cluster's address instead of the device: the driver's
    own device says nothing of the cluster's (a CPU-only head node of a GPU cluster), and
    asking the cluster would hold the headline until Ray has joined."""
    a = cfg.actor
    split = (("tensor", a.tensor_parallel_size), ("sequence", a.sequence_parallel_size))
    layout = "".join(f" ({kind} parallel {n})" for kind, n in split if n > 1)
    joined = ray_address(cfg)
    if joined is not None:
        return f"on the Ray cluster at {joined[0]}, {a.world_size} rank(s){layout}"
    device = "GPU" if use_gpus(cfg) else "CPU"  # (this machine's)
    return f"on Ray, {a.world_size} {device} rank(s){layout}"


def start_lines(
    cfg: Config,
    out: Path,
    algorithm: str,
    steps: tuple[int, int],
    resumed_from: Path | None,
    changed: Sequence[Change] = (),
) -> list[str]:
    """What runs (``steps``: its first and last), where, where it writes (and where it resumed
    from, with the settings ``changed`` since that checkpoint was written)."""
    t = cfg.trainer
    where = "in this process (trainer.backend=local)" if t.backend == "local" else _on_ray(cfg)
    files = ["config.yaml", "logs/"]
    named = {"jsonl": "metrics.jsonl", "mlflow": "mlflow.db", "swanlab": "swanlog/"}
    if os.environ.get("MLFLOW_TRACKING_URI"):
        named["mlflow"] = f"mlflow at {os.environ['MLFLOW_TRACKING_URI']}"
    files += [named.get(n, f"{n}/") for n in t.loggers if n != "console"]
    start, total = steps
    lines = [
        f"treadle: {algorithm} of {cfg.model.path}, {total} step{'s' if total != 1 else ''}, "
        f"{where}",
        f"  writes to {out}: {', '.join(files)}",
    ]
    if resumed_from is not None:
        lines.append(f"  resumed from {resumed_from} (step {start})")
    if changed:
        lines.append(f"  settings changed since: {', '.join(map(str, changed))}")
    return lines


@dataclass
class Launched:
    """What :meth:`Trainer.begin_workers` started: the checkpoint resumed (and its state), the
    actors' start weights, a split rollout's replicas, the actors' group (maybe starting)."""

    latest: Path | None
    state: dict[str, Any] | None
    actor_path: str
    spawned: Spawned | None
    actors: Actors

    def close(self) -> None:
        if self.spawned is not None:
            self.spawned.close()
        self.actors.close()


class Launch:
    """Start-up of a :class:`~treadle.trainers.base.Trainer` (see the module docstring)."""

    cfg: Config
    out: Path
    total: int
    start: int
    resumed_from: Path | None
    headline: str
    algorithm: str
    serves_rollout: bool
    console: ConsoleLogger | None
    side: dict[str, WorkerGroup]
    roles: dict[str, WorkerGroup]
    sampler: PromptSampler
    actors: Actors
    group: WorkerGroup
    rollout: Rollout
    _launched: Launched | None = None  # the workers begun (begin_workers)
    _restore_logs: Callable[[], None]  # the logs back as before route_logs

    def optimizer_steps(self) -> int:
        raise NotImplementedError

    def load_driver_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def begin_workers(self, with_ref: bool, layout: Layout | None = None) -> None:
        """On Ray, start the workers before the driver reads its data: their processes import,
        load their models and start their engines meanwhile, and :meth:`start_workers` waits
        for them. A driver that calls it calls :meth:`abandon_workers` if it fails before."""
        if self.cfg.trainer.backend == "ray":
            startup.mark("trainer")  # the trainer's imports, its run directory
            self._launched = self._launch(with_ref, layout, wait=False)

    def abandon_workers(self) -> None:
        """The workers :meth:`begin_workers` started, closed (the driver failed before
        :meth:`start_workers`)."""
        launched, self._launched = self._launched, None
        if launched is not None:
            launched.close()
            self._restore_logs()

    def start_workers(
        self, sampler: PromptSampler, with_ref: bool, layout: Layout | None = None
    ) -> None:
        """Build the actor group, from the newest complete checkpoint if there is one, the
        rollout, and the side roles of ``layout`` (none by default) into :attr:`side`."""
        self.sampler = sampler
        startup.mark("data")
        launched = self._launched or self._launch(with_ref, layout, wait=True)
        self._launched = None
        if launched.state is not None:
            self.load_driver_state(launched.state)
        try:
            with quiet_start():
                self._start_workers(launched)
        except BaseException:
            self._restore_logs()
            raise
        if layout is not None:
            self._start_roles(layout)
        failpoint("startup")

    def _launch(self, with_ref: bool, layout: Layout | None, wait: bool) -> Launched:
        """The resume point, the start-up lines, the logs routed, then a split rollout's
        replicas and the actors' group, started (``wait``: the actors ready)."""
        latest, actor_path = resume_point(self.cfg)
        state = ckpt.read_state(latest) if latest is not None else None
        changed: list[Change] = []  # the settings changed since the checkpoint resumed from
        if state is not None:
            self.start, self.resumed_from = int(state["step"]), latest
            recorded = state.get("settings")  # (checkpoints of earlier versions have none)
            changed = changes(recorded, self.cfg)[1] if isinstance(recorded, dict) else []
        self.say_what_runs(changed)
        self._restore_logs = route_logs(self.out, self.cfg.trainer.verbose)
        spawned = None
        try:
            with quiet_start():
                # a split rollout pool's CPUs are set aside only by the RL driver's layout
                cfg = self.cfg
                placement = layout.placement(cfg) if layout is not None else Placement.plan(cfg)
                # split: the rollout's pool and replicas first, starting beside the actors
                spawned = (
                    spawn_rollout(cfg, actor_path, self.start) if self.serves_rollout else None
                )
                actors = self.build_workers(actor_path, with_ref, placement, wait)
        except BaseException:
            if spawned is not None:
                spawned.close()
            self._restore_logs()
            raise
        return Launched(latest, state, actor_path, spawned, actors)

    def _start_roles(self, layout: Layout) -> None:
        """The side roles; those in checkpoints also go to :attr:`roles`."""
        try:
            self.side = start_roles(self.cfg, self.actors, layout, self.resumed_from)
        except BaseException:
            self.close()  # the rollout (split replicas) and the actors
            raise
        for p in layout.roles:
            if p.role.saved:
                self.roles[p.role.name] = self.side[p.role.name]

    def say_what_runs(self, changed: Sequence[Change]) -> None:
        """The start-up lines: what runs, where, where it writes (and the settings ``changed``
        since the checkpoint it resumes from)."""
        t = self.cfg.trainer
        if "console" not in t.loggers:
            return
        self.console = ConsoleLogger(self.total, self.start, self.headline, bar=None)
        self.console.bar = self.console.bar and t.progress
        steps = self.start, self.total
        lines = start_lines(self.cfg, self.out, self.algorithm, steps, self.resumed_from, changed)
        for line in lines:
            self.console.print(line)

    def _start_workers(self, launched: Launched) -> None:
        """The actors ready, restored from the checkpoint, then the rollout over them."""
        spawned, self.actors, latest = launched.spawned, launched.actors, launched.latest
        try:
            self.group = self.actors.ready().group
            startup.mark("workers")  # colocated vLLM engines start in the workers
            startup.detail("workers", self.group.startup_seconds())
            try:
                if latest is not None:
                    self.group.load_checkpoint(str(latest))
                    startup.mark("resume")
                if self.serves_rollout and issubclass(self.group.worker_cls, ServesRollout):
                    given, spawned = spawned, None  # the rollout's from here, closed by it
                    start = self.cfg, self.group, launched.actor_path, self.start
                    self.rollout = start_rollout(*start, given)
                    if latest is not None and ckpt.holds_adapters(latest):
                        self.rollout.sync_weights(self.start)  # started from the base
                    startup.mark("rollout")
            except BaseException:
                self.actors.close()
                raise
        finally:
            if spawned is not None:
                spawned.close()

    def build_workers(
        self, start_path: str, with_ref: bool, placement: Placement, wait: bool = True
    ) -> Actors:
        """The trained worker group, from the weights at ``start_path`` (default: the actor)
        (``wait=False``: still starting, see :meth:`~treadle.controller.Actors.ready`)."""
        steps = self.optimizer_steps()
        a = self.cfg.actor
        if a.warmup_steps > steps:  # a short try of a config made for a long run, or a slip
            log.warning(
                "actor.warmup_steps=%d is longer than the run's %d optimizer steps: the lr "
                "stays below actor.lr=%g (it reaches %g)",
                a.warmup_steps, steps, a.lr, a.lr * steps / a.warmup_steps,
            )  # fmt: skip
        return build_actors(self.cfg, start_path, with_ref, placement, steps, wait)
