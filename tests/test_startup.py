"""timing/startup and its parts: what the first step of a run reports (treadle/startup.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time

import pytest

from treadle.runtime import startup as startup_module


@pytest.fixture
def startup():
    yield importlib.reload(startup_module)  # module state afresh
    importlib.reload(startup_module)


def test_parts_are_the_seconds_between_marks_and_only_the_first_step_has_them(startup):
    startup.begin()  # not under the command line: counts from here
    time.sleep(0.2)
    startup.mark("data")
    time.sleep(0.1)
    startup.mark("workers")
    startup.mark("data")  # a part marked twice keeps its first end
    startup.detail("workers", {"actor_model": 0.04, "rollout_engine": 0.05})
    time.sleep(0.05)
    m = startup.startup_metrics()
    assert m["startup/data"] == pytest.approx(0.2, abs=0.05)
    assert m["startup/workers"] == pytest.approx(0.1, abs=0.05)
    assert m["startup/other"] == pytest.approx(0.05, abs=0.04)
    assert m["startup/workers/actor_model"] == 0.04 and m["startup/workers/rollout_engine"] == 0.05
    parts = m["startup/data"] + m["startup/workers"] + m["startup/other"]
    assert m["timing/startup"] == pytest.approx(parts, abs=1e-6)
    assert startup.startup_metrics() == {}


def test_the_command_line_counts_from_the_process_start_and_a_second_run_afresh(startup):
    startup.from_process_start()
    startup.mark("imports")
    startup.begin()
    first = startup.startup_metrics()
    age = startup.process_age()
    assert first["startup/imports"] <= first["timing/startup"] <= age  # since the process began
    assert first["timing/startup"] > 0.5  # pytest's own start-up is in it
    startup.begin()  # a second run in this process: from its begin, earlier marks dropped
    second = startup.startup_metrics()
    assert second["timing/startup"] < 0.1 and "startup/imports" not in second


def test_a_worker_reports_its_own_parts():
    timer = startup_module.PartTimer()
    time.sleep(0.05)
    timer.done("actor_model")
    timer.done("rollout_engine")
    assert list(timer.parts) == ["actor_model", "rollout_engine"]
    assert timer.parts["actor_model"] == pytest.approx(0.05, abs=0.03)
    assert timer.parts["rollout_engine"] < 0.01


# What a worker needs and a driver does not: FSDP2 and its distributed checkpoint (~1.1 s of
# imports), transformers' Auto model classes (~2.1 s), vLLM (~12 s).
WORKER_ONLY = (
    "treadle.engines.fsdp",
    "torch.distributed.checkpoint",
    "transformers.models.auto.modeling_auto",
    "vllm",
)


DRIVERS = ("rl", "sft", "dpo", "kto", "rm", "distill", "prime")


@pytest.mark.slow
def test_the_drivers_imports_leave_out_what_only_their_workers_need():
    """A driver imports the worker classes to start them as Ray actors, not what they build."""
    code = (
        f"import sys, treadle.cli\n"
        f"for name in {DRIVERS!r}: __import__(f'treadle.trainers.{{name}}')\n"
        f"print([m for m in {WORKER_ONLY!r} if m in sys.modules])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-3000:]
