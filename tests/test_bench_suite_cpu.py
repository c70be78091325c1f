"""bench/suite_cpu.py's pure parts: a process's kind, pytest's durations, the table's sums."""

from __future__ import annotations

import pytest
from bench_scripts import bench_script


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("ray::IDLE", "ray worker"),
        ("ray::ActorWorker.update", "ray worker"),
        ("/v/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --node=1", "ray daemons"),
        ("/v/bin/python -u /v/ray/dashboard/agent.py --node-ip-address=127.0.0.1", "ray daemons"),
        ("/v/bin/python -u /v/ray/_private/log_monitor.py --session-dir=/tmp", "ray daemons"),
        ("VLLM::EngineCore", "vllm engine"),
        ("/v/bin/python /v/bin/mypy treadle", "mypy"),
        ("/v/bin/python -m treadle train x.yaml out=/tmp/pytest-of-root/a", "treadle command"),
        ("/v/bin/python -c import torch", "other python"),
        ("/usr/lib/chromium/chromium --headless", "other"),
    ],
)  # fmt: skip
def test_a_process_kind_comes_from_its_command_line(command, expected):
    with bench_script("suite_cpu") as suite_cpu:
        assert suite_cpu.kind(command) == expected


def test_the_report_sums_by_kind_and_test_and_reads_pytests_durations():
    log = "\n".join(
        [
            "2.50s call     tests/a.py::test_x",
            "0.50s setup    tests/a.py::test_x",
            "1.00s call     tests/b.py::test_y",
            "(3 durations < 0.005s hidden.)",
        ]
    )
    used = {
        ("tests/a.py::test_x", "pytest", False): 2.0,
        ("tests/a.py::test_x", "ray worker", True): 6.0,
        ("tests/b.py::test_y", "ray worker", False): 4.0,
    }
    with bench_script("suite_cpu") as suite_cpu:
        assert suite_cpu.durations(log) == {"tests/a.py::test_x": 3.0, "tests/b.py::test_y": 1.0}
        text = suite_cpu.report(used, wall=8.0, log=log, top=1)
    lines = text.splitlines()
    assert lines[0] == "wall 8 s, CPU 12 CPU-s: 1.50 busy cores on average"
    assert lines[2].split() == ["ray", "worker", "6", "4", "83%"]
    assert lines[3].split() == ["pytest", "0", "2", "17%"]
    assert lines[4] == "start-up (a process's first 10 s): 50% of the CPU"
    assert lines[-2].split() == ["8", "3.0", "tests/a.py::test_x"]  # top=1: the test of most CPU
    assert lines[-1].strip() == "ray worker* 6, pytest 2"
