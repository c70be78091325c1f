"""The soak of bench/soak.py, three minutes of it: async GRPO on the tiny model with two split
vLLM replicas and two reward workers, a replica killed every minute and a reward worker every
1.2 minutes (by their processes, SIGKILL), then stopped with SIGTERM. Every kill is restarted
and counted, no step is short of its samples, nothing is dropped (slow).

It runs in the background (``@pytest.mark.background``, tests/conftest.py): :func:`start` is
called as soon as the session's tests are collected, the soak runs its three minutes beside the
other tests (it is bounded by time, not by work: it keeps the core the others leave idle busy),
and the test, run last, waits for it and checks what it wrote.

It is ``long``: ``make test-long`` runs it, ``make test`` does not (its three minutes of two
replicas, two reward workers and a trainer took most of a core from the suite's other tests;
docs/testing.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def start(folder: Path) -> subprocess.Popen[str]:
    """The soak, writing its measures to ``folder/soak.json`` and its output to ``folder/log``."""
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "soak.py"),
        *("--minutes", "3", "--replica-every", "1", "--reward-every", "1.2"),
        *("--warm-steps", "0", "--no-compare", "--json", str(folder / "soak.json")),
    ]
    log = (folder / "log").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.background
def test_three_minutes_with_replicas_and_reward_workers_killed_lose_nothing(background):
    proc, folder = background
    code = proc.wait(timeout=900)
    assert code == 0, (folder / "log").read_text()[-5000:]
    m = json.loads((folder / "soak.json").read_text())
    assert m["kills"] == {"replica": 2, "reward": 2}, m
    # a replica killed during a weight sync restarts the other one too (fleet.py)
    assert m["kills"]["replica"] <= m["replica_restarts"] <= 2 * m["kills"]["replica"], m
    assert m["reward_restarts"] == m["kills"]["reward"], m
    assert m["lost"] == 0 and m["dropped"] == 0, m
    assert m["steps"] >= 10, m
    assert m["exit_code"] == 143, m  # stopped by SIGTERM (resumable)
    assert m["fds"] > 0, m
    assert m["rss_growth_worst"] and m["rss_growth_pct"] <= 10.0, m  # the run's processes
