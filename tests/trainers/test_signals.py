"""Ctrl-C and SIGTERM stop a run wherever they land, with one line and no worker left behind.

The CLI under Ray (tiny task, hf rollout, 3 steps, a checkpoint every step, an evaluation at
the end) in a session of its own. A failpoint (:mod:`treadle.runtime.faults`) sends the signal at a
named moment, SIGINT to the run's process group as a terminal's Ctrl-C does, SIGTERM to the
driver as ``kill PID`` does: at start-up, as Ray starts in the background and once it is up
(SIGTERM aborted the driver there); 0.2 s after step 1's checkpoint is sealed, in the middle
of the next step (where Ctrl-C was once swallowed and the run trained on to the end); during
the last step's evaluation. Every run ends with exit 130 (Ctrl-C) or 143 (SIGTERM), its last
stderr line ``treadle: stopped by <how> ...`` naming the checkpoint the same command resumes
from, no traceback, and no process of its session left (Ray's included); each later run
resumes from the checkpoint the one before named.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _session_processes(sid: int) -> list[str]:
    ps = subprocess.run(
        ["ps", "-eo", "sid=,pid=,args="], check=True, capture_output=True, text=True
    )
    return [line for line in ps.stdout.splitlines() if line.split()[0] == str(sid)]


def _start(args: list[str], failpoint: str) -> subprocess.Popen[str]:
    """``args`` with ``TREADLE_FAILPOINT=failpoint``, in a session of its own."""
    env = {**os.environ, "TREADLE_FAILPOINT": failpoint}
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip


def _ended(proc: subprocess.Popen[str], failpoint: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``proc`` once it and every process of its session are
    gone."""
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    for _ in range(150):  # Ray's processes of the run go with it (the reaper: within ~3 s)
        if not _session_processes(proc.pid):
            break
        time.sleep(0.2)
    assert _session_processes(proc.pid) == [], failpoint
    assert "Traceback" not in stderr, stderr[-3000:]
    return proc.returncode, stdout, stderr


def _stopped_at(args: list[str], failpoint: str) -> tuple[int, str, str]:
    """Run ``args`` with ``TREADLE_FAILPOINT=failpoint``; (exit code, stdout, stderr) once
    it and every process of its session are gone."""
    return _ended(_start(args, failpoint), failpoint)


@pytest.mark.slow
@pytest.mark.long
def test_a_signal_stops_the_run_wherever_it_lands(tiny_task, length_reward, tmp_path):
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "treadle",
        "train",
        "examples/arithmetic/grpo.yaml",
        f"reward.function={length_reward}",
        f"model.path={tiny_task['model']}",
        f"data.train_files=[{tiny_task['train']}]",
        f"data.val_files=[{tiny_task['test']}]",
        "data.val_size=8",
        "data.batch_size=4",
        "rollout.n=4",
        "rollout.engine=hf",
        "rollout.max_new_tokens=16",
        "actor.ppo_mini_batch_size=16",
        "actor.micro_batch_size=16",
        "trainer.total_steps=3",
        "trainer.save_every=1",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
    ]
    # Three runs at once, each in a session and directory of its own (the first two stop before
    # they take theirs): at start-up, Ray starting in the background; then up (its C++ handler
    # once aborted the driver there); just after a checkpoint is sealed, in the next step (or a
    # later one: steps are short).
    points = {
        "launch@0:SIGINT": tmp_path / "launch",
        "ray@0:SIGTERM": tmp_path / "ray",
        "sealed@1:SIGINT+0.2": out,
    }
    started = {p: _start([*args, f"trainer.output_dir={d}"], p) for p, d in points.items()}
    try:
        ended = {point: _ended(proc, point) for point, proc in started.items()}
    finally:
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
    code, _, stderr = ended["launch@0:SIGINT"]
    assert (code, stderr.strip().splitlines()[-1]) == (130, "treadle: stopped by Ctrl-C")
    code, _, stderr = ended["ray@0:SIGTERM"]
    assert (code, stderr.strip().splitlines()[-1]) == (143, "treadle: stopped by SIGTERM")
    code, _, stderr = ended["sealed@1:SIGINT+0.2"]
    assert code == 130 and _stopped_step(stderr, "Ctrl-C", out) >= 2
    # at the last step, during its evaluation (the only one: trainer.eval_every=0), resumed
    code, stdout, stderr = _stopped_at(args, "eval@0:SIGTERM+0.05")
    assert code == 143 and "resumed from" in stdout.replace("\n", "")
    assert _stopped_step(stderr, "SIGTERM", out) == 3 and not (out / "final_model").exists()


