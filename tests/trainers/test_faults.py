"""The fault-injection suite: kill -9 at start-up, after a step, during a checkpoint write, then
the same command again, ends with the weights and metrics of an uninterrupted run; a worker
that dies stops a Ray run with one line naming the role, the rank, the cause and how to resume,
and so does a full disk on one of two ranks while it writes a checkpoint;
nothing of a run is left 30 s after it ends, however it ends (the driver killed with SIGKILL
included); every socket a run listens on is on loopback.

Ctrl-C and SIGTERM: tests/trainers/test_signals.py; damaged checkpoints and two runs on one
directory: tests/trainers/test_run_dir.py; a replica killed: tests/rollout/test_fleet.py.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from treadle.cli import main
from treadle.runtime import reaper
from treadle.tracking.tracker import read_metrics


def _cli(task, out, reward, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "treadle",
        "train",
        "examples/arithmetic/grpo.yaml",
        f"reward.function={reward}",
        f"model.path={task['model']}",
        f"data.train_files=[{task['train']}]",
        "data.val_files=[]",
        "data.batch_size=4",
        "data.max_prompt_length=64",
        "rollout.n=4",
        "rollout.engine=hf",
        "rollout.max_new_tokens=16",
        "actor.lr=1e-3",
        "actor.ppo_mini_batch_size=16",
        "actor.micro_batch_size=16",
        "trainer.save_every=1",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        *extra,
    ]


def _env(failpoint: str | None) -> dict[str, str]:
    """This process's environment with ``failpoint`` as the run's only TREADLE_FAILPOINT."""
    env = {k: v for k, v in os.environ.items() if k != "TREADLE_FAILPOINT"}
    return {**env, "TREADLE_FAILPOINT": failpoint} if failpoint else env


def _run(args: list[str], failpoint: str | None = None) -> subprocess.CompletedProcess[str]:
    env = _env(failpoint)
    return subprocess.run(args, check=False, capture_output=True, text=True, env=env, timeout=300)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (session id, command line) of every live process (zombies left out)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if stat[0] != "Z":
            out[int(entry.name)] = (int(stat[3]), command)
    return out


def _session(sid: int) -> dict[int, str]:
    """pid -> command line of every process in session ``sid``."""
    return {pid: cmd for pid, (s, cmd) in _processes().items() if s == sid}


def _gone_within(sid: int, seconds: float) -> float:
    """Seconds until no process of session ``sid`` nor its reaper is left; fails after
    ``seconds``, naming what is left."""
    start = time.monotonic()
    while True:
        left = {
            pid: cmd
            for pid, (s, cmd) in _processes().items()
            if s == sid or f"treadle.runtime.reaper {sid} " in cmd
        }
        took = time.monotonic() - start
        if not left:
            return took
        assert took < seconds, f"left after {seconds} s: {left}"
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _listening(pids: set[int]) -> list[tuple[int, str]]:
    """(pid, address) of every TCP socket in LISTEN state that ``pids`` hold."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append((inodes[fields[9]], _address(fields[1])))
    return found


def _address(hex_address: str) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # /proc/net/tcp* holds the address as 32-bit words in host (little-endian) order
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return f"::ffff:{ip.ipv4_mapped}:{int(port, 16)}"
    return f"{ip}:{int(port, 16)}"


def _on_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].removeprefix("::ffff:")
    return ipaddress.ip_address(host).is_loopback


def test_address_decoding_and_loopback():
    assert _address("0100007F:1F90") == "127.0.0.1:8080"
    assert _address("00000000000000000000000000000000:0050") == ":::80"
    assert _address("0000000000000000FFFF00000100007F:0050") == "::ffff:127.0.0.1:80"
    assert _on_loopback("127.0.0.1:8080") and _on_loopback("::ffff:127.0.0.1:80")
    assert _on_loopback("::1:80")
    assert not _on_loopback("0.0.0.0:80") and not _on_loopback(":::80")
    assert not _on_loopback("192.0.2.2:80")


