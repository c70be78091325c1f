"""Single controller, SPMD workers: resource pools, worker groups and dispatch.

The driver owns the dataflow and calls methods on a :class:`WorkerGroup` as if it were one
object. A worker group is N Ray actors that form one torch.distributed process group; every
rank runs the same method on its share of the input. How a call's arguments are spread over
the ranks and how the ranks' results are gathered is declared once, on the worker method,
with :func:`register`, so the driver never handles ranks. So are the batch fields the method
reads and returns: only the fields it reads cross to the ranks (a rollout's text does not
travel to the actor's update), a missing one fails on the driver naming the method and the
field, and a returned batch must hold what the method declares::

    class ActorWorker(Worker):
        @register(Dispatch.DP, Collect.CONCAT, reads=("prompts", "prompt_mask"),
                  returns=("responses", "response_mask"))
        def generate(self, batch: Batch) -> Batch: ...

    group = WorkerGroup(ActorWorker, world_size=2, pool=pool, kwargs={...})
    out = group.generate(prompts)  # split by rank, run on both, concatenated

``backend="local"`` builds the same worker class in the driver's process as rank 0 of a
one-rank process group, so a whole RL step can be stepped through with a debugger.

Resource pools are Ray placement groups; roles that share a pool are colocated (here: one
fused worker class per process holds actor, rollout engine and reference). Several worker
groups can also share a pool's bundles, each its own processes and process group: each asks
for a ``share`` of every bundle (the critic and the actor take half each), so Ray places rank r
of both on bundle r, and the driver calls them in turn.
"""

from __future__ import annotations

import datetime
import enum
import functools
import os
import random
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from treadle.protocol import Batch
from treadle.runtime.errors import TreadleError, WorkerDied
from treadle.tracking.tracker import redirect_output

F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(enum.Enum):
    ALL = "all"  # every rank gets the same arguments
    # Batch arguments are cut into contiguous chunks, one per data-parallel rank; the ranks of
    # one tensor- or sequence-parallel group get the same chunk
    DP = "dp"


class Collect(enum.Enum):
    RANK0 = "rank0"  # rank 0's result
    # CONCAT, MEAN and LIST take one result per data-parallel rank (the first rank of each
    # tensor- or sequence-parallel group answers for it), in rank order
    CONCAT = "concat"  # Batch results concatenated
    MEAN = "mean"  # dicts of numbers averaged
    LIST = "list"  # the results as a list


_ATTR = "_treadle_dispatch"


@dataclass(frozen=True)
class MethodSpec:
    """What :func:`register` declares about a worker method (see there)."""

    dispatch: Dispatch
    collect: Collect
    reads: tuple[str, ...] | None = None
    optional: tuple[str, ...] = ()
    returns: tuple[str, ...] | None = None

    def narrow(self, method: str, batch: Batch) -> Batch:
        """The fields of ``batch`` this method reads (no copy), or all of them if undeclared."""
        if self.reads is None:
            return batch
        missing = [k for k in self.reads if k not in batch]
        if missing:
            raise KeyError(
                f"{method} reads {missing}, which the batch does not have; it has {batch.keys()}"
            )
        keys = [*self.reads, *(k for k in self.optional if k in batch)]
        return batch.only(
            [k for k in keys if k in batch.tensors], [k for k in keys if k in batch.objects]
        )

    def check_returns(self, method: str, result: Any) -> None:
        """A returned batch holds every declared field, and nothing undeclared but what the
        method read (``returns`` lists what it adds; a method may hand its input back)."""
        if self.returns is None or not isinstance(result, Batch):
            return
        missing = [k for k in self.returns if k not in result]
        allowed = {*self.returns, *(self.reads or ()), *self.optional}
        extra = [k for k in result if k not in allowed]
        if missing or extra:
            raise ValueError(
                f"{method} declares returns={list(self.returns)} but returned {result.keys()}"
                + (f"; missing {missing}" if missing else "")
                + (f"; undeclared {extra}" if extra else "")
            )


def register(
    dispatch: Dispatch = Dispatch.ALL,
    collect: Collect = Collect.RANK0,
    *,
    reads: Sequence[str] | None = None,
    optional: Sequence[str] = (),
    returns: Sequence[str] | None = None,
) -> Callable[[F], F]:
    """Declare how a worker method's input is spread over ranks and its output gathered.

    ``reads``: the batch fields (tensors or objects) the method reads from every
    :class:`Batch` argument; only those (and ``optional`` ones, when the batch has them)
    are sent, with the batch's meta, and a missing one is a ``KeyError`` naming the method
    and the field. ``None`` (the default) sends whole batches. ``returns``: the fields a
    returned batch adds, checked on the driver.
    """
    spec = MethodSpec(
        dispatch,
        collect,
        tuple(reads) if reads is not None else None,
        tuple(optional),
        tuple(returns) if returns is not None else None,
    )

    def wrap(fn: F) -> F:
        setattr(fn, _ATTR, spec)
        return fn

    return wrap


