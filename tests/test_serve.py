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

URL_LINE = re.compile(r"^serving (\S+) at (http://\S+/v1) \(api key: (\S+)\)")


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


@pytest.mark.parametrize(
    ("signum", "code", "how"), [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")]
)
def test_serve_answers_the_openai_client_and_stops_on_a_signal(
    tiny_task, tmp_path, signum, code, how
):
    config = tmp_path / "serve.yaml"
    config.write_text(f"model:\n  path: {tiny_task['model']}\ndata:\n  max_prompt_length: 64\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "treadle.cli", "serve", str(config), "rollout.max_new_tokens=4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        line = lines.get(timeout=120)  # the first line printed is the URL line
        assert line is not None, proc.communicate(timeout=30)[1][-3000:]
        match = URL_LINE.match(line)
        assert match, line
        model, url, key = match.groups()
        api = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
        answer = api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "1 + 1"}], max_tokens=3
        )
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert answer.usage.completion_tokens <= 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err[-3000:]
    assert f"treadle: stopped by {how}" in err
    assert "Traceback" not in err, err[-3000:]
