"""``treadle serve``: a model behind the OpenAI API in one process, stopped by a signal."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

from treadle.cli import STOP_GRACE_S

URL_LINE = re.compile(r"^serving (\S+) at (http://\S+/v1) \(api key: (\S+)\)")
MESSAGES = [{"role": "user", "content": "1 + 1"}]


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def _launch(tiny_task, folder: Path) -> tuple[subprocess.Popen, queue.Queue]:
    """A ``treadle serve`` process of the tiny model and the queue of its stdout's lines."""
    config = folder / "serve.yaml"
    config.write_text(f"model:\n  path: {tiny_task['model']}\ndata:\n  max_prompt_length: 64\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "treadle",
            "serve",
            str(config),
            "rollout.max_new_tokens=4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    return proc, lines


@pytest.fixture(scope="module")
def launched(tiny_task, tmp_path_factory):
    """One serving process for each test of the module, all started at the first test's
    start: their start-ups (imports, the model; one core each) overlap."""
    procs = {
        how: _launch(tiny_task, tmp_path_factory.mktemp(f"serve-{how}"))
        for how in ("Ctrl-C", "SIGTERM")
    }
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start(tiny_task, launched, how: str) -> tuple[subprocess.Popen, str, str, str]:
    """The serving process for ``how`` and its model name, URL and key, once it printed them."""
    proc, lines = launched[how]
    first, line = lines.get(timeout=120), lines.get(timeout=120)
    if first is None or line is None:
        proc.wait(timeout=30)
        pytest.fail(proc.stderr.read()[-3000:])
    # the first line names the log file of the libraries' messages; the second, the URL
    log = re.fullmatch(
        rf"treadle: serve {tiny_task['model']} \(hf\); library messages: (\S+)\n", first
    )
    assert log and Path(log[1]).is_file(), first
    match = URL_LINE.match(line)
    assert match, line
    model, url, key = match.groups()
    proc.lines = lines  # type: ignore[attr-defined]  # (what it prints after: nothing)
    return proc, model, url, key


def _stopped(proc: subprocess.Popen, signum: int) -> tuple[int, str]:
    proc.send_signal(signum)
    # Longer than the command's own limit on its clean-up: a stop that hangs ends there and
    # says where it stood (treadle.cli.signals._Overrun), which this assertion shows. (On
    # 2026-11-27 a stop outlived this test's former 60 s under load, with nothing to say where.)
    _, err = proc.communicate(timeout=STOP_GRACE_S + 60)
    assert "the clean-up did not end" not in err, err[-3000:]
    return proc.returncode, err


def _ask_until_stopped(url: str, key: str, model: str) -> tuple[threading.Event, threading.Event]:
    """Six clients streaming requests of 4 answers each until ``stop`` is set or the server is
    gone; ``answered`` once one was."""
    stop, answered = threading.Event(), threading.Event()

    def ask() -> None:
        api = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30)
        while not stop.is_set():
            try:
                api.chat.completions.create(
                    model=model, messages=MESSAGES, stream=True, n=4
                ).close()
                answered.set()
            except openai.APIConnectionError:
                return  # the server is gone
            except openai.OpenAIError:
                pass

    for _ in range(6):
        threading.Thread(target=ask, daemon=True).start()
    return stop, answered


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "code", "how", "busy"),
    [(signal.SIGINT, 130, "Ctrl-C", True), (signal.SIGTERM, 143, "SIGTERM", False)],
)
def test_serve_answers_the_openai_client_and_stops_on_a_signal(
    tiny_task, launched, signum, code, how, busy
):
    """It answers the openai client, refuses a wrong key, and a signal ends it with the one
    line and not one of the libraries'. Busy: the signal lands in the engine's step or a
    request's task, whatever the requests in flight were doing (streams cut, answers not
    sent)."""
    proc, model, url, key = _start(tiny_task, launched, how)
    stop = threading.Event()
    try:
        api = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
        answer = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3)
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert answer.usage.completion_tokens <= 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        if busy:
            stop, answered = _ask_until_stopped(url, key, model)
            assert answered.wait(timeout=60)
        returncode, err = _stopped(proc, signum)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert returncode == code, err[-3000:]
    lines = err.splitlines()
    assert lines[-1] == f"treadle: stopped by {how}", err[-3000:]
    assert all(line.startswith("treadle: ") for line in lines), err[-3000:]  # no library's
    assert "never retrieved" not in err, err[-3000:]
    assert proc.lines.get(timeout=30) is None  # type: ignore[attr-defined]
