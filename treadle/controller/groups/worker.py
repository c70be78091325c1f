"""A rank: the base class of every SPMD worker, and the rendezvous of its process group.

:class:`Worker` joins the group's torch.distributed process group when it is built: gloo on
CPU; on CUDA, NCCL for CUDA tensors and gloo for CPU ones (counts, metrics). In local mode the
group has one rank in the driver's process; a default group already there (an in-process vLLM
engine's) is used as it is, and only a group the worker made is its to destroy.
:func:`guarded` wraps a worker class so that a user-fixable error in its construction reaches
the driver as itself, not as Ray's "the actor died".

Choices: the rendezvous port is drawn at random below the kernel's ephemeral range
(:func:`free_port`: one from that range may be handed to any outgoing connection before rank 0
binds it again), and a group whose rendezvous is 127.0.0.1 listens on loopback only
(:func:`tcp_store`). The device is asked once (:func:`device_type`).
"""

from __future__ import annotations

import datetime
import functools
import os
import random
import socket
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from treadle.controller.groups.dispatch import Collect, Dispatch, method_spec, register
from treadle.runtime.errors import TreadleError
from treadle.tracking import profiler
from treadle.tracking.profiler import phase
from treadle.tracking.tracker import peak_memory, redirect_output


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


def gpu_index() -> int:
    """The index, among the GPUs this process sees, of the one Ray gave it: 0 where Ray set
    ``CUDA_VISIBLE_DEVICES`` to it (its default, fractional shares included); under
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``, where every GPU of the node stays visible,
    the place of its id (``ray.get_gpu_ids()``) among them. 0 outside a Ray worker."""
    ray = sys.modules.get("ray")  # (not imported here: the local backend runs without Ray)
    noset = os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "")
    if ray is None or noset.lower() not in ("1", "true") or not ray.is_initialized():
        return 0
    ids = [str(i) for i in ray.get_gpu_ids()]  # (in Ray's order: the first is the rank's)
    if not ids:
        return 0
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    return visible.index(ids[0]) if ids[0] in visible else int(ids[0])


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
            torch.cuda.set_device(gpu_index())  # the one GPU Ray gave this rank
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

    @register(Dispatch.ALL, Collect.LIST)
    def start_profile(self, folder: str) -> None:
        """Profile this rank's work until :meth:`stop_profile` (``trainer.profile_steps``)."""
        profiler.begin(folder, f"{role_name(type(self))}-rank{self.rank}")

    @register(Dispatch.ALL, Collect.LIST)
    def stop_profile(self) -> list[str]:
        """Stop the profile :meth:`start_profile` began; the files it wrote."""
        return profiler.end()

    @register(Dispatch.ALL, Collect.RANK0)
    def startup_seconds(self) -> dict[str, float]:
        """Seconds each part of rank 0's construction took, where the class keeps them
        (``_startup_parts``): ``bench/startup.py`` splits the workers' start-up with them."""
        return dict(getattr(self, "_startup_parts", {}))


def guarded(cls: type[Worker]) -> type[Worker]:
    """``cls`` whose construction keeps a user-fixable error for ``treadle_check`` to raise.

    Ray reports an exception in an actor's ``__init__`` only as "the actor died"; kept and
    raised from a method call, it reaches the driver as itself (config key, file, row...).
    Its registered methods are ranges ``treadle/<role>.<method>`` of a profile
    (:func:`treadle.tracking.profiler.phase`), and those that return metrics (``Collect.MEAN``)
    add their peak device memory to them on a GPU (:func:`_observed`).
    """

    class Guarded(cls):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            redirect_output(role_name(cls))  # to <output_dir>/logs/
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

    role = role_name(cls)
    for name in dir(cls):
        spec = method_spec(getattr(cls, name))
        if spec is not None:
            method = _observed(getattr(cls, name), name, spec.collect is Collect.MEAN, role)
            setattr(Guarded, name, method)
    Guarded.__name__ = Guarded.__qualname__ = cls.__name__
    return Guarded


def role_name(cls: type) -> str:
    """A worker class's ``role`` (a guarded class need not be a :class:`Worker`: a rollout
    replica), or its name when it has none; spaces as ``_`` (it names files)."""
    return (getattr(cls, "role", "") or cls.__name__).replace(" ", "_")


def _observed(method: Any, name: str, metrics: bool, role: str) -> Any:
    """``method`` as the range ``treadle/<role>.<name>`` of a profile under way, and, when it
    returns ``metrics``, with its peak device memory added to them on a GPU: in a Ray worker,
    which the driver's phase timers cannot see (:mod:`treadle.tracking.tracker`)."""

    @functools.wraps(method)
    def observed(self: Worker, *args: Any, **kwargs: Any) -> Any:
        peaks: dict[str, float] = {}
        with (
            phase(f"{role}.{name}"),
            peak_memory(peaks, name, step=False) if metrics else nullcontext(),
        ):
            result = method(self, *args, **kwargs)
        return {**result, **peaks} if metrics else result

    return observed