@pytest.mark.slow
def test_the_reaper_ends_what_a_killed_driver_leaves(tmp_path):
    """As Ray's raylet does, a child of the driver dies with it (PR_SET_PDEATHSIG) and leaves
    its own child behind, adopted by init; another child is in a session of its own. The
    driver dies by SIGKILL: both left-overs are gone within the reaper's interval + grace,
    and the reaper exits."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    middle = tmp_path / "middle.py"
    middle.write_text(
        textwrap.dedent(
            f"""
            import ctypes, subprocess, time
            ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG: SIGKILL when the parent dies
            print(subprocess.Popen({sleeper!r}).pid, flush=True)
            time.sleep(120)
            """
        )
    )
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(
            f"""
            import os, signal, subprocess, sys, time
            from treadle.runtime import reaper
            reaper.watch(interval=0.2, grace=1.0)
            own = subprocess.Popen({sleeper!r}, start_new_session=True)
            middle = subprocess.Popen([sys.executable, {str(middle)!r}], stdout=subprocess.PIPE)
            orphan = int(middle.stdout.readline())
            time.sleep(1.0)  # the reaper notes them
            print(own.pid, middle.pid, orphan, reaper._watching.pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(driver)], check=False, capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(x) for x in proc.stdout.split()]
    assert len(pids) == 4
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if _alive(p)]
        time.sleep(0.1)


def test_descendants_follow_the_tree_and_skip_the_roots():
    table = {1: (0, 5), 10: (1, 7), 11: (10, 8), 12: (11, 9), 20: (1, 3), 13: (12, 4)}
    assert reaper.descendants({10}, table) == {(11, 8), (12, 9), (13, 4)}
    assert reaper.descendants({12, 11}, table) == {(13, 4)}
    assert reaper.descendants({99}, table) == set()


