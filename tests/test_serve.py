"""``treadle serve``: a model behind the OpenAI API in one process, stopped by a signal."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading

import openai
import pytest

from treadle.cli import STOP_GRACE_S

URL_LINE = re.compile(r"^serving (\S+) at (http://\S+/v1) \(api key: (\S+)\)")
MESSAGES = [{"role": "user", "content": "1 + 1"}]


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def _launch(tiny_task, folder) -> tuple[subprocess.Popen, queue.Queue]:
    """A serving process of the tiny model, and the queue its stdout's lines go to."""
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
        name: _launch(tiny_task, tmp_path_factory.mktemp(f"serve-{name}"))
        for name in ("Ctrl-C", "SIGTERM", "in flight")
    }
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start(launched, name: str) -> tuple[subprocess.Popen, str, str, str]:
    """The serving process ``name`` and its model name, URL and key, once it printed them."""
    proc, lines = launched[name]
    line = lines.get(timeout=120)  # the first line printed is the URL line
    if line is None:
        proc.wait(timeout=30)
        pytest.fail(proc.stderr.read()[-3000:])
    match = URL_LINE.match(line)
    assert match, line
    model, url, key = match.groups()
    return proc, model, url, key


def _stopped(proc: subprocess.Popen, signum: int) -> tuple[int, str]:
    proc.send_signal(signum)
    # Longer than the command's own limit on its clean-up: a stop that hangs ends there and
    # says where it stood (treadle.cli.signals._Overrun), which this assertion shows. (On
    # 2026-11-27 a stop outlived this test's former 60 s under load, with nothing to say where.)
    _, err = proc.communicate(timeout=STOP_GRACE_S + 60)
    assert "the clean-up did not end" not in err, err[-3000:]
    return proc.returncode, err


@pytest.mark.parametrize(
    ("signum", "code", "how"), [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")]
)
def test_serve_answers_the_openai_client_and_stops_on_a_signal(launched, signum, code, how):
    proc, model, url, key = _start(launched, how)
    try:
        api = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
        answer = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3)
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert answer.usage.completion_tokens <= 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        returncode, err = _stopped(proc, signum)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert returncode == code, err[-3000:]
    assert f"treadle: stopped by {how}" in err
    assert "Traceback" not in err, err[-3000:]


def test_serve_stops_cleanly_with_requests_in_flight(launched):
    """A signal that lands in the engine's step or a request's task ends the process with the
    one line, whatever the requests in flight were doing (streams cut, answers not sent)."""
    proc, model, url, key = _start(launched, "in flight")
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

    askers = [threading.Thread(target=ask, daemon=True) for _ in range(6)]
    try:
        for t in askers:
            t.start()
        assert answered.wait(timeout=60)
        returncode, err = _stopped(proc, signal.SIGINT)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert returncode == 130, err[-3000:]
    assert "Traceback" not in err and "never retrieved" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "treadle: stopped by Ctrl-C", err[-3000:]
