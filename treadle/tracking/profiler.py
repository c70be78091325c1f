"""torch.profiler over the steps ``trainer.profile_steps`` names, in every process that does the
step's work: a trace to open in Perfetto (ui.perfetto.dev) or chrome://tracing, and a table of
the operators that took the most time.

Files, under ``<output_dir>/profile/step_<n>/``:

- ``<process>.json.gz``: the trace (the CPU's operators and, on a GPU, the kernels and copies
  they launched, on one time line);
- ``<process>.txt``: the table (:func:`summary`): each range below with its wall time and, on a
  GPU, the device's work begun in it; the device's kernels by their total time; the CPU's
  operators by their own time.

``<process>`` is ``driver`` and, on Ray, ``<role>-rank<r>`` for each rank of the training
groups and ``rollout-replica-<i>`` for each split rollout replica. With the local backend the
driver's files hold the whole step: generation, scoring and the updates run in its process.
On Ray the driver's hold its own part (rewards, advantages, waiting on the ranks), each rank's
its methods (a colocated rollout engine's generation included) and each replica's its
generation (vLLM runs in the replica's process). The split pools of a teacher or an LLM judge
are not profiled.

In the trace and the table, ``treadle/<phase>`` is a phase of the step
(:func:`treadle.tracking.tracker.timed`: ``generate``, ``update_actor``, ...),
``treadle/<role>.<method>`` a worker method a rank ran (``actor.update_actor``) and
``treadle/engine_step`` a step of a rollout engine; outside a profiled step :func:`phase` does
nothing.

Choices: a profiler started as the step begins and stopped as it ends (a step is long and no
two are alike: torch's wait/warm-up schedule would profile parts of several); operators'
shapes, Python stacks and memory are not recorded (they make the trace several times larger
and the step slower); the CPU's operators ranked by their own time (less their callees'),
which sums to the threads' busy time, where a total counts a nested operator in each caller;
the table built from the raw events, not ``key_averages()``, and the trace gzipped at level 6,
not torch's 9 (together 38 s against 4.8 s for 500,000 events: docs/findings.md).
"""

from __future__ import annotations

import bisect
import gzip
import shutil
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROWS = 30  # operators and kernels in the table
WIDTH = 100  # characters of a name shown (a CUDA kernel's can be thousands)

Span = tuple[int, int, str]  # start, end (ns), name


