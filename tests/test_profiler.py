"""`trainer.profile_steps`: a step's torch.profiler trace and table (treadle.tracking.profiler).
The runs that write them: trainers/test_rl_e2e.py (local, and Ray's two ranks)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from treadle.config import load_config
from treadle.runtime.errors import ConfigError
from treadle.tracking import profiler
from treadle.tracking.profiler import StepProfile, phase, summary
from treadle.tracking.tracker import timed


def events(trace) -> list[dict]:
    with gzip.open(trace, "rt", encoding="utf-8") as f:
        return list(json.load(f)["traceEvents"])


def test_a_profile_writes_its_trace_and_table_with_the_phases_as_ranges(tmp_path):
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    metrics: dict[str, float] = {}
    profile = StepProfile(tmp_path / "step_3", "driver")
    profile.start()
    with timed(metrics, "update_actor"):  # a millisecond or more each
        for _ in range(4):
            a @ b
    with phase("generate"):
        for _ in range(4):
            torch.softmax(a @ b, -1)
    written = profile.stop()
    trace, table = tmp_path / "step_3/driver.json.gz", tmp_path / "step_3/driver.txt"
    assert written == [trace, table]
    names = {e.get("name") for e in events(trace)}
    assert {"treadle/update_actor", "treadle/generate", "aten::mm", "aten::softmax"} <= names
    text = table.read_text()
    assert text.startswith("driver: ") and "profiled on the cpu; the trace: driver.json.gz" in text
    rows = [line.split() for line in text.splitlines()]
    ranges = {row[0]: row[1:] for row in rows if row and row[0].startswith("treadle/")}
    assert ranges.keys() == {"treadle/update_actor", "treadle/generate"}
    assert all(calls == "1" and float(wall) >= 0.001 for calls, wall in ranges.values())
    ops = {row[-1]: row[:-1] for row in rows if row and row[0][0].isdigit()}
    assert ops["aten::mm"][2] == "8" and ops["aten::softmax"][2] == "4"  # own, total, calls
    assert "the device:" not in text  # a CPU has none
    assert metrics["timing/update_actor"] > 0  # the timer still times


def test_the_table_counts_own_time_and_the_device_work_in_each_range():
    ms = 1_000_000  # ns
    cpu = {
        1: [
            (0, 100 * ms, "treadle/generate"),
            (10 * ms, 40 * ms, "aten::mm"),
            (15 * ms, 25 * ms, "aten::copy_"),  # in the first mm
            (50 * ms, 60 * ms, "aten::mm"),
        ],
        2: [(0, 30 * ms, "aten::add")],  # another thread: not nested in the range
    }
    device = [(20 * ms, 30 * ms, "gemm"), (55 * ms, 75 * ms, "gemm"), (120 * ms, 130 * ms, "copy")]
    lines = summary(cpu, device, seconds=0.2)
    rows = [line.split() for line in lines]
    # the range: 100 ms of wall time; the device's 10 + 20 ms that began in it: 30%
    assert ["treadle/generate", "1", "0.100", "0.030", "30%"] in rows
    # the device: busy 40 ms of 200; each kernel's total, calls and mean
    assert "(busy 0.040 s of 0.200 s)" in "\n".join(lines)
    assert ["30.000", "2", "15000.0", "gemm"] in rows and ["10.000", "1", "10000.0", "copy"] in rows
    # own time: the range's 100 less its callees' 30 + 10; mm's 30 - 10 (the copy in it) + 10
    cpu_rows = rows[[line[:2] for line in rows].index(["own", "ms"]) + 1 :]
    assert cpu_rows[0] == ["60.000", "100.000", "1", "treadle/generate"]
    add, mm = ["30.000", "30.000", "1", "aten::add"], ["30.000", "40.000", "2", "aten::mm"]
    assert sorted(cpu_rows[1:3]) == [add, mm]
    assert cpu_rows[3] == ["10.000", "10.000", "1", "aten::copy_"]


class Event:
    """A kineto event as ``spans`` reads it; ``activity``: torch 2.13's ``activity_type()``
    (None: torch 2.11's event, which has no such method)."""

    def __init__(self, name, device, activity=None, annotation=False, start=0):
        self._name, self._device, self._annotation, self._start = name, device, annotation, start
        if activity is not None:
            self.activity_type = lambda: activity

    def name(self):
        return self._name

    def start_ns(self):
        return self._start

    def end_ns(self):
        return self._start + 5

    def device_type(self):
        return self._device

    def is_async(self):
        return False

    def is_user_annotation(self):
        return self._annotation

    def start_thread_id(self):
        return 7


@pytest.mark.parametrize("torch_211", [True, False])
def test_the_device_s_spans_are_its_kernels_not_its_copies_of_the_ranges(torch_211):
    cuda, cpu_type = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device, activity, annotation=False):
        return Event(name, device, None if torch_211 else activity, annotation)

    got_cpu, got_device = profiler.spans(
        [
            event("treadle/generate", cpu_type, "user_annotation", annotation=True),
            event("aten::mm", cpu_type, "cpu_op"),
            event("gemm", cuda, "kernel"),
            event("Memcpy HtoD", cuda, "gpu_memcpy"),
            event("treadle/generate", cuda, "gpu_user_annotation", annotation=True),
        ]
    )
    assert got_cpu == {7: [(0, 5, "treadle/generate"), (0, 5, "aten::mm")]}
    assert got_device == [(0, 5, "gemm"), (0, 5, "Memcpy HtoD")]


def test_outside_a_profiled_step_a_phase_is_no_range(tmp_path):
    assert profiler._active is None
    cpu = [torch.profiler.ProfilerActivity.CPU]
    # a profile that is not treadle's: no range of ours in it
    with torch.profiler.profile(activities=cpu) as someone, phase("generate"):
        torch.ones(3) + 1
    assert "treadle/generate" not in {e.key for e in someone.key_averages()}
    profile = StepProfile(tmp_path, "again")  # and a profile can start after one stopped
    profile.start()
    profile.stop()
    assert profiler._active is None and (tmp_path / "again.txt").is_file()


def test_profile_steps_name_steps_of_the_run():
    cfg = load_config(None, ["trainer.total_steps=4", "trainer.profile_steps=[1,4]"])
    assert cfg.trainer.profile_steps == [1, 4]
    with pytest.raises(ConfigError, match=r"trainer\.profile_steps names step 5, after the "):
        load_config(None, ["trainer.total_steps=4", "trainer.profile_steps=[2,5]"])
    with pytest.raises(
        ConfigError, match=r"trainer\.profile_steps\[0\]: input should be greater than 0 \(got 0\)"
    ):
        load_config(None, ["trainer.profile_steps=[0]"])
    # SFT by epochs counts its steps from the data: any step may be named
    cfg = load_config(None, ["trainer.epochs=2", "trainer.profile_steps=[40]"])
    assert cfg.trainer.profile_steps == [40]
