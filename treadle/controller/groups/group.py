"""Worker groups: N ranks of one worker class, called from the driver as one object.

The driver owns the dataflow and calls methods on a :class:`WorkerGroup` as if it were one
object. A worker group is N Ray actors that form one torch.distributed process group; every
rank runs the same method on its share of the input, spread and gathered as the method's
:func:`~treadle.controller.groups.dispatch.register` says, so the driver never handles ranks::

    group = WorkerGroup(ActorWorker, world_size=2, pool=pool, kwargs={...})
    out = group.generate(prompts)  # split by rank, run on both, concatenated

``backend="local"`` builds the same worker class in the driver's process as rank 0 of a
one-rank process group, so a whole RL step can be stepped through with a debugger.

Choices: each rank is placed on its bundle of the pool, taking a ``share`` of it (colocated
groups split the bundles between them); rank 0 serves the rendezvous, on the driver's node
or wherever its bundle is. A rank whose process died is a
:class:`~treadle.runtime.errors.WorkerDied` naming the role, the rank and the cause (a dead
rank's peers fail too: the dead one is named, not them). A group that fails to start kills
all its ranks.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from treadle.controller.groups.dispatch import (
    MethodSpec,
    collect_results,
    dispatch_args,
    method_spec,
)
from treadle.controller.groups.failures import death_cause, peer_lost, pid_note, ray_get
from treadle.controller.groups.pool import ResourcePool
from treadle.controller.groups.worker import Worker, free_port, guarded
from treadle.protocol import Batch
from treadle.runtime.errors import WorkerDied


def _vllm_in_process() -> bool:
    """Whether this process holds a live vLLM engine (local mode). Its process groups are
    subgroups of the default one: destroying that under it made vLLM's own teardown at exit
    fail (``ValueError: Invalid process group specified``, a traceback after every run). The
    group is left to the engine, which lives as long as the process and destroys it at exit;
    the next run in the process joins it."""
    module = sys.modules.get("treadle.engines.vllm")
    return module is not None and module.engine_running()


def _probe_address() -> tuple[str, int]:
    import ray

    return ray.util.get_node_ip_address(), free_port()


def _rendezvous(pool: ResourcePool, options: dict[str, Any]) -> tuple[str, int]:
    """Where rank 0 (bundle 0 of ``pool``) serves its group's rendezvous: its node's address
    and a free port there. On the driver's own node the driver answers; elsewhere a task on
    bundle 0 (``options``: rank 0's) does, as on a multi-node cluster (measured: ~0.8 s, a
    worker process started for it)."""
    import ray
    from ray.util.placement_group import placement_group_table

    node = placement_group_table(pool.pg)["bundles_to_node_id"].get(0)
    here = ray.get_runtime_context().get_node_id()
    if node == here and not ray.util.client.ray.is_connected():
        return _probe_address()
    return ray.get(ray.remote(_probe_address).options(**options).remote())


class WorkerGroup:
    """N ranks of one worker class, called from the driver as one object."""

    def __init__(
        self,
        worker_cls: type[Worker],
        *,
        world_size: int,
        backend: str = "ray",
        pool: ResourcePool | None = None,
        kwargs: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        share: float = 1.0,
        wait: bool = True,
    ) -> None:
        """``share``: the fraction of each of the pool's bundles this group takes (colocated
        groups split the bundles between them). ``wait=False`` (Ray): the ranks' processes
        start, and :meth:`ready` waits for them (the driver meanwhile does other work)."""
        self.worker_cls, self.world_size, self.backend = worker_cls, world_size, backend
        self.dp_ranks: list[int] = [0]
        self.collects: list[bool] = [True]
        kwargs = kwargs or {}
        if backend == "local":
            if world_size != 1:
                raise ValueError("the local backend runs exactly one rank")
            self.workers: list[Any] = [worker_cls(0, 1, "127.0.0.1", free_port(), **kwargs)]
            self._starting: list[Any] | None = None
            return
        if pool is None:
            raise ValueError("the ray backend needs a ResourcePool")
        if world_size > pool.world_size:
            raise ValueError(f"{world_size} ranks do not fit a pool of {pool.world_size} bundles")
        self.workers = self._spawn(worker_cls, pool, kwargs, env or {}, share)
        self._starting = [w.treadle_check.remote() for w in self.workers]
        if wait:
            self.ready()

    def ready(self) -> WorkerGroup:
        """Wait (once) for the ranks to be built; if one fails, every rank is killed."""
        if self._starting is None:
            return self
        import ray

        try:
            self._get(self._starting, "while starting")
            # The data-parallel layout the ranks chose (tensor/sequence-parallel groups share
            # a shard): asked once, so the driver never handles ranks.
            layout = self._get([w.data_parallel.remote() for w in self.workers], "while starting")
        except BaseException:
            for w in self.workers:
                ray.kill(w)
            raise
        self._starting = None
        self.dp_ranks = [d for d, _ in layout]
        self.collects = [c for _, c in layout]
        return self

    def _spawn(
        self, cls: type[Worker], pool: ResourcePool, kwargs: dict, env: dict[str, str], share: float
    ) -> list[Any]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote_cls: Any = ray.remote(guarded(cls))

        def options(rank: int) -> dict[str, Any]:
            return {
                "num_cpus": pool.cpus_per_rank * share,
                "num_gpus": pool.gpus_per_rank * share,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    pool.pg, placement_group_bundle_index=rank
                ),
                "runtime_env": {"env_vars": env},
            }

        addr, port = _rendezvous(pool, options(0))
        return [
            remote_cls.options(**options(r)).remote(r, self.world_size, addr, port, **kwargs)
            for r in range(self.world_size)
        ]

    def __getattr__(self, name: str) -> Callable[..., Any]:
        spec = method_spec(getattr(self.worker_cls, name, None))
        if spec is None:
            raise AttributeError(f"{self.worker_cls.__name__}.{name} is not a registered method")
        return functools.partial(self._call, name, spec)

    def _call(self, name: str, spec: MethodSpec, *args: Any, **kw: Any) -> Any:
        method = f"{self.worker_cls.__name__}.{name}"

        def narrow(value: Any) -> Any:
            return spec.narrow(method, value) if isinstance(value, Batch) else value

        args = tuple(narrow(a) for a in args)
        kw = {k: narrow(v) for k, v in kw.items()}
        parts = dispatch_args(spec.dispatch, self.world_size, args, kw, self.dp_ranks)
        if self.backend == "local":
            results = [
                getattr(w, name)(*a, **k) for w, (a, k) in zip(self.workers, parts, strict=True)
            ]
        else:
            futures = [
                getattr(w, name).remote(*a, **k)
                for w, (a, k) in zip(self.workers, parts, strict=True)
            ]
            results = self._get(futures, f"during {name}")
        out = collect_results(spec.collect, results, self.collects)
        spec.check_returns(method, out)
        return out

    def _get(self, futures: list[Any], when: str) -> list[Any]:
        """``ray.get`` of one call on every rank; a rank whose process died (or ran out of
        memory) is a :class:`WorkerDied` naming the role, the rank and the cause."""
        import ray

        try:
            return ray_get(futures)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as first:
            died = self._died_of(first, when)
            if died is not None:
                raise died from None
            if peer_lost(first):
                # A rank that died fails its peers' collectives too ("connection reset by
                # peer"), which may be the error seen first: name the dead one.
                ready, _ = ray.wait(futures, num_returns=len(futures), timeout=30)
                for future in ready:
                    try:
                        ray.get(future)
                    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                        died = self._died_of(e, when)
                        if died is not None:
                            raise died from None
            # Otherwise the rank's own error (a full disk, a bug) is the cause. Its peers may
            # wait in a collective for it until they are killed: waiting for them adds nothing.
            raise first

    def find_dead(self, when: str, wait_s: float = 30.0) -> WorkerDied | None:
        """A :class:`WorkerDied` for a rank whose process is gone (each rank is pinged; one
        busy in a collective does not answer within ``wait_s`` and is not dead); None if none
        is found."""
        if self.backend == "local":
            return None
        import ray

        pings = [w.__ray_ready__.remote() for w in self.workers]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=wait_s)
        for ping in ready:
            try:
                ray.get(ping)
            except ray.exceptions.RayActorError as e:
                return WorkerDied(self.died(e, when))
        return None

    def _died_of(self, error: BaseException, when: str) -> WorkerDied | None:
        """A :class:`WorkerDied` for a Ray error that says a rank's process died or ran out
        of memory; None for any other."""
        import ray

        if isinstance(error, ray.exceptions.RayActorError):
            return WorkerDied(self.died(error, when))
        cause = getattr(error, "cause", None)
        if isinstance(cause, MemoryError | torch.OutOfMemoryError):
            return WorkerDied(self.died(cause, when, getattr(error, "_actor_id", None)))
        return None

    def died(self, error: BaseException, when: str, actor_id: str | None = None) -> str:
        """ "<role> rank <r> (pid <p>) died <when> (<cause>)"."""
        actor_id = actor_id or getattr(error, "actor_id", None)
        ids = [w._actor_id.hex() for w in self.workers]
        rank = str(ids.index(actor_id)) if actor_id in ids else "?"
        role = self.worker_cls.role or self.worker_cls.__name__
        return f"{role} rank {rank}{pid_note(error)} died {when} ({death_cause(error)})"

    def shutdown(self) -> None:
        if self.backend == "local":
            for w in self.workers:
                close = getattr(w, "close", None)
                if close:
                    close()
            if (
                all(w.owns_process_group for w in self.workers)
                and dist.is_initialized()
                and not _vllm_in_process()
            ):
                dist.destroy_process_group()
            return
        import ray

        for w in self.workers:
            ray.kill(w)
