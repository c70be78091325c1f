"""Placement: where a run's worker groups sit, decided once before the first of them starts.

::

    Placement.plan(cfg, colocated, split_ranks, reserved_cpus)    one record for the whole run
        │   a bundle: cpus_per_rank CPUs (+ gpus_per_rank GPUs), one per actor rank
        ▼
    start_group(cfg, placement, cls, kwargs) ─► Actors: the actors' group on a pool of bundles
        ├─ actors.add(cls, kwargs, world_size)              on the actors' bundles (colocated)
        └─ actors.add(cls, kwargs, world_size, split=True)  on a pool of its own (split)

Choices:

- **GPUs: one a rank where the cluster has them** (:func:`~.cluster.use_gpus`: the Ray
  cluster's GPUs decide, not the driver's, which may sit on a CPU-only head node).
- **One bundle size.** The training side's CPUs (the run's, ``trainer.num_cpus`` or the
  machine's or the joined cluster's, less a split rollout pool's) are divided equally over the
  actor's ranks and every split role's ranks; without split roles or a split rollout, all the
  run's CPUs over the actor's ranks.
- **Colocated groups share bundles.** Each of the ``colocated`` groups on the actors' pool
  reserves an equal share of every bundle, so Ray puts rank r of each on bundle r; every
  process may still use all the bundle's threads (``trainer.threads_per_rank``, default its
  CPUs), since the driver calls the groups in turn.
- **Local backend**: every group is one rank in the driver's process; the groups after the
  actors' join its one-rank process group (see ``Worker``) and use all the run's CPUs.
- A group that fails to start gives its pool back at once: a failed start must not starve
  what comes next.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from treadle.config import Config
from treadle.controller.cluster import ensure_ray, total_cpus, use_gpus
from treadle.controller.groups.group import WorkerGroup
from treadle.controller.groups.pool import ResourcePool
from treadle.controller.groups.worker import Worker
from treadle.runtime.omp import openmp_env
from treadle.tracking.tracker import worker_env


@dataclass(frozen=True)
class Placement:
    """How a run's groups sit on its CPUs and GPUs (see the module docstring)."""

    backend: str  # "local": every group in this process; "ray": pools of bundles
    world_size: int  # the actors' ranks: bundles of their pool
    cpus_per_rank: float  # a bundle's CPUs, the actors' pool's and every split role's
    gpus_per_rank: float  # a bundle's GPUs: 1 where the cluster has GPUs (use_gpus), else 0
    total_cpus: float  # the run's CPUs (what a local-backend process may use)
    colocated: int = 1  # groups on the actors' bundles, the actors' included
    threads_per_rank: int | None = None  # trainer.threads_per_rank; None: a bundle's CPUs

    @classmethod
    def plan(
        cls, cfg: Config, colocated: int = 1, split_ranks: int = 0, reserved_cpus: float = 0.0
    ) -> Placement:
        """``colocated`` groups on the actors' bundles, ``split_ranks`` ranks of groups with
        pools of their own, ``reserved_cpus`` CPUs kept out of both (a split rollout pool)."""
        total = total_cpus(cfg)
        ranks = cfg.actor.world_size + split_ranks
        return cls(
            backend=cfg.trainer.backend,
            world_size=cfg.actor.world_size,
            cpus_per_rank=(total - reserved_cpus) / ranks,
            gpus_per_rank=1.0 if use_gpus(cfg) else 0.0,
            total_cpus=total,
            colocated=colocated,
            threads_per_rank=cfg.trainer.threads_per_rank,
        )

    @property
    def share(self) -> float:
        """What each colocated group reserves of a bundle."""
        return 1.0 / self.colocated

    def threads(self, cpus: float | None = None) -> int:
        """A process's threads: ``trainer.threads_per_rank``, else ``cpus`` (a bundle's)."""
        return self.threads_per_rank or max(1, int(self.cpus_per_rank if cpus is None else cpus))

    def pool(self, world_size: int) -> ResourcePool:
        """``world_size`` bundles of this placement's size."""
        return ResourcePool(world_size, self.cpus_per_rank, self.gpus_per_rank)


