"""``treadle serve`` on the GPU: the hf engine answers an OpenAI chat request, and the command
stops on Ctrl-C (plain HTTP: the GPU machine has no openai package)."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest
from gpu_runs import GPU

pytestmark = GPU

URL_LINE = re.compile(r"^serving (\S+) at (http://\S+/v1) \(api key: (\S+)\)")


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put("")  # (the stream ended)


def test_serve_answers_a_chat_request_on_the_gpu(tiny_task, tmp_path):
    """(Its standard error goes to a file and its lines are awaited with a deadline: a stalled
    start fails this test, not the whole GPU run's time limit.)"""
    config = tmp_path / "serve.yaml"
    config.write_text(f"model:\n  path: {tiny_task['model']}\ndata:\n  max_prompt_length: 64\n")
    command = [sys.executable, "-m", "treadle", "serve", str(config), "rollout.max_new_tokens=4"]
    errors = tmp_path / "stderr.txt"
    with errors.open("w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        # the first line names where the libraries' messages go (treadle.cli.console), the
        # second is the URL line
        try:
            first, line = lines.get(timeout=150), lines.get(timeout=150)
        except queue.Empty:
            first = line = "(nothing within 150 s)"
        match = URL_LINE.match(line)
        if match is None or not first.startswith(f"treadle: serve {tiny_task['model']} (hf); "):
            proc.kill()
            proc.wait(timeout=30)
            stderr = errors.read_text()[-3000:]
            pytest.fail(f"no URL line but {first!r}, {line!r}; stderr:\n{stderr}")
        model, url, key = match.groups()
        body = {"model": model, "messages": [{"role": "user", "content": "1 + 1"}], "max_tokens": 3}
        request = urllib.request.Request(
            f"{url}/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert 1 <= answer["usage"]["completion_tokens"] <= 3
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130, errors.read_text()[-3000:]
