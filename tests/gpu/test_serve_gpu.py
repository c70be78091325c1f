"""``treadle serve`` on the GPU: the hf engine answers an OpenAI chat request, and the command
stops on Ctrl-C (plain HTTP: the GPU machine has no openai package)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from gpu_runs import GPU

pytestmark = GPU

URL_LINE = re.compile(r"^serving (\S+) at (http://\S+/v1) \(api key: (\S+)\)")


def test_serve_answers_a_chat_request_on_the_gpu(tiny_task, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(f"model:\n  path: {tiny_task['model']}\ndata:\n  max_prompt_length: 64\n")
    command = [sys.executable, "-m", "treadle", "serve", str(config), "rollout.max_new_tokens=4"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the first line names where the libraries' messages go (treadle.cli.console), the
        # second is the URL line
        first, line = proc.stdout.readline(), proc.stdout.readline()
        match = URL_LINE.match(line)
        if match is None or not first.startswith(f"treadle: serve {tiny_task['model']} (hf); "):
            proc.kill()
            stderr = proc.communicate()[1][-3000:]
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
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