def _stopped_step(stderr: str, how: str, out: Path) -> int:
    """The step of the one line that ends ``stderr``, which names the newest checkpoint (of
    that step or the one before) as the one the same command resumes from."""
    last = stderr.strip().splitlines()[-1]
    found = re.fullmatch(
        rf"treadle: stopped by {how} during step (\d+); the last checkpoint is (\S+): the "
        "same command resumes from it",
        last,
    )
    assert found, stderr[-3000:]
    step, saved = int(found[1]), Path(found[2])
    newest = max((out / "checkpoints").glob("step_*[0-9]"), key=lambda p: int(p.name[5:]))
    assert saved == newest and int(saved.name[5:]) in (step - 1, step), last
    return step


def test_a_ctrl_c_kept_by_an_asyncio_task_does_not_cut_the_clean_up_short():
    """Ctrl-C that lands inside one of the rollout client's tasks stays in the task, and
    cancelling the task that awaits it raises it again: closing the client (when the run
    stops) once ended there, the workers not shut down and a bare KeyboardInterrupt in place
    of the run's one line. The signal is noted, so the clean-up goes on."""
    import signal

    from treadle.engines.inference import SamplingParams
    from treadle.runtime import errors
    from treadle.serving.client import RolloutClient
    from treadle.serving.server import Request, Response

    class Interrupted:
        name = "replica 0"

        async def generate(self, requests: list[Request]) -> list[Response]:
            errors.note_signal(signal.SIGINT)  # what the handler does where the signal lands
            raise KeyboardInterrupt

    client = RolloutClient([Interrupted()])
    try:
        with pytest.raises(KeyboardInterrupt):
            client.generate([Request("r0", (1, 2), SamplingParams(n=1, max_new_tokens=2))])
        client.close()
        assert client._loop.is_closed()
    finally:
        errors.clear_signals()


def test_the_note_tells_sigterm_from_ctrl_c_and_cannot_be_lost():
    """Ray's ``ray.get`` turns the SIGTERM handler's Terminated into a bare KeyboardInterrupt
    (measured on Ray 2.60), and a finalizer or a task may drop the exception altogether: what
    stops the run, and how it says so, comes from the note the handler made."""
    import signal

    from treadle.runtime import errors

    try:
        errors.note_signal(signal.SIGTERM)
        assert errors.stop_cause(KeyboardInterrupt()) == ("SIGTERM", 143)
        with pytest.raises(errors.Terminated):  # the loop's check after each step
            errors.raise_if_signalled()
    finally:
        errors.clear_signals()
    assert errors.stop_cause(KeyboardInterrupt()) == ("Ctrl-C", 130)
    errors.raise_if_signalled()  # nothing noted: nothing raised


# A command whose clean-up after a stop never ends: ``treadle.cli.app`` run as the process's
# own command line (``main()``), its command swapped for one that stands "during step 2", stops
# itself with SIGINT and then waits forever in its clean-up (as a wait that never ended once
# did), after a line on stdout that says so.
_STUCK = """
import os, signal, sys, threading
import treadle.cli.app as cli
import treadle.cli.signals as signals
from treadle.runtime.errors import whereabouts
signals.STOP_GRACE_S = float(sys.argv[1])

def command(argv, quieted):
    with whereabouts(lambda: "during step 2; the last checkpoint is step_1"):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            threading.Event().wait(60)  # the signal lands here
        finally:
            print("cleaning up", flush=True)
            threading.Event().wait()  # and the clean-up never ends
    return 0

cli._main = command
sys.exit(cli.main())
"""


