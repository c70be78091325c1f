"""Where the test suite's CPU goes: by kind of process, start-up or not, and by test.

    python bench/suite_cpu.py [--top 30] [-- PYTEST ARGS]     (default: -m "not long")

Runs pytest in this checkout (one process) while a thread samples every process of the
machine twice a second (``/proc/<pid>/stat``: user + system time) and charges what each used
since the last sample to the test running then (its id, written by a small pytest plugin) and
to a kind read from its command line: the pytest process, a `treadle` command or other Python
child started by a test, a Ray worker (``ray::...``, its first ``ray::IDLE`` seconds included:
the actor class's imports happen before the worker takes its name), a Ray daemon (raylet,
GCS, dashboard agent, log monitor), a vLLM engine, mypy. A process's first 10 s are counted as
its start-up (``*`` in the table). Anything else the machine runs meanwhile is counted too:
run it on a quiet machine.

It prints the wall time, the CPU-seconds of all processes and their mean number of busy
cores, the CPU by kind, then the tests that used the most CPU with their wall time and their
biggest kinds. What to read from it: the mean number of busy cores says what running tests
in parallel could gain at most; the start-up share says what fewer or cheaper processes
would.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STARTUP_S = 10.0

# The first match names the kind (a test's tmp paths make many command lines contain "pytest":
# the pytest process itself is told by its pid). A Ray worker: ray::IDLE, then ray::<its class>.
KINDS = [
    ("ray::", "ray worker"),
    ("raylet", "ray daemons"),
    ("gcs_server", "ray daemons"),
    ("dashboard", "ray daemons"),
    ("log_monitor", "ray daemons"),
    ("monitor.py", "ray daemons"),
    ("runtime_env", "ray daemons"),
    ("EngineCore", "vllm engine"),
    ("mypy", "mypy"),
    ("-m treadle", "treadle command"),
    ("bin/treadle", "treadle command"),
    ("python", "other python"),
]


def kind(command: str) -> str:
    """The kind of a process from its command line (``/proc/<pid>/cmdline``, spaces)."""
    for needle, name in KINDS:
        if needle in command:
            return name
    return "other"


PLUGIN = """
import os
def pytest_runtest_logstart(nodeid, location):
    with open(os.environ["SUITE_CPU_CURRENT"], "w") as f:
        f.write(nodeid)
"""


class Sampler(threading.Thread):
    """CPU-seconds by (test, kind, start-up) of every process but this one."""

    def __init__(self, current: Path, pytest_pid: int) -> None:
        super().__init__(daemon=True)
        self.current, self.pytest_pid = current, pytest_pid
        self.used: dict[tuple[str, str, bool], float] = collections.defaultdict(float)
        self.stop = threading.Event()
        self.hz = os.sysconf("SC_CLK_TCK")
        stat = Path("/proc/stat").read_text()
        self.boot = float(stat.split("btime")[1].split()[0])

    def run(self) -> None:
        seen: dict[tuple[int, float], int] = {}
        while not self.stop.wait(0.5):
            test = self.current.read_text() if self.current.exists() else "(collection)"
            now, was, seen = time.time(), seen, {}
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit() or int(entry.name) == os.getpid():
                    continue
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                ticks = int(fields[11]) + int(fields[12])
                started = self.boot + int(fields[19]) / self.hz
                key = (int(entry.name), started)
                seen[key] = ticks
                young = now - started < STARTUP_S
                # a process born since the last sample: all its ticks; one there at the start
                # of the run: only what it uses from now on
                before = was.get(key, 0 if now - started < 1.0 else ticks)
                name = "pytest" if key[0] == self.pytest_pid else kind(command)
                if ticks > before:
                    self.used[(test, name, young)] += (ticks - before) / self.hz


def durations(log: str) -> dict[str, float]:
    """Seconds per test id from pytest's ``--durations=0`` lines (setup, call, teardown)."""
    found: dict[str, float] = collections.defaultdict(float)
    for line in log.splitlines():
        m = re.match(r"([\d.]+)s (?:call|setup|teardown)\s+(\S+)", line)
        if m:
            found[m[2]] += float(m[1])
    return found


def report(used: dict[tuple[str, str, bool], float], wall: float, log: str, top: int) -> str:
    total = sum(used.values())
    lines = [f"wall {wall:.0f} s, CPU {total:.0f} CPU-s: {total / wall:.2f} busy cores on average"]
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for (_, name, young), s in used.items():
        by_kind[name][0 if young else 1] += s
    lines.append(f"{'kind':<16} {'start-up':>9} {'after':>8} {'share':>6}")
    for name, (young, old) in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        share = (young + old) / total
        lines.append(f"{name:<16} {young:>9.0f} {old:>8.0f} {share:>6.0%}")
    startup = sum(s for (_, _, young), s in used.items() if young)
    lines.append(
        f"start-up (a process's first {STARTUP_S:.0f} s): {startup / total:.0%} of the CPU"
    )
    per_test: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float)
    )
    for (test, name, young), s in used.items():
        per_test[test][name + ("*" if young else "")] += s
    walls = durations(log)
    lines.append(f"\nthe {top} tests that used the most CPU (CPU-s, wall s; * start-up):")
    for test, kinds in sorted(per_test.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
        biggest = sorted(kinds.items(), key=lambda kv: -kv[1])[:4]
        parts = ", ".join(f"{k} {v:.0f}" for k, v in biggest)
        lines.append(
            f"{sum(kinds.values()):6.0f} {walls.get(test, 0.0):6.1f}  {test}\n        {parts}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("pytest_args", nargs="*", default=["-m", "not long"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as scratch:
        (Path(scratch) / "suite_cpu_plugin.py").write_text(PLUGIN)
        current = Path(scratch) / "current"
        env = {
            **os.environ,
            "SUITE_CPU_CURRENT": str(current),
            "PYTHONPATH": os.pathsep.join(filter(None, [scratch, os.environ.get("PYTHONPATH")])),
        }
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += ["-p", "suite_cpu_plugin", "--durations=0", *args.pytest_args]
        start = time.monotonic()
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        sampler = Sampler(current, proc.pid)
        sampler.start()
        log, _ = proc.communicate()
        wall = time.monotonic() - start
        sampler.stop.set()
        sampler.join()
    print(log.strip().splitlines()[-1] if log.strip() else "(no pytest output)")
    print(report(sampler.used, wall, log, args.top))
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
