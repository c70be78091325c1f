"""Ctrl-C and SIGTERM stop a run within seconds, with one line and no worker left behind.

The CLI under Ray (tiny task, checkpoints every 2 steps) in a session of its own: SIGINT after
the step-2 checkpoint gives exit 130 and `treadle: stopped by Ctrl-C during step N; the last
checkpoint is .../step_2: the same command resumes from it`, no traceback, and no process of
its session left (Ray's included); the same command resumes from step 2, and SIGTERM then
stops it the same way with exit 143.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def _session_processes(sid: int) -> list[str]:
    ps = subprocess.run(
        ["ps", "-eo", "sid=,pid=,args="], check=True, capture_output=True, text=True
    )
    return [line for line in ps.stdout.splitlines() if line.split()[0] == str(sid)]


def _stop_after(args: list[str], checkpoint, signum: int) -> tuple[int, str, str, float]:
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not (checkpoint / "manifest.json").is_file():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"{checkpoint} was not written"
            time.sleep(0.2)
        time.sleep(0.5)  # into the next step
        proc.send_signal(signum)
        sent = time.monotonic()
        stdout, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    for _ in range(30):  # Ray's processes of the run go with it
        if not _session_processes(proc.pid):
            break
        time.sleep(1)
    assert _session_processes(proc.pid) == []
    return proc.returncode, stdout, stderr, took


def test_ctrl_c_and_sigterm_stop_the_run_and_it_resumes(tiny_task, length_reward, tmp_path):
    import signal

    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "treadle.cli",
        "train",
        "examples/arithmetic/grpo.yaml",
        f"reward.function={length_reward}",
        f"model.path={tiny_task['model']}",
        f"data.train_files=[{tiny_task['train']}]",
        "data.val_files=[]",
        "data.batch_size=4",
        "rollout.n=4",
        "rollout.engine=hf",
        "rollout.max_new_tokens=16",
        "actor.ppo_mini_batch_size=16",
        "actor.micro_batch_size=16",
        "trainer.total_steps=200",
        "trainer.save_every=2",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
    ]
    code, _, stderr, took = _stop_after(args, out / "checkpoints" / "step_2", signal.SIGINT)
    last = stderr.strip().splitlines()[-1]
    assert code == 130 and took < 30, stderr[-2000:]
    assert last.startswith("treadle: stopped by Ctrl-C during step "), stderr[-2000:]
    saved = _newest(out)  # steps are short: it may have saved more before the signal landed
    assert last.endswith(f"{saved}: the same command resumes from it")
    assert "Traceback" not in stderr
    step = int(saved.name.removeprefix("step_"))
    later = out / "checkpoints" / f"step_{step + 2}"
    code, stdout, stderr, took = _stop_after(args, later, signal.SIGTERM)
    assert code == 143 and took < 30, stderr[-2000:]
    resumed = stdout.replace("\n", "")  # rich wraps the line at the terminal width
    assert f"resumed from {saved} (step {step})" in resumed and "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("treadle: stopped by SIGTERM during step ")
    assert last.endswith(f"{_newest(out)}: the same command resumes from it")


def _newest(out):
    return max((out / "checkpoints").glob("step_*[0-9]"), key=lambda p: int(p.name[5:]))
