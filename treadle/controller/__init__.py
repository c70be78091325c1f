"""The single controller: worker groups on resource pools, and where those pools go.

- :mod:`treadle.controller.groups`: how the driver calls N ranks as one object (dispatch,
  :class:`Worker`, :class:`WorkerGroup`, :class:`ResourcePool`).
- :mod:`treadle.controller.placement`: the :class:`Placement` record (bundles, CPUs and GPUs
  per rank, how many groups share the actors' bundles), decided once per run, and the
  start-up of groups on it (:class:`Actors`).

It imports neither rollout nor workers: both sit above it and place themselves on its pools.
"""

from treadle.controller.groups.dispatch import (
    Collect,
    Dispatch,
    MethodSpec,
    collect_results,
    dispatch_args,
    method_spec,
    register,
)
from treadle.controller.groups.failures import death_cause, peer_lost, pid_note, ray_get
from treadle.controller.groups.group import WorkerGroup
from treadle.controller.groups.pool import ResourcePool
from treadle.controller.groups.worker import Worker, device_type, free_port, guarded, tcp_store
from treadle.controller.placement import Actors, Placement, rank_threads, ray_env, start_group

__all__ = [
    "Actors",
    "Collect",
    "Dispatch",
    "MethodSpec",
    "Placement",
    "ResourcePool",
    "Worker",
    "WorkerGroup",
    "collect_results",
    "death_cause",
    "device_type",
    "dispatch_args",
    "free_port",
    "guarded",
    "method_spec",
    "peer_lost",
    "pid_note",
    "rank_threads",
    "ray_env",
    "ray_get",
    "register",
    "start_group",
    "tcp_store",
]