def method_spec(method: Any) -> MethodSpec | None:
    """The declaration :func:`register` put on a worker method, if any."""
    return getattr(method, _ATTR, None)


def dispatch_args(
    mode: Dispatch,
    world_size: int,
    args: tuple,
    kwargs: dict,
    dp_ranks: Sequence[int] | None = None,
) -> list[tuple]:
    """Per-rank (args, kwargs). DP cuts every Batch argument into one chunk per data-parallel
    rank; ``dp_ranks[r]`` is rank r's (default: its own rank, every rank its own chunk)."""
    if mode is Dispatch.ALL:
        return [(args, kwargs)] * world_size
    dp_ranks = list(range(world_size)) if dp_ranks is None else list(dp_ranks)
    shards = max(dp_ranks) + 1

    def cut(value: Any) -> list[Any]:
        if isinstance(value, Batch):
            if len(value) % shards:
                raise ValueError(
                    f"batch of {len(value)} samples cannot be split evenly over "
                    f"{shards} data-parallel ranks; pad it first (Batch.pad_to_multiple)"
                )
            return value.chunk(shards)
        return [value] * shards

    arg_parts = [cut(a) for a in args]
    kw_parts = {k: cut(v) for k, v in kwargs.items()}
    return [
        (tuple(p[d] for p in arg_parts), {k: v[d] for k, v in kw_parts.items()}) for d in dp_ranks
    ]


def collect_results(
    mode: Collect, results: list[Any], collects: Sequence[bool] | None = None
) -> Any:
    """The call's result from every rank's ``results``; ``collects[r]``: whether rank r answers
    for its data-parallel rank (default: every rank does)."""
    if mode is Collect.RANK0:
        return results[0]
    if collects is not None:
        results = [r for r, keep in zip(results, collects, strict=True) if keep]
    if mode is Collect.CONCAT:
        return Batch.concat(results)
    if mode is Collect.MEAN:
        keys = results[0].keys()
        return {k: sum(float(r[k]) for r in results) / len(results) for k in keys}
    return results


# ----------------------------------------------------------------------------- workers


def free_port() -> int:
    """A port free now for a group's rendezvous, taken at random below the kernel's ephemeral
    range (and above Ray's worker ports, 10002-19999): the port is bound again only when the
    group's rank 0 starts, and one from the ephemeral range may be handed meanwhile to any
    process's outgoing connection (measured: EADDRINUSE on a loaded machine)."""
    low = _ephemeral_start()
    pick = random.SystemRandom()  # not the run's seeded RNG: every process would pick alike
    for _ in range(64):
        port = pick.randrange(20000, low) if low > 20001 else 0
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def device_type() -> str:
    """'cuda' when a GPU is visible to this process, else 'cpu'. Asked once, used everywhere."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def tcp_store(
    addr: str, port: int, world_size: int, rank: int, timeout: datetime.timedelta
) -> dist.TCPStore:
    """The rendezvous store of a process group, served by rank 0 at ``addr:port``.

    A group whose rendezvous is 127.0.0.1 is all on this machine, and then listens on loopback
    only: the store on a socket bound here (torch's own server binds every interface) and
    gloo's connections on ``lo`` (by default it binds the address of the host's name)."""
    fd = None
    if addr in ("127.0.0.1", "localhost") and Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if rank == 0:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(128)
            fd = sock.detach()  # the store owns it from here
    return dist.TCPStore(
        addr,
        port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=fd,
    )


class Worker:
    """Base of every SPMD worker: joins the group's torch.distributed process group.

    gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo for CPU ones (counts, metrics). In
    local mode the group has one rank in this process.
    ``role`` names the group in messages ("actor rank 1 died ...").
    """

    role: ClassVar[str] = ""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        self.rank, self.world_size = rank, world_size
        # Which shard of a DP-dispatched batch this rank reads, and whether its result is
        # collected: a worker with tensor- or sequence-parallel groups sets them
        # (:meth:`treadle.engines.parallel.Layout.data_parallel`).
        self.dp_rank, self.collects = rank, True
        self.device = torch.device(device_type())
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(0)  # Ray gives each rank exactly one visible GPU
        # Only a group this worker made is its to destroy (an in-process vLLM may make one).
        self.owns_process_group = not dist.is_initialized()
        if self.owns_process_group:
            timeout = datetime.timedelta(minutes=30)  # torch's default for a process group
            # On GPUs, CPU tensors (token counts, metrics) take gloo, CUDA tensors NCCL.
            dist.init_process_group(
                backend="cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo",
                rank=rank,
                world_size=world_size,
                store=tcp_store(master_addr, master_port, world_size, rank, timeout),
                timeout=timeout,
            )

    def data_parallel(self) -> tuple[int, bool]:
        """``(dp_rank, collects)``: read by the :class:`WorkerGroup` once, after start-up."""
        return self.dp_rank, self.collects

    @register(Dispatch.ALL, Collect.RANK0)
    def startup_seconds(self) -> dict[str, float]:
        """Seconds each part of rank 0's construction took, where the class keeps them
        (``_startup_parts``): ``bench/startup.py`` splits the workers' start-up with them."""
        return dict(getattr(self, "_startup_parts", {}))


