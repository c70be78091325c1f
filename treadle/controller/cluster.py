"""Ray for a run: join a running cluster, or start one inside this run.

Which cluster. ``trainer.ray_address`` wins; else the ``RAY_ADDRESS`` environment variable (set
by the user, or by Ray itself for a driver that ``ray job submit`` started); else treadle starts
a one-node cluster that lives as long as the driver. ``"local"`` in either place also means the
latter. ``trainer.backend=local`` never touches Ray, whatever the address says.

Joining (``ray.init(address=...)``, no resources given: the cluster has them). The run's CPUs
are the cluster's CPU total, or ``trainer.num_cpus`` if set and no larger. Before Ray is asked,
a plain TCP connect to ``host:port`` checks that something listens there: Ray itself would
retry an unreachable address for minutes. Ray 2.60's ``ray start --head`` requires a token
wherever one exists (``~/.ray/auth_token``, which any local ``ray.init()`` writes), but a
driver given an explicit address only sends one under ``RAY_AUTH_MODE=token``; without it Ray
retries for ~20 s and raises a bare ``ConnectionError``. Both failures become one-line
ConfigErrors that say which variable to set and where the token lives. Ray itself sets
``RAY_ADDRESS`` (and passes the head's auth mode on) for a ``ray job submit`` driver.

Starting. ``ray.init(num_cpus=trainer.num_cpus or os.cpu_count())``, workers at nice 0, no
idle workers started ahead (Ray's one per CPU: a run's processes each have an environment of
their own, so none would be used), the dashboard only with ``trainer.ray_dashboard`` (on
127.0.0.1), no autoscaler monitor and no log monitor unless ``trainer.verbose`` (see
:func:`_fewer_daemons`), Ray's token authentication as Ray sets it (treadle never turns it
off). The node's
address is 127.0.0.1 (see :func:`_on_loopback`), and then every server of the cluster listens
on loopback only
(measured on Ray 2.60 with ``/proc/net/tcp``: GCS, raylet, dashboard and runtime-env agents,
worker and driver gRPC, the log and metrics exporters); so do the run's process groups
(:func:`treadle.controller.tcp_store`). Without it, Ray binds the GCS, raylets and workers to
all interfaces. A joined cluster keeps the address Ray gives its nodes: its servers and the
process groups' stores listen on every interface there. :func:`treadle.runtime.reaper.watch` ends
the cluster's processes however the driver ends (Ray's agents outlive a killed driver).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from treadle.config import Config
from treadle.runtime import reaper, startup
from treadle.runtime.errors import ConfigError
from treadle.runtime.faults import failpoint
from treadle.tracking.tracker import reroute_logs

TOKEN_FILE = "~/.ray/auth_token"


def ray_address(cfg: Config) -> tuple[str, str] | None:
    """(address, where it came from) of the cluster to join, or None to start one."""
    for address, source in (
        (cfg.trainer.ray_address, "trainer.ray_address"),
        (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS"),
    ):
        if address:
            return None if address == "local" else (address, source)
    return None


def total_cpus(cfg: Config) -> float:
    """The CPUs the run may use: trainer.num_cpus, else this machine's or the joined cluster's."""
    wanted = cfg.trainer.num_cpus
    joined = ray_address(cfg) if cfg.trainer.backend == "ray" else None
    if joined is None:
        return float(wanted or os.cpu_count() or 1)
    import ray

    ensure_ray(cfg)
    have = float(ray.cluster_resources().get("CPU", 0.0))
    if wanted is not None and wanted > have:
        raise ConfigError(
            f"trainer.num_cpus={wanted:g} is more than the {have:g} CPUs of the Ray cluster at "
            f"{joined[0]} ({joined[1]}): lower trainer.num_cpus or add nodes to the cluster"
        )
    return float(wanted or have)


def use_gpus(cfg: Config) -> bool:
    """Whether the run's ranks and split rollout replicas get GPUs (Ray bundles with GPUs).

    In-process, or on a cluster this run starts (whose GPUs are this machine's): whether this
    process sees one. On a joined cluster: whether the cluster has any, not whether the driver
    does: a driver on a CPU-only head node sees none while the workers' nodes have them, and
    its ranks, placed with no GPU, would each see every GPU of their node (Ray 2.60 leaves
    ``CUDA_VISIBLE_DEVICES`` alone for an actor with ``num_gpus=0``) and all take GPU 0. A
    driver that sees a GPU on a cluster with none is an error: its ranks would train on CPU."""
    import torch

    here = torch.cuda.is_available()
    joined = ray_address(cfg) if cfg.trainer.backend == "ray" else None
    if joined is None:
        return here
    import ray

    ensure_ray(cfg)
    gpus = float(ray.cluster_resources().get("GPU", 0.0))
    if here and not gpus:
        raise ConfigError(
            f"the driver sees a CUDA GPU but the Ray cluster at {joined[0]} ({joined[1]}) has "
            "no GPU resource, so every rank would train on CPU: start the nodes' Ray with their "
            "GPUs (`ray start --num-gpus=N`), or hide the GPU from the driver "
            "(CUDA_VISIBLE_DEVICES=) to train on CPU"
        )
    return gpus > 0


# The background start: its "ready" event, its "seconds" and the "error" it raised, if any.
_early: dict[str, Any] = {}


def start_ray_early(cfg: Config) -> None:
    """Start (or join) Ray in the background while the driver goes on (its imports, its
    data); :func:`ensure_ray` waits for it. Measured on SmolLM2 with vLLM: Ray takes 5-15 s
    to start, the driver's own work before it needs Ray 3-10 s.

    The starting thread stays alive, blocked, until the process ends: Ray starts its GCS and
    raylet with ``PR_SET_PDEATHSIG``, which kills them when the *thread* that started them
    ends, not the process."""
    main = threading.current_thread() is threading.main_thread()
    if cfg.trainer.backend != "ray" or _early or not main:
        return
    import ray

    if ray.is_initialized():
        return
    ready = threading.Event()

    def start() -> None:
        began = time.perf_counter()
        try:
            with _ray_messages_to_run_logs(cfg):
                _start(cfg)
            failpoint("ray")
        except BaseException as e:
            _early["error"] = e
        finally:
            _early["seconds"] = time.perf_counter() - began
            ready.set()
        threading.Event().wait()

    _early.update(ready=ready)
    threading.Thread(target=start, name="treadle-ray-start", daemon=True).start()


def settle() -> None:
    """Wait for a background start still under way (the command ended before it needed Ray,
    stopped by a signal): Ray's exit handler would shut the half-started cluster down under
    the starting thread, which then fails slowly and loudly (GCS connection warnings)."""
    ready = _early.get("ready")
    if ready is not None:
        ready.wait(timeout=120)


def ensure_ray(cfg: Config) -> None:
    """Connect this driver to Ray once: join the configured cluster or start a local one."""
    import ray

    if "ready" in _early:  # started in the background: wait for it (once)
        _early.pop("ready").wait()
        startup.mark("ray")  # what the driver waited for it
        startup.detail("ray", {"background": _early.pop("seconds")})
        if "error" in _early:
            raise _early.pop("error")
    if ray.is_initialized():
        return
    with _keep_sigterm_handler():
        _start(cfg)
    startup.mark("ray")


def _start(cfg: Config) -> None:
    import ray
    from ray._private import ray_constants

    reroute_logs()  # Ray's import put its console handler on its loggers
    # Ray's core worker would install its C++ failure handler in this process, SIGTERM
    # included: it aborts the driver (exit -6, a stack dump) instead of stopping it. Started in
    # the background, nothing could put ours back until ensure_ray: a SIGTERM in between was
    # lost. Off in the driver only (the workers read the environment variable, not this).
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    joined = ray_address(cfg)
    with _rerouted():
        if joined is not None:
            _join(*joined, verbose=cfg.trainer.verbose)
            return
        # Ray starts workers at nice 15; ours do the run's compute and must not yield to
        # every other process on the machine (measured: 15-30x slower steps under load).
        os.environ.setdefault("RAY_worker_niceness", "0")
        reaper.watch()  # before the first Ray process: a kill -9 at start-up leaves nothing
        with _on_loopback(), _fewer_daemons(log_monitor=cfg.trainer.verbose):
            ray.init(
                num_cpus=int(total_cpus(cfg)),
                include_dashboard=cfg.trainer.ray_dashboard,
                dashboard_host="127.0.0.1",
                log_to_driver=cfg.trainer.verbose,  # else the workers write to <output_dir>/logs
                configure_logging=False,
                # no idle worker per CPU: every process of a run has an environment of its own
                # (ray_env), which such a worker lacks; starting them slowed Ray's start
                _system_config={"prestart_worker_first_driver": False},
            )


@contextmanager
def _ray_messages_to_run_logs(cfg: Config) -> Iterator[None]:
    """Ray's messages while it starts in the background, before the run routes its logs
    (``treadle.tracking.tracker.route_logs``): to the same ``<output_dir>/logs/driver.log``."""
    if cfg.trainer.verbose:
        yield
        return
    logs = Path(cfg.trainer.output_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(logs / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("ray._private")  # where Ray's start-up messages come from
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        handler.close()


@contextmanager
def _rerouted() -> Iterator[None]:
    """``ray.init(configure_logging=False)`` empties the "ray" logger's handlers, and Python
    then prints its warnings on stderr (``logging.lastResort``): route them again after."""
    try:
        yield
    finally:
        reroute_logs()


@contextmanager
def _on_loopback() -> Iterator[None]:
    """A one-node cluster whose node address is 127.0.0.1: Ray's servers (GCS, raylet, workers,
    agents) then listen on loopback only. Ray refuses 127.0.0.1 as ``_node_ip_address`` on
    Linux, but takes it when its "no clusters on this OS" switch is on, which does nothing else
    (it only decides this address). Set while the cluster starts (its processes inherit it),
    then put back: joining another cluster later needs the real address."""
    from ray._private import ray_constants

    key = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    before = os.environ.get(key), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[key], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before[1]
        if before[0] is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before[0]


@contextmanager
def _fewer_daemons(log_monitor: bool) -> Iterator[None]:
    """A local cluster's head without the autoscaler's monitor (a cluster treadle starts never
    scales) and, unless ``log_monitor``, without the log monitor (it sends the workers' output
    to a driver that asks for it: ``trainer.verbose``; else they write to the run's logs).
    ``ray.init`` has no switch for them; the parameters it builds have (``no_monitor``,
    ``include_log_monitor``). Two daemons fewer: ~1.7 CPU-s less at start-up, when every core
    is busy, and the log monitor's ~0.6 CPU-s a minute (FINDINGS.md)."""
    from ray._private import parameter

    build = parameter.RayParams.__init__

    def fewer(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("no_monitor", True)
        kwargs.setdefault("include_log_monitor", log_monitor)
        build(self, *args, **kwargs)

    parameter.RayParams.__init__ = fewer  # type: ignore[method-assign]
    try:
        yield
    finally:
        parameter.RayParams.__init__ = build  # type: ignore[method-assign]


@contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """``ray.init`` on the main thread sets Ray's own SIGTERM handler (``sys.exit``); put the
    one before back (the command line's: stop like Ctrl-C). Ray's C++ one is off (_start)."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(handler) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)


def _join(address: str, source: str, verbose: bool) -> None:
    import ray
    from ray.exceptions import AuthenticationError

    _check_reachable(address, source)
    where = f"the Ray cluster at {address} ({source})"
    try:
        ray.init(address=address, log_to_driver=verbose, configure_logging=False)
    except AuthenticationError as e:  # token mode on, but no token on this machine
        raise ConfigError(f"{where}: {_token_hint(rejected=False)}") from e
    except ConnectionError as e:
        if _is_auth_failure(e):
            raise ConfigError(f"{where} refused this driver: {_token_hint(rejected=True)}") from e
        raise ConfigError(
            f"could not join {where}: {e}; check the address and `ray status --address={address}`"
        ) from e


def _token_hint(rejected: bool) -> str:
    token_on = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
    if token_on and rejected:
        return (
            f"its auth token differs from this machine's: copy the head's {TOKEN_FILE} here "
            "(or point RAY_AUTH_TOKEN_PATH at it, or set RAY_AUTH_TOKEN)"
        )
    if token_on:
        return (
            f"RAY_AUTH_MODE=token but no auth token here: copy the head's {TOKEN_FILE} to this "
            "machine's (or point RAY_AUTH_TOKEN_PATH at it, or set RAY_AUTH_TOKEN)"
        )
    return (
        f"it requires its auth token; run with RAY_AUTH_MODE=token and the head's {TOKEN_FILE} "
        "readable here (or RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH)"
    )


def _is_auth_failure(e: BaseException) -> bool:
    """Ray wraps the GCS's auth refusal in a ConnectionError whose cause holds the traceback."""
    from ray.exceptions import AuthenticationError

    cause: Any = e.__cause__
    return isinstance(cause, AuthenticationError) or "InvalidAuthToken" in str(cause)


def _check_reachable(address: str, source: str) -> None:
    """Fail in seconds where Ray would retry an address nobody listens on for minutes."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return  # "auto", ray://...: Ray's own lookup
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise ConfigError(
            f"nothing answers at {address} ({source}): {e.strerror or e}; start a head there "
            f"with `ray start --head --port={port}`, fix the address, or unset it to let "
            "treadle start a local cluster"
        ) from e