@pytest.mark.slow
@pytest.mark.long
def test_kill_9_at_three_moments_then_rerun_equals_an_uninterrupted_run(
    tiny_task, length_reward, tmp_path
):
    """The local backend through the CLI: killed at start-up, after step 2's metrics (before
    its checkpoint) and while step 3's checkpoint is written (files there, no manifest); each
    time the same command goes on, and the last run's weights and metrics equal a run that
    was never interrupted."""
    straight, faulty = tmp_path / "straight", tmp_path / "faulty"
    local = ("trainer.backend=local", "trainer.total_steps=3")
    # the uninterrupted run goes beside the interrupted ones (its own directory; one process
    # each, mostly single-threaded start-up: the machine's other core does it)
    uninterrupted = _start(_cli(tiny_task, straight, length_reward, *local))
    try:
        args = _cli(tiny_task, faulty, length_reward, *local)
        for point in ("startup@0", "step@2", "checkpoint@3"):
            killed = _run(args, point)
            assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-3000:])
        _, stderr = uninterrupted.communicate(timeout=300)
    finally:
        if uninterrupted.poll() is None:
            uninterrupted.kill()
    assert uninterrupted.returncode == 0, stderr[-3000:]
    # the state the last kill left: step 3's metrics and an unsealed step-3 checkpoint
    assert [m["step"] for m in read_metrics(faulty)] == [1, 2, 3]
    assert sorted(p.name for p in (faulty / "checkpoints").iterdir()) == [
        "step_1",
        "step_2",
        "step_3.tmp",
    ]
    last = _run(args)
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"resumed from {faulty / 'checkpoints' / 'step_2'} (step 2)" in last.stdout.replace(
        "\n", ""
    )
    assert "took over the lock of a run that ended without releasing it" in last.stderr
    a, b = read_metrics(straight), read_metrics(faulty)
    assert [m["step"] for m in b] == [1, 2, 3]
    for ma, mb in zip(a, b, strict=True):
        timed = ("timing/", "throughput/", "startup/", "perf/tflops/", "perf/mfu/")
        kept = {k for k in ma if not k.startswith(timed)}
        assert {k: mb[k] for k in kept} == {k: ma[k] for k in kept}
    wa, wb = (
        load_file(straight / "final_model" / "model.safetensors"),
        load_file(faulty / "final_model" / "model.safetensors"),
    )
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _start(args: list[str], failpoint: str | None = None) -> subprocess.Popen[str]:
    env = {**_env(failpoint), "RAY_COLOR_PREFIX": "0"}
    env.pop("GOMP_SPINCOUNT", None)  # (conftest sets it): the run's processes get it from treadle
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen[str], seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not path.is_file():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.long
def test_a_dead_worker_and_a_killed_driver_leave_one_line_and_no_process(
    tiny_task, length_reward, tmp_path
):
    """Ray, two actor ranks. Run 1: every socket its processes listen on is on loopback; the
    actor's rank-1 process is killed with SIGKILL: exit 2, one last line naming the role, the
    rank, the cause and the checkpoint to resume from, no traceback, and no process of the run
    left. Run 2, the same command, resumes from that checkpoint; its driver is killed with
    SIGKILL after a step: within 30 s nothing of it is left (Ray's agents and workers
    included)."""
    out = tmp_path / "run"
    args = _cli(
        tiny_task,
        out,
        length_reward,
        "actor.world_size=2",
        "trainer.total_steps=200",
        "trainer.num_cpus=2",
    )
    proc = _start(args)
    try:
        _wait_for(out / "checkpoints" / "step_1" / "manifest.json", proc)
        session = _session(proc.pid)
        sockets = _listening(set(session))
        assert sockets, "no listening socket found: the check would be empty"
        assert [s for s in sockets if not _on_loopback(s[1])] == [], (sockets, session)
        gcs = [pid for pid, cmd in session.items() if "/gcs_server " in cmd]
        assert len(gcs) == 1, session  # Ray's token authentication is on for the run's cluster
        assert b"RAY_AUTH_MODE=token" in Path(f"/proc/{gcs[0]}/environ").read_bytes().split(b"\0")
        workers = [pid for pid, cmd in session.items() if cmd.startswith("ray::ActorRollout")]
        assert len(workers) == 2, session
        environ = Path(f"/proc/{workers[0]}/environ").read_bytes().split(b"\0")
        assert b"GOMP_SPINCOUNT=10000" in environ  # treadle.runtime.omp, through the worker's env
        os.kill(workers[1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    saved = max((out / "checkpoints").glob("step_*[0-9]"), key=lambda p: int(p.name[5:]))
    assert re.fullmatch(
        rf"treadle: error: step \d+: (actor rank [01]|rollout replica [01] \(actor rank [01]\)) "
        rf"\(pid {workers[1]}\) died during (\w+|a rollout|a weight sync) \(its "
        r"process ended without a Python error: killed \(SIGKILL, the kernel's out-of-memory "
        rf"killer\) or crashed\); the last checkpoint is {re.escape(str(saved))}: the same "
        r"command resumes from it",
        last,
    ), stderr[-3000:]
    assert stderr.strip().splitlines() == [last]  # Ray's own messages are in logs/
    worker_logs = {p.name.split("-")[0] for p in (out / "logs").glob("*.log")}
    assert {"driver.log", "actor"} <= worker_logs, worker_logs
    _gone_within(proc.pid, 30)

    proc = _start(args)
    try:
        step = int(saved.name[5:])
        _wait_for(out / "checkpoints" / f"step_{step + 1}" / "manifest.json", proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        stdout = proc.stdout.read() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"resumed from {saved} (step {step})" in stdout.replace("\n", "")
    took = _gone_within(proc.pid, 30)
    print(f"after the driver's SIGKILL, its processes were gone in {took:.1f} s")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))


@pytest.mark.slow
@pytest.mark.long
def test_a_full_disk_on_rank_0_of_two_stops_the_ray_run_and_the_rerun_resumes(
    tiny_task, length_reward, tmp_path, ray_session, capsys
):
    """Ray, two actor ranks: rank 0's model write of step 2's checkpoint fails as a full disk
    does, while rank 1 goes on into the checkpoint's collectives (the optimizer's gather). The
    run stops at once with one line naming the file and the cause, leaves no process and no
    partial checkpoint, prunes nothing; the same command resumes from step 1 and finishes (run
    again here, in this process, on the session's Ray: one Ray start fewer)."""
    out = tmp_path / "run"
    args = _cli(
        tiny_task,
        out,
        length_reward,
        "actor.world_size=2",
        "trainer.total_steps=2",
        "trainer.keep_last=1",
        "trainer.num_cpus=2",
    )
    started = time.monotonic()
    proc = _start(args, failpoint="write@2:ENOSPC")
    try:
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - started
    step_1 = out / "checkpoints" / "step_1"
    written = out / "checkpoints" / "step_2.tmp" / "model" / "model.safetensors"
    assert proc.returncode == 2, stderr[-3000:]
    assert stderr.strip().splitlines() == [
        f"treadle: error: checkpoint step 2: cannot write {written}: No space left on device "
        f"(ENOSPC); the last checkpoint is {step_1}: the same command resumes from it"
    ], stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
    _gone_within(proc.pid, 30)
    print(f"the run stopped {took:.1f} s after it started")

    capsys.readouterr()
    code = main(args[3:])  # (no TREADLE_FAILPOINT here: the session's Ray has none either)
    done = capsys.readouterr()
    assert code == 0, done.err[-3000:]
    assert f"resumed from {step_1} (step 1)" in done.out.replace("\n", "")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