def guarded(cls: type[Worker]) -> type[Worker]:
    """``cls`` whose construction keeps a user-fixable error for ``treadle_check`` to raise.

    Ray reports an exception in an actor's ``__init__`` only as "the actor died"; kept and
    raised from a method call, it reaches the driver as itself (config key, file, row...).
    """

    class Guarded(cls):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            redirect_output(getattr(cls, "role", "") or cls.__name__)  # to <output_dir>/logs/
            self._treadle_init_error: TreadleError | None = None
            try:
                if "config" in kwargs:  # names the worker resolves may be a plug-in's
                    from treadle.runtime.plugins import load_plugins

                    load_plugins(kwargs["config"].algorithm.plugins)
                super().__init__(*args, **kwargs)
            except TreadleError as e:
                self._treadle_init_error = e

        def treadle_check(self) -> None:
            if self._treadle_init_error is not None:
                raise self._treadle_init_error

    Guarded.__name__ = Guarded.__qualname__ = cls.__name__
    return Guarded


def _vllm_in_process() -> bool:
    """Whether this process holds a live vLLM engine (local mode). Its process groups are
    subgroups of the default one: destroying that under it made vLLM's own teardown at exit
    fail (``ValueError: Invalid process group specified``, a traceback after every run). The
    group is left to the engine, which lives as long as the process and destroys it at exit;
    the next run in the process joins it."""
    module = sys.modules.get("treadle.engines.vllm")
    return module is not None and module.engine_running()


def ray_get(futures: list[Any]) -> list[Any]:
    """``ray.get`` that re-raises a worker's user-fixable error as itself, not wrapped."""
    import ray

    try:
        return list(ray.get(futures))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, TreadleError):
            raise e.cause from None
        raise


# What a rank's collective raises when a peer's process is gone (gloo's TCP pair, NCCL).
PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ncclRemoteError",
)


def peer_lost(error: BaseException) -> bool:
    """Whether a rank's error says one of its peers is gone (the peer's death is the cause)."""
    said = f"{error} {getattr(error, 'cause', '')}"  # a Ray task error: the rank's traceback
    return any(text in said for text in PEER_LOST)


def pid_note(error: BaseException) -> str:
    """`` (pid N)`` of the process a Ray actor error names, or nothing."""
    lines = [line.strip() for line in str(error).splitlines()]
    pid = next((line.split()[-1] for line in lines if line.startswith("pid:")), None)
    return f" (pid {pid})" if pid else ""


def death_cause(error: BaseException) -> str:
    """Why a Ray actor's process is gone, in words, from Ray's long message."""
    text = str(error)
    if "RAY_memory_usage_threshold" in text:
        return "killed by Ray's memory monitor: the node ran low on memory"
    if "unexpectedly exits" in text or "SIGKILL" in text:
        return (
            "its process ended without a Python error: killed (SIGKILL, the kernel's "
            "out-of-memory killer) or crashed"
        )
    if isinstance(error, MemoryError | torch.OutOfMemoryError):
        return f"out of memory: {str(error).splitlines()[0][:200] if text else 'MemoryError'}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__).rstrip(".")[:300]


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


@dataclass
class ResourcePool:
    """A Ray placement group with one bundle per rank; roles sharing it are colocated.

    ``resources``: Ray custom resources every bundle also holds, which places the pool on the
    nodes started with them (``ray start --resources='{"rollout": 2}'``)."""

    world_size: int
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        bundle: dict[str, float] = {"CPU": self.cpus_per_rank, **self.resources}
        if self.gpus_per_rank:
            bundle["GPU"] = self.gpus_per_rank
        self.pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            free = {k: v for k, v in ray.available_resources().items() if "memory" not in k}
            raise TreadleError(
                f"{self.world_size} bundles of {bundle} did not fit the Ray cluster in 120 s "
                f"(free now: {free}): ask for fewer CPUs/GPUs (trainer.num_cpus, "
                "rollout.num_cpus, rollout.replicas) or add nodes"
            ) from None

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


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
