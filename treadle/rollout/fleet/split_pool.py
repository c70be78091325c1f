"""The split placement: the rollout's own pool and its replica actors.

``rollout.placement=split`` gives the rollout ``rollout.replicas``
:class:`~treadle.serving.replica.RolloutReplica` actors in a placement group of their own,
``rollout.num_cpus`` CPUs (default: half the run's) divided equally,
``rollout.tensor_parallel_size`` GPUs each where the Ray cluster has GPUs
(:func:`~treadle.controller.cluster.use_gpus`). On a Ray cluster the pool goes
wherever it fits, another node included. Choices:

- The pool is reserved before the actor's, so that replicas pinned to nodes
  (``rollout.ray_resources``) get them before others choose.
- Replicas are spawned, not waited for (:func:`spawn_rollout`, :func:`spawn_replicas`): their
  processes import and start their engines while the driver starts the actors' group;
  :func:`start_replicas` waits for them.
- Whatever fails on the way kills the replicas started and gives the pool back
  (:func:`kill_replicas`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treadle.config import Config
from treadle.controller import ResourcePool, guarded, rank_threads, ray_env, ray_get
from treadle.controller.cluster import ensure_ray, total_cpus, use_gpus
from treadle.runtime.errors import ConfigError
from treadle.serving.replica import Role, RolloutReplica


def rollout_cpus(cfg: Config) -> float:
    """CPUs of the split rollout pool (0 when colocated)."""
    if cfg.rollout.placement == "colocated":
        return 0.0
    return cfg.rollout.num_cpus or total_cpus(cfg) / 2


def reserve_rollout_pool(cfg: Config) -> ResourcePool | None:
    """The split rollout pool (None when colocated), reserved before the actor's so that
    replicas pinned to nodes (``rollout.ray_resources``) get them before others choose."""
    if cfg.rollout.placement == "colocated":
        return None
    ensure_ray(cfg)
    r, total, cpus = cfg.rollout, total_cpus(cfg), rollout_cpus(cfg)
    if cpus >= total:
        raise ConfigError(
            f"rollout.num_cpus={cpus:g} leaves nothing of the run's {total:g} CPUs for the "
            "actor: give the rollout pool fewer CPUs or the run more (trainer.num_cpus)"
        )
    gpus = float(r.tensor_parallel_size) if use_gpus(cfg) else 0.0
    if not gpus and r.tensor_parallel_size > 1:
        raise ConfigError(
            f"rollout.tensor_parallel_size={r.tensor_parallel_size} needs GPUs; on CPU a "
            "replica is one process: set it to 1"
        )
    count = cfg.rollout_replicas()
    return ResourcePool(count, cpus / count, gpus, dict(r.ray_resources))


@dataclass
class Spawned:
    """A split rollout's pool and its replicas, started and not waited for, until
    :func:`~.start.start_rollout` takes them (``close``: killed, the pool given back, if it never
    does)."""

    pool: ResourcePool
    replicas: list[Any]

    def close(self) -> None:
        kill_replicas(self.replicas, self.pool)


def spawn_rollout(cfg: Config, path: str, version: int) -> Spawned | None:
    """Split: the rollout pool (:func:`reserve_rollout_pool`) and its replicas of the weights at
    ``path``, starting (imports, engines) while the driver starts the actors' group; None when
    colocated."""
    pool = reserve_rollout_pool(cfg)
    if pool is None:
        return None
    try:
        return Spawned(pool, spawn_replicas(cfg, pool, path, version))
    except BaseException:
        pool.remove()
        raise


def spawn_replicas(
    cfg: Config, pool: ResourcePool, path: str, version: int, role: Role = "rollout"
) -> list[Any]:
    """One :class:`RolloutReplica` actor of ``role`` serving the weights at ``path`` on each
    bundle of ``pool``, not waited for: their processes start (imports, engine) while the
    driver goes on; :func:`start_replicas` waits for them."""
    return [start_replica(cfg, pool, i, path, version, role) for i in range(pool.world_size)]


def start_replicas(
    cfg: Config,
    pool: ResourcePool,
    path: str,
    version: int,
    role: Role = "rollout",
    spawned: list[Any] | None = None,
) -> list[Any]:
    """:func:`spawn_replicas` (or ``spawned``, its replicas), ready; on failure the replicas
    are killed and the pool removed."""
    replicas = spawned or spawn_replicas(cfg, pool, path, version, role)
    try:
        ray_get([a.treadle_check.remote() for a in replicas])
    except BaseException:
        kill_replicas(replicas, pool)
        raise
    return replicas


def start_replica(
    cfg: Config, pool: ResourcePool, index: int, path: str, version: int, role: Role
) -> Any:
    """The :class:`RolloutReplica` actor on bundle ``index`` of ``pool`` (not waited for)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cpus, gpus = pool.cpus_per_rank, pool.gpus_per_rank
    threads = rank_threads(cfg, cpus)
    remote_cls: Any = ray.remote(guarded(RolloutReplica))  # type: ignore[arg-type]
    return remote_cls.options(
        num_cpus=cpus,
        num_gpus=gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pool.pg, placement_group_bundle_index=index
        ),
        runtime_env={"env_vars": ray_env(threads, gpus)},
    ).remote(index, config=cfg, model_path=path, version=version, threads=threads, role=role)


def kill_replicas(replicas: list[Any], pool: ResourcePool) -> None:
    """Kill replica actors and give their pool back."""
    import ray

    for a in replicas:
        ray.kill(a)
    pool.remove()