class StepProfile:
    """One process's profile of one step: :meth:`start`, then :meth:`stop` writes its files."""

    def __init__(self, folder: Path, name: str) -> None:
        import torch

        self.folder, self.name = Path(folder), name
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.device = "cuda" if cuda else "cpu"
        self.profiler = torch.profiler.profile(activities=activities)
        self.began = 0.0

    def start(self) -> None:
        global _active
        self.profiler.start()
        self.began = time.perf_counter()
        _active = self

    def stop(self) -> list[Path]:
        """Stop and write the trace and the table; their paths."""
        global _active
        _active = None
        self.profiler.stop()
        seconds = time.perf_counter() - self.began
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"{self.name}.json.gz"
        table = self.folder / f"{self.name}.txt"
        # torch gzips a trace at level 9 in Python: 10 s for 500k events here, 0.7 s at 6
        plain = self.folder / f"{self.name}.json"
        self.profiler.export_chrome_trace(str(plain))
        with plain.open("rb") as src, gzip.open(trace, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        plain.unlink()
        # from the raw events: torch's key_averages() takes ~40 us an event in Python
        results = getattr(self.profiler.profiler, "kineto_results", None)
        cpu, device = spans(results.events() if results is not None else [])
        head = (
            f"{self.name}: {seconds:.3f} s profiled on the {self.device}; the trace: {trace.name}"
        )
        table.write_text("\n".join([head, *summary(cpu, device, seconds)]) + "\n", encoding="utf-8")
        return [trace, table]


def spans(events: Iterable[Any]) -> tuple[dict[int, list[Span]], list[Span]]:
    """The profiler's events as spans: the CPU's by thread (operators and ranges, nested), and
    the device's work (kernels, copies; not its copies of the ranges)."""
    import torch

    cpu: dict[int, list[Span]] = defaultdict(list)
    device: list[Span] = []
    for e in events:
        span = (e.start_ns(), e.end_ns(), e.name())
        if e.device_type() == torch.autograd.DeviceType.CPU:
            if not e.is_async():
                cpu[e.start_thread_id()].append(span)
        elif not e.is_user_annotation() and "annotation" not in _activity(e):
            device.append(span)
    return cpu, device


def _activity(event: Any) -> str:
    """The kineto activity's name (``gpu_user_annotation``: the device's copy of a range); ""
    where torch does not give it (2.11's events have no ``activity_type``: their ranges'
    copies are the ``is_user_annotation`` ones)."""
    activity = getattr(event, "activity_type", None)
    return activity() if activity is not None else ""


def summary(cpu: dict[int, list[Span]], device: list[Span], seconds: float) -> list[str]:
    """The table's lines: each ``treadle/`` range (its wall time and, on a GPU, the device's
    work that began in it), the device's kernels by total time, the CPU's operators by their
    own time (their time less their callees')."""
    own, total, calls = _own_times(cpu)
    ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for thread in cpu.values():
        for start, end, name in thread:
            if name.startswith("treadle/"):
                ranges[name].append((start, end))
    by_start = sorted(device)
    begun = [start for start, _, _ in by_start]
    busy = [0]  # busy[k]: the device's time in its first k spans
    for start, end, _ in by_start:
        busy.append(busy[-1] + end - start)
    lines = [
        "",
        f"{'range':<40} {'calls':>6} {'wall s':>9}" + (" device s  busy" if device else ""),
    ]
    for name in sorted(ranges):
        row = f"{name:<40} {calls[name]:>6} {total[name] / 1e9:>9.3f}"
        if device:
            work = sum(
                busy[bisect.bisect_left(begun, end)] - busy[bisect.bisect_left(begun, start)]
                for start, end in ranges[name]
            )
            row += f" {work / 1e9:>8.3f} {work / max(total[name], 1):>5.0%}"
        lines.append(row)
    if device:
        lines += _device_lines(device, busy[-1], seconds)
    lines += [
        "",
        f"the CPU: the {ROWS} operators of the most own time (every thread; a total counts "
        "its callees too)",
        f"{'own ms':>10} {'total ms':>10} {'calls':>7}  name",
        *(
            f"{t / 1e6:>10.3f} {total[n] / 1e6:>10.3f} {calls[n]:>7}  {n[:WIDTH]}"
            for n, t in own.most_common(ROWS)
        ),
    ]
    return lines


def _device_lines(device: list[Span], busy: int, seconds: float) -> list[str]:
    total: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for start, end, name in device:
        total[name] += end - start
        calls[name] += 1
    return [
        "",
        f"the device: the {ROWS} kernels and copies of the most time (busy {busy / 1e9:.3f} s "
        f"of {seconds:.3f} s)",
        f"{'total ms':>10} {'calls':>7} {'mean us':>9}  name",
        *(
            f"{t / 1e6:>10.3f} {calls[n]:>7} {t / calls[n] / 1e3:>9.1f}  {n[:WIDTH]}"
            for n, t in total.most_common(ROWS)
        ),
    ]


def ranges_part(table: str) -> str:
    """The first line and the ranges of a table :meth:`StepProfile.stop` wrote (the report
    shows them)."""
    return "\n\n".join(table.split("\n\n")[:2]).rstrip("\n")


def _own_times(cpu: dict[int, list[Span]]) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """Each name's own time (less the spans nested in it on its thread), total time and calls."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for thread in cpu.values():
        stack: list[list[Any]] = []  # [end, name, start, nested time]

        def close(span: list[Any]) -> None:
            end, name, start, nested = span
            own[name] += end - start - nested
            total[name] += end - start
            calls[name] += 1

        for start, end, name in sorted(thread, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1][0] <= start:
                close(stack.pop())
            if stack:
                stack[-1][3] += end - start
            stack.append([end, name, start, 0])
        while stack:
            close(stack.pop())
    return own, total, calls


_active: StepProfile | None = None


def begin(folder: str, name: str) -> None:
    """Profile this process (a worker's rank, a rollout replica) as ``name`` until :func:`end`."""
    StepProfile(Path(folder), name).start()


def end() -> list[str]:
    """Stop the profile under way in this process and write its files; their paths (none if
    none is under way)."""
    return [str(p) for p in _active.stop()] if _active is not None else []


@contextmanager
def phase(name: str) -> Iterator[None]:
    """The block as a range ``treadle/<name>`` of the profile being recorded; otherwise
    nothing (not even torch imported)."""
    if _active is None:
        yield
        return
    torch: Any = sys.modules["torch"]
    with torch.profiler.record_function(f"treadle/{name}"):
        yield