def _stuck(grace: float, tmp_path: Path) -> subprocess.Popen[str]:
    (tmp_path / "stuck.py").write_text(_STUCK)
    return subprocess.Popen(
        [sys.executable, str(tmp_path / "stuck.py"), str(grace)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def test_a_clean_up_that_never_ends_still_ends_the_command_after_the_grace(tmp_path):
    proc = _stuck(1.0, tmp_path)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert (proc.returncode, stdout) == (130, "cleaning up\n")
    lines = stderr.strip().splitlines()
    assert lines[0] == "treadle: the clean-up did not end in 1 s; it was at"
    assert "in command" in stderr and "threading.Event().wait()  # and the clean-up" in stderr
    assert lines[-1] == "treadle: stopped by Ctrl-C during step 2; the last checkpoint is step_1"
    assert "Traceback" not in stderr


def test_a_second_ctrl_c_ends_the_command_at_once(tmp_path):
    proc = _stuck(600.0, tmp_path)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "cleaning up\n"
        os.kill(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    last = "treadle: stopped by Ctrl-C during step 2; the last checkpoint is step_1"
    assert (proc.returncode, stderr) == (130, last + "\n")


# The same command, whose stop signals land on another thread than the main one (the kernel
# gives a process's signal to any thread; a signal that comes just before the main thread goes
# to sleep is as good as one that landed elsewhere): each is sent once the main thread sleeps
# in a wait with no timeout, where Python runs the handler only if the signal wakes it.
_ELSEWHERE = """
import signal, sys, threading
import treadle.cli.app as cli
import treadle.cli.signals as signals
from treadle.runtime.errors import whereabouts
signals.STOP_GRACE_S = 600.0
main = threading.main_thread()
sys.setswitchinterval(1000.0)  # the main thread lets go of the interpreter only to sleep

def elsewhere(signum):
    def send():
        while True:  # until the main thread sleeps in command's wait
            frame = sys._current_frames()[main.ident]
            if frame.f_code is threading.Condition.wait.__code__:
                if frame.f_back.f_back.f_code.co_name == "command":
                    break
            threading.Event().wait(0.01)
        signal.pthread_kill(threading.get_ident(), signum)  # it lands on this thread
    threading.Thread(target=send).start()

def command(argv, quieted):
    with whereabouts(lambda: "during step 2; the last checkpoint is step_1"):
        try:
            elsewhere(signal.SIGINT)
            threading.Event().wait()  # only the handler ends this wait
        finally:
            print("cleaning up", flush=True)
            elsewhere(signal.SIGINT)
            threading.Event().wait()  # and the clean-up never ends
    return 0

cli._main = command
sys.exit(cli.main())
"""


def test_ctrl_c_twice_on_another_thread_than_the_main_one_is_not_lost(tmp_path):
    """CI once lost a second Ctrl-C (the test above hung): the stop thread counts the signals
    from Python's wakeup fd, wakes the main thread when its handler did not run, and ends the
    process on the second."""
    (tmp_path / "elsewhere.py").write_text(_ELSEWHERE)
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "elsewhere.py")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    last = "treadle: stopped by Ctrl-C during step 2; the last checkpoint is step_1"
    assert (proc.returncode, stdout, stderr) == (130, "cleaning up\n", last + "\n")


_UNAWAITED = """
import argparse, asyncio, os, signal, sys, threading
import treadle.cli.app as cli

async def answer():
    return 1

def command(args):
    pending = answer()  # a coroutine made, and the stop lands before it is awaited
    os.kill(os.getpid(), signal.SIGINT)
    threading.Event().wait(60)
    asyncio.run(pending)

cli.parse = lambda argv: argparse.Namespace(fn=command)
sys.exit(cli.main())
"""


def test_a_coroutine_the_stop_left_unawaited_says_nothing_after_the_stop_line(tmp_path):
    """Python warns of a coroutine never awaited when the stop's traceback lets go of it, after
    the stop line (a request in flight in `treadle serve` once did): not once stopped."""
    assert _ran(tmp_path / "unawaited.py", _UNAWAITED) == (130, "treadle: stopped by Ctrl-C\n")


def _ran(script: Path, text: str) -> tuple[int, str]:
    """``text`` written to ``script`` and run: its exit code and stderr."""
    script.write_text(text)
    proc = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=120
    )
    return proc.returncode, proc.stderr


_IN_A_DEL = """
import argparse, os, signal, sys, threading
import treadle.cli.app as cli

class Transport:
    def __del__(self):  # where Python ignores what is raised (asyncio's transports do this)
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # the handler runs here, in __del__

def command(args):
    Transport()
    threading.Event().wait(60)

cli.parse = lambda argv: argparse.Namespace(fn=command)
sys.exit(cli.main())
"""


def test_a_ctrl_c_that_lands_in_a_del_still_stops_the_command(tmp_path):
    """In CI, `treadle serve`'s Ctrl-C landed in an asyncio transport's ``__del__``, where
    Python prints the exception and drops it: the command served on until the grace ended.
    The stop thread sends the signal again."""
    assert _ran(tmp_path / "in_a_del.py", _IN_A_DEL) == (130, "treadle: stopped by Ctrl-C\n")


def test_a_stop_a_library_turned_into_its_own_error_still_stops_the_run(tiny_task, tmp_path):
    """vLLM's tokenizer pool turns a Ctrl-C that lands in it into an UnboundLocalError (its
    ``finally`` reads the variable the interrupt left unset); the failed samples then made the
    run end as an error (exit 2) instead of a stop. With the signal noted, it is the stop."""
    import signal

    import tiny_runs

    from treadle.config import load_config
    from treadle.runtime import errors
    from treadle.trainers.base import Trainer

    class Interrupted(Trainer):
        def run_step(self, step: int) -> dict[str, float]:
            errors.note_signal(signal.SIGINT)  # what the handler does where the signal lands
            raise UnboundLocalError("cannot access local variable 'tok'")

        def close(self) -> None:
            self.lock.release()

    trainer = Interrupted(load_config(None, tiny_runs.overrides(tiny_task, tmp_path / "run")))
    try:
        with pytest.raises(errors.Stopped) as stopped:
            trainer.fit()
    finally:
        errors.clear_signals()
    assert stopped.value.exit_code == 130
    assert str(stopped.value) == (
        "stopped by Ctrl-C during step 1; there is no checkpoint yet: the same command starts over"
    )
