"""The built-in code task: its problems, the program extraction, and the sandboxed reward."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from treadle.cli import main
from treadle.rewards import load_reward_fn, score_batch
from treadle.sandbox import SandboxError, run
from treadle.tasks import code

try:
    run("pass", timeout_s=20)
    _BROKEN = ""
except SandboxError as e:
    _BROKEN = str(e)
needs_sandbox = pytest.mark.skipif(bool(_BROKEN), reason=_BROKEN or "sandbox works")


def _one_per_family() -> list[code.Problem]:
    chosen: dict[str, code.Problem] = {}
    for problem in code.problems():
        chosen.setdefault(problem.family, problem)
    return list(chosen.values())


def test_at_least_200_distinct_problems_whose_references_pass_their_tests():
    problems = code.problems()
    assert len(problems) >= 200
    assert len({p.prompt for p in problems}) == len(problems)
    assert len({p.family for p in problems}) == len(code.FAMILIES)
    for p in problems:  # in this process: the references are our code, not a model's
        assert p.tests.count("assert ") == code.N_TESTS
        namespace: dict = {}
        exec(p.solution, namespace)
        exec(p.tests, namespace)
    assert code.problems(seed=0) == problems and code.problems(seed=1) != problems


def test_prepare_writes_disjoint_splits(tmp_path: Path, capsys):
    assert main(["prepare", "--task", "code", "--output-dir", str(tmp_path)]) == 0
    assert "train:" in capsys.readouterr().out
    rows = {
        split: [json.loads(line) for line in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
        for split in ("train", "test")
    }
    assert len(rows["test"]) == 50 and len(rows["train"]) + 50 == len(code.problems())
    assert not {r["prompt"] for r in rows["test"]} & {r["prompt"] for r in rows["train"]}
    row = rows["train"][0]
    assert set(row) == {"prompt", "answer", "solution", "family"}
    assert row["solution"].startswith("```python\n") and row["answer"].startswith("assert ")


@pytest.mark.parametrize(
    ("response", "program"),
    [
        ("Here:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1\n"),
        ("```python\nx = 1\n```\nthen\n```py\nx = 2\n```", "x = 2\n"),
        ("```python\nx = 1\n```\n```text\nnot code\n```", "x = 1\n"),
        ("```\nx = 3\n```", "x = 3\n"),
        ("```python3 solution.py\nx = 4\n", "x = 4\n"),  # cut off before the closing fence
        ("def f():\n    return 5\n", "def f():\n    return 5\n"),
    ],
)
def test_extract_program(response: str, program: str):
    assert code.extract_program(response) == program


@needs_sandbox
def test_references_score_1_and_wrong_programs_less():
    problems = _one_per_family()
    reward = load_reward_fn("code")
    prompts = [p.prompt for p in problems]
    truths = [p.tests for p in problems]
    answers = [f"Sure.\n```python\n{p.solution}```" for p in problems]
    assert score_batch(reward, prompts, answers, truths, workers=2) == [1.0] * len(problems)
    wrong = [f"```python\ndef {p.family}(x):\n    return None\n```" for p in problems]
    assert max(score_batch(reward, prompts, wrong, truths, workers=2)) < 1.0
    off_by_one = problems[0].solution.replace("return ", "return 1 + ", 1)
    assert code.compute_score("", off_by_one, problems[0].tests) < 1.0
    assert code.compute_score("", "no code at all", problems[0].tests) == 0.0


@needs_sandbox
def test_code_reward_runs_at_most_sandbox_workers_at_once(monkeypatch):
    running, peak, lock = 0, 0, threading.Lock()
    real_grade = code.grade

    def counting_grade(*args, **kwargs):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        try:
            return real_grade(*args, **kwargs)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(code, "grade", counting_grade)
    problem = _one_per_family()[0]
    n = 6
    scores = score_batch(
        load_reward_fn("code"),
        [problem.prompt] * n,
        [f"```python\n{problem.solution}```"] * n,
        [problem.tests] * n,
        workers=2,
        timeout_s=20,
    )
    assert scores == [1.0] * n and peak == 2


@needs_sandbox
def test_sandbox_timeout_reaches_the_program():
    slow = "```python\nimport time\ntime.sleep(30)\n```"
    start = time.monotonic()
    reward = load_reward_fn("code")
    assert score_batch(reward, ["p"], [slow], ["assert True\n"], timeout_s=1) == [0.0]
    assert time.monotonic() - start < 10