def rank_threads(cfg: Config, cpus_per_rank: float) -> int:
    """The threads of a process on a bundle of ``cpus_per_rank`` CPUs."""
    return cfg.trainer.threads_per_rank or max(1, int(cpus_per_rank))


def ray_env(threads: int, gpus: float) -> dict[str, str]:
    """The environment of a Ray worker process with ``threads`` threads and ``gpus`` GPUs.

    One given no GPU sees none (``CUDA_VISIBLE_DEVICES`` empty): Ray 2.60 no longer hides a
    node's GPUs from an actor with ``num_gpus=0`` (``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO``),
    and torch there would take GPU 0 of its node, beside the ranks Ray placed on it."""
    hidden = {} if gpus else {"CUDA_VISIBLE_DEVICES": ""}
    env = {
        **hidden,
        **openmp_env(),
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    return {**env, **worker_env()}  # not verbose: the worker writes to <output_dir>/logs/


@dataclass
class Actors:
    """The actors' worker group, the pool it lives in, and the groups of the other roles
    (critic, reward model, PRM), on that pool's bundles or on pools of their own."""

    group: WorkerGroup
    pool: ResourcePool | None
    placement: Placement
    others: list[tuple[WorkerGroup, ResourcePool | None]] = field(default_factory=list)

    def add(
        self, cls: type[Worker], kwargs: dict[str, Any], world_size: int, split: bool = False
    ) -> WorkerGroup:
        """Another role's group of ``world_size`` ranks: on the actors' bundles (colocated, the
        same share each) or, ``split``, on a pool of its own. Closed with the actors."""
        p = self.placement
        if p.backend == "local":  # joins the actor's one-rank process group in-process
            # the threads of the process, the actors' too: all the run's CPUs
            kwargs = {**kwargs, "threads": p.threads(p.total_cpus)}
            group = WorkerGroup(cls, world_size=1, backend="local", kwargs=kwargs)
            self.others.append((group, None))
            return group
        assert self.pool is not None
        pool = p.pool(world_size) if split else self.pool
        try:
            group = _ray_group(cls, kwargs, world_size, pool, p, 1.0 if split else p.share)
        except BaseException:
            if split:
                pool.remove()
            raise
        self.others.append((group, pool if split else None))
        return group

    def ready(self) -> Actors:
        """The actors' group started (``start_group(wait=False)``), waited for; on failure its
        ranks are killed and the pool given back."""
        try:
            self.group.ready()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for group, pool in reversed(self.others):
            group.shutdown()
            if pool is not None:
                pool.remove()
        self.group.shutdown()
        if self.pool is not None:
            self.pool.remove()


def start_group(
    cfg: Config,
    placement: Placement,
    worker_cls: type[Worker],
    kwargs: dict[str, Any],
    wait: bool = True,
) -> Actors:
    """``placement.world_size`` ranks of ``worker_cls`` (one in-process rank for the local
    backend), each built with ``config`` and ``threads`` besides ``kwargs``, on a pool of
    their own; the groups added later share it as ``placement`` says. ``wait=False``: the
    Ray ranks are starting, :meth:`Actors.ready` waits for them."""
    kwargs = {"config": cfg, **kwargs}
    if placement.backend == "local":
        kwargs["threads"] = placement.threads()
        group = WorkerGroup(worker_cls, world_size=1, backend="local", kwargs=kwargs)
        return Actors(group, None, placement)
    ensure_ray(cfg)
    pool = placement.pool(placement.world_size)
    try:
        group = _ray_group(
            worker_cls, kwargs, placement.world_size, pool, placement, placement.share, wait
        )
    except BaseException:
        pool.remove()  # give the CPUs back: a failed start must not starve what comes next
        raise
    return Actors(group, pool, placement)


def _ray_group(
    cls: type[Worker],
    kwargs: dict[str, Any],
    world_size: int,
    pool: ResourcePool,
    placement: Placement,
    share: float,
    wait: bool = True,
) -> WorkerGroup:
    threads = placement.threads()
    return WorkerGroup(
        cls,
        world_size=world_size,
        backend="ray",
        pool=pool,
        kwargs={**kwargs, "threads": threads},
        env=ray_env(threads, pool.gpus_per_rank * share),
        share=share,
        wait=wait,
    )
