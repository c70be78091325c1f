"""Joining a running Ray cluster: which address wins, the errors, and real runs on a two-node
cluster (a head and a second raylet on this machine, loopback addresses, token auth on)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from treadle.config import load_config
from treadle.controller import cluster
from treadle.runtime.errors import ConfigError
from treadle.tracking.tracker import read_metrics

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GRPO = ROOT / "examples/arithmetic/grpo.yaml"
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")

# after the other tests: a node started beside other work (the soak's replicas) missed Ray's
# own fixed deadlines (tests/conftest.py); so would one beside another pytest-xdist process
pytestmark = pytest.mark.late


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(*overrides: str):
    return load_config(None, ["model.path=unused", "trainer.backend=ray", *overrides])


# --- which cluster: no Ray started -----------------------------------------------------------


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.init recorded instead of run; a 2-CPU cluster once 'joined'."""
    ray = pytest.importorskip("ray")
    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(cluster, "_check_reachable", lambda address, source: None)
    for var in AUTH_VARS:
        monkeypatch.delenv(var, raising=False)
    return calls


def test_config_address_wins_over_env(fake_ray, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6380")
    cluster.ensure_ray(config("trainer.ray_address=10.0.0.1:6380"))
    assert fake_ray[0]["address"] == "10.0.0.1:6380" and "num_cpus" not in fake_ray[0]


def test_env_address_joins(fake_ray, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6380")
    cfg = config()
    assert cluster.total_cpus(cfg) == 2.0  # the cluster's CPUs, not this machine's
    assert [c["address"] for c in fake_ray] == ["10.0.0.2:6380"]


@pytest.mark.parametrize("env", [None, "local"])
def test_no_address_starts_a_local_cluster(fake_ray, monkeypatch, env):
    if env:
        monkeypatch.setenv("RAY_ADDRESS", env)
    cluster.ensure_ray(config("trainer.num_cpus=3"))
    assert "address" not in fake_ray[0] and fake_ray[0]["num_cpus"] == 3
    # no idle workers ahead: none has a run process's environment (measured: a slower start)
    assert fake_ray[0]["_system_config"] == {"prestart_worker_first_driver": False}


def test_local_backend_ignores_the_address(fake_ray, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6380")
    cfg = load_config(None, ["model.path=unused", "trainer.backend=local", "trainer.num_cpus=1"])
    assert cluster.total_cpus(cfg) == 1.0 and not fake_ray


def test_num_cpus_within_the_cluster(fake_ray):
    assert cluster.total_cpus(config("trainer.ray_address=h:1", "trainer.num_cpus=1")) == 1.0
    with pytest.raises(ConfigError, match=r"trainer.num_cpus=4 is more than the 2 CPUs"):
        cluster.total_cpus(config("trainer.ray_address=h:1", "trainer.num_cpus=4"))


@pytest.mark.parametrize(
    ("driver", "cluster_gpus", "ranks_get"), [(False, 8.0, 1.0), (False, 0, 0.0)]
)
def test_the_clusters_gpus_decide_a_ranks_not_the_drivers(
    fake_ray, monkeypatch, driver, cluster_gpus, ranks_get
):
    """A driver on a CPU-only head node of a GPU cluster: its ranks get a GPU each (placed with
    none, each would see every GPU of its node and take GPU 0)."""
    from treadle.controller import Placement
    from treadle.trainers.launch import start_lines

    monkeypatch.setattr("torch.cuda.is_available", lambda: driver)
    monkeypatch.setattr("ray.cluster_resources", lambda: {"CPU": 2.0, "GPU": cluster_gpus})
    cfg = config("trainer.ray_address=h:1")
    assert Placement.plan(cfg).gpus_per_rank == ranks_get
    # the headline names the cluster, not the driver's device, and does not wait for Ray
    fake_ray.clear()
    headline = start_lines(cfg, Path("out"), "GRPO", (0, 5), None)[0]
    assert headline.endswith("on the Ray cluster at h:1, 1 rank(s)") and not fake_ray


@pytest.mark.parametrize("gpu", [True, False])
def test_the_headline_of_a_cluster_this_run_starts_names_this_machine_s_device(
    fake_ray, monkeypatch, gpu
):
    from treadle.trainers.launch import start_lines

    monkeypatch.setattr("torch.cuda.is_available", lambda: gpu)
    cfg = config("actor.world_size=2", "actor.sequence_parallel_size=2")
    headline = start_lines(cfg, Path("out"), "GRPO", (0, 5), None)[0]
    assert headline.endswith(f"on Ray, 2 {'GPU' if gpu else 'CPU'} rank(s) (sequence parallel 2)")


def test_a_driver_with_a_gpu_on_a_cluster_without_one_is_an_error(fake_ray, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"no GPU resource.*CUDA_VISIBLE_DEVICES="):
        cluster.use_gpus(config("trainer.ray_address=h:1"))
    # in-process, the driver's own GPU is the rank's
    assert cluster.use_gpus(load_config(None, ["model.path=unused", "trainer.backend=local"]))


def test_a_split_teacher_takes_the_clusters_gpus_and_vllm_needs_one(fake_ray, monkeypatch, caplog):
    from treadle.rollout import frozen

    monkeypatch.setattr("ray.cluster_resources", lambda: {"CPU": 8.0, "GPU": 2.0})
    pools: list[tuple] = []
    monkeypatch.setattr(frozen, "ResourcePool", lambda *a: pools.append(a))
    split = ["trainer.ray_address=h:1", "teacher.model_path=t", "teacher.placement=split"]
    cfg = config(*split, "teacher.gpus_per_replica=1")  # a driver without a GPU, the cluster's
    frozen.reserve_frozen_pool(cfg, cfg.teacher)
    assert pools == [(1, 1.0, 1.0)]
    cfg = config(*split, "teacher.engine=vllm")
    with pytest.raises(ConfigError, match=r"teacher.engine=vllm .* teacher.gpus_per_replica > 0"):
        frozen.reserve_frozen_pool(cfg, cfg.teacher)
    cfg = config(*split)  # the hf engine, no GPU asked for: it runs, on CPUs, and says so
    with caplog.at_level("WARNING", logger="treadle"):
        frozen.reserve_frozen_pool(cfg, cfg.teacher)
    assert pools[-1] == (1, 1.0, 0.0)
    assert (
        "teacher.gpus_per_replica=0 on a cluster with GPUs: the teacher replicas run on CPUs"
        in (caplog.text)
    )


def test_auth_refusal_is_one_line(fake_ray, monkeypatch):
    def refused(**kw):
        try:
            raise RuntimeError("Traceback ... RPC error: InvalidAuthToken: token is missing")
        except RuntimeError as e:
            raise ConnectionError("Failed to connect to Ray cluster at h:1") from e

    monkeypatch.setattr("ray.init", refused)
    with pytest.raises(ConfigError) as err:
        cluster.ensure_ray(config("trainer.ray_address=h:1"))
    msg = str(err.value)
    assert "\n" not in msg and "RAY_AUTH_MODE=token" in msg and "~/.ray/auth_token" in msg
    assert "trainer.ray_address" in msg


def test_unreachable_address_fails_fast(monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("ray.init called"))
    port = free_port()  # nobody listens there now
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"nothing answers at 127.0.0.1:{port} \(RAY_ADDRESS\)"):
        cluster.ensure_ray(config())
    assert time.monotonic() - start < 6


# --- a local cluster's daemons -----------------------------------------------------------------

# A driver that starts its own cluster (cluster.ensure_ray), has a Ray task print a line, then
# prints which of the head's daemons are its processes, and waits for a line on stdin to end.
_LOCAL = """
import json, sys
import psutil, ray
from treadle.controller import cluster
from treadle.config import load_config

verbose = sys.argv[1]
cfg = load_config(None, ["model.path=unused", "trainer.num_cpus=1", f"trainer.verbose={verbose}"])
cluster.ensure_ray(cfg)
ray.get(ray.remote(num_cpus=0)(lambda: print("hello from a worker", flush=True)).remote())
daemons = {"gcs_server": "gcs_server", "monitor": "autoscaler/_private/monitor.py",
           "log_monitor": "_private/log_monitor.py"}
running = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
print(json.dumps({k: any(v in c for c in running) for k, v in daemons.items()}), flush=True)
sys.stdin.readline()
"""


@pytest.fixture(scope="module")
def local_clusters(tmp_path_factory):
    """A driver of _LOCAL per verbosity, both started at the first test's start (a cluster's
    start-up is mostly one core: the two overlap); each waits for a line on stdin to end."""
    script = tmp_path_factory.mktemp("local") / "local.py"
    script.write_text(_LOCAL)
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    procs = {}
    for verbose in (False, True):
        procs[verbose] = subprocess.Popen(
            [sys.executable, str(script), str(verbose).lower()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env, start_new_session=True,
        )  # fmt: skip
    yield procs
    for proc in procs.values():
        with contextlib.suppress(BrokenPipeError, ValueError):  # (ended, or closed by its test)
            proc.communicate("\n", timeout=120)
        proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True])
def test_a_local_cluster_starts_no_autoscaler_and_a_log_monitor_only_when_verbose(
    local_clusters, verbose
):
    """The autoscaler's monitor of a cluster that never scales, and the log monitor that
    sends workers' output to a driver that does not ask for it, are not started (two daemons,
    ~1.7 CPU-s of every start); a verbose run still gets its workers' output."""
    proc = local_clusters[verbose]
    try:
        lines: list[str] = []
        wanted = ["{", *(["hello from a worker"] if verbose else [])]
        assert proc.stdout is not None
        while wanted:  # the process ends (readline: "") if it fails; the test's timeout else
            line = proc.stdout.readline()
            assert line, "".join(lines)[-3000:]
            lines.append(line)
            wanted = [w for w in wanted if not (line.startswith(w) or w in line)]
        daemons = json.loads(next(line for line in lines if line.startswith("{")))
        assert daemons == {"gcs_server": True, "monitor": False, "log_monitor": verbose}
    finally:
        with contextlib.suppress(BrokenPipeError):
            proc.communicate("\n", timeout=120)
        proc.kill()


# --- a real two-node cluster ------------------------------------------------------------------


@dataclass
class Cluster:
    address: str  # GCS, host:port
    dashboard: str  # http://host:port, for `ray job submit`
    env: dict[str, str]  # token auth on, for drivers and the ray CLI


def _start_node(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``ray start --block`` in a session of its own: its process group is the node's. A node
    that did not start is tried once more: the module runs as the background soak starts its
    replicas, and two full runs of the suite saw a node miss Ray's fixed 30 s for its raylet
    to register (ray/_private/node.py) or the head's GCS not answer a second node for 90 s."""
    for last in (False, True):
        proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--block", "--disable-usage-stats", *args],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop_node(proc)
                if last:
                    raise RuntimeError(f"ray start failed:\n{log.read_text()[-3000:]}")
                break
            time.sleep(0.5)
        else:
            return proc
    raise AssertionError("unreachable")


def _stop_node(*procs: subprocess.Popen) -> None:
    """SIGKILL to each node's process group (raylet, GCS, workers). Not SIGTERM first: `ray
    start --block` drains for up to 30 s on it (FINDINGS.md), and the 5 s this waited for it
    always ran out (the module's teardown took 5.25 s); a test cluster has nothing to save."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):  # a group may outlive its leader
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))


@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray")
    tmp = Path(tempfile.mkdtemp(prefix="trc", dir="/tmp"))  # short: Ray's socket paths
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    env |= {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),  # not ~/.ray/auth_token: this cluster's own
        "RAY_worker_niceness": "0",
        "RAY_COLOR_PREFIX": "0",
        "OMP_NUM_THREADS": "1",
    }
    port, dash = free_port(), free_port()
    loopback = [
        "--node-ip-address=127.0.0.1",
        "--num-cpus=1",
    ]
    nodes: list[subprocess.Popen] = []
    try:
        nodes.append(
            _start_node(
                [
                    "--head",
                    f"--port={port}",
                    f"--temp-dir={tmp / 'head'}",
                    "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={dash}",
                    f"--ray-client-server-port={free_port()}",
                    f"--dashboard-agent-listen-port={free_port()}",
                    *loopback,
                ],
                env,
                tmp / "head.log",
            )
        )
        nodes.append(
            _start_node(
                [
                    f"--address=127.0.0.1:{port}",
                    f"--temp-dir={tmp / 'node2'}",
                    f"--dashboard-agent-listen-port={free_port()}",
                    '--resources={"second_node": 1}',
                    *loopback,
                ],
                env,
                tmp / "node2.log",
            )
        )
        yield Cluster(f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}", env)
    finally:
        _stop_node(*nodes)
        shutil.rmtree(tmp, ignore_errors=True)


def run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def tiny_run(task: dict, out: Path, *extra: str) -> list[str]:
    """`treadle train` of the GRPO recipe at test size, two ranks: one on each 1-CPU node."""
    return [
        str(BIN / "treadle"),
        "train",
        str(GRPO),
        f"model.path={task['model']}",
        f"data.train_files=[{task['train']}]",
        f"data.val_files=[{task['test']}]",
        "data.batch_size=4",
        "data.val_size=4",
        "rollout.engine=hf",
        "rollout.n=4",
        "rollout.max_new_tokens=12",
        "actor.world_size=2",
        "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=8",
        "trainer.total_steps=2",
        "trainer.save_every=0",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.long
def test_train_joins_by_ray_address(ray_cluster, tiny_task, tmp_path):
    out = tmp_path / "run"
    env = ray_cluster.env | {"RAY_ADDRESS": ray_cluster.address}
    done = run(tiny_run(tiny_task, out), env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    # two 1-CPU ranks on two 1-CPU nodes: the run cannot have placed them on one
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


# rollout.ray_resources pins the replica to the node started with `second_node`; its pool is
# reserved first, so the actor takes the head's CPU; weights cross over the gloo group.
SECOND_NODE_REPLICA = (
    "actor.world_size=1",
    "rollout.placement=split",
    "rollout.replicas=1",
    "rollout.num_cpus=1",
    "rollout.ray_resources={second_node: 1}",
)


@pytest.mark.slow
@pytest.mark.long
def test_train_under_ray_job_submit_with_the_replica_on_the_second_node(
    ray_cluster, tiny_task, tmp_path
):
    """The job's driver joins the cluster it was submitted to (only that one has a node with
    `second_node`), and the split replica runs there."""
    out = tmp_path / "job"
    job_id = f"treadle-test-{secrets.token_hex(4)}"
    ray_cli = [str(BIN / "ray"), "job"]
    address = f"--address={ray_cluster.dashboard}"
    entrypoint = tiny_run(tiny_task, out, *SECOND_NODE_REPLICA)  # ray quotes each word
    cmd = [*ray_cli, "submit", address, f"--submission-id={job_id}", "--", *entrypoint]
    submit = run(cmd, ray_cluster.env, timeout=300)
    status = run([*ray_cli, "status", address, job_id], ray_cluster.env, timeout=60)
    assert f"Job '{job_id}' succeeded" in status.stdout, (
        submit.stdout[-4000:] + submit.stderr[-2000:]
    )
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1]
    assert all(m["rollout/weight_sync_bytes"] > 0 for m in metrics)


@pytest.mark.slow
@pytest.mark.long
def test_joining_without_the_token_is_one_clear_line(ray_cluster, tiny_task, tmp_path):
    env = {k: v for k, v in ray_cluster.env.items() if k not in AUTH_VARS}
    # Ray tries to connect once a second, 20 times by default, before ray.init gives up; every
    # try here is refused the same way (no token), so 2 tries give the same error (the refusal
    # is the last try's) without waiting out the other 18 s.
    env["RAY_gcs_server_port_wait_time_s"] = "2"
    cmd = tiny_run(tiny_task, tmp_path / "run", f"trainer.ray_address={ray_cluster.address}")
    done = run(cmd, env, timeout=120)
    assert done.returncode == 2, done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("treadle: error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-4000:]
    assert "RAY_AUTH_MODE=token" in errors[0] and "~/.ray/auth_token" in errors[0]
    assert f"at {ray_cluster.address} (trainer.ray_address)" in errors[0]
