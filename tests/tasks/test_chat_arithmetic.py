"""The chat arithmetic task: phrasings, held-out splits, and the reward's number parser."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from treadle.data import TextOptions, load_prompt_dataset
from treadle.models.loading import load_tokenizer
from treadle.tasks import arithmetic as ar
from treadle.tasks import chat_arithmetic as ca

# --- reward ----------------------------------------------------------------------------------

# What chat models write, and the number the reward should read from it.
OUTPUTS = [
    ("47 + 38 = 85", "85"),
    ("47 + 38 = 85.", "85"),
    ("Answer: 85", "85"),
    ("answer:85", "85"),
    ("47 + 38 = 85\nAnswer: 85", "85"),
    ("First, 7 + 8 = 15, carry 1. Then 4 + 3 + 1 = 8.\n\nAnswer: 85", "85"),
    # the last Answer: wins over later numbers and earlier answers
    ("Answer: 85\n\nHere 47 and 38 are the two numbers.", "85"),
    ("Answer: 84. Wait, let me recheck. Answer: 85", "85"),
    # markdown and LaTeX
    ("**Answer:** 85", "85"),
    ("Answer: **85**", "85"),
    ("The final answer is **85**.", "85"),
    ("$47 + 38 = 85$", "85"),
    ("The answer is $\\boxed{85}$.", "85"),
    ("`85`", "85"),
    # separators, signs, leading zeros, zero fractions
    ("999 + 235 = 1,234", "1234"),
    ("Answer: 1,234.", "1234"),
    ("Answer: 85.0", "85"),
    ("Answer: 085", "85"),
    ("Answer: -5", "-5"),
    ("3 - 8 = -5", "-5"),
    ("83-47=36", "36"),  # minus between numbers is an operator, not a sign
    ("Answer: -0", "0"),
    # a number with a fraction is not an integer answer
    ("47 / 2 = 23.5", "23.5"),
    ("Answer: 7.5, so about 8", "7.5"),
    # no number at all
    ("I cannot solve this.", None),
    ("", None),
    ("Answer: unknown", None),
]


@pytest.mark.parametrize(("text", "expected"), OUTPUTS)
def test_extract_final_number(text: str, expected: str | None):
    assert ca.extract_final_number(text) == expected


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("47 + 38 = 85", "85", 1.0),
        ("**Answer:** 85", "85", 1.0),
        ("Answer: 1,234", "1234", 1.0),
        ("47 + 38 = 84", "85", 0.0),
        ("Answer: 85.5", "85", 0.0),
        ("The sum is eighty-five.", "85", 0.0),
        ("Answer: 85", " 85 ", 1.0),
        ("Answer: 7", "07", 1.0),
        # an answer the model only repeats from the question does not count for the last one
        ("What is 47 + 38? I think 85 but it is 47 + 38", "85", 0.0),
    ],
)
def test_compute_score(response: str, truth: str, score: float):
    assert ca.compute_score("What is 47 + 38?", response, truth) == score


def test_non_integer_ground_truth_is_a_data_bug():
    with pytest.raises(ValueError, match="invalid literal"):
        ca.compute_score("q", "Answer: 5", "five")


def test_very_long_numbers_do_not_crash_the_reward():
    assert ca.compute_score("q", "Answer: " + "9" * 5000, "9") == 0.0


# --- problems --------------------------------------------------------------------------------


def test_chat_problems_are_the_arithmetic_problems_reworded():
    plain = ar.generate_problems(50, seed=4, max_value=30)
    chat = ca.generate_chat_problems(50, seed=4, max_value=30, phrasing="bare")
    assert [r["answer"] for r in chat] == [r["answer"] for r in plain]
    for p, c in zip(plain, chat, strict=True):
        assert c["prompt"] == p["prompt"].replace("+", " + ").replace("-", " - ")


@pytest.mark.parametrize("phrasing", sorted(ca.PHRASINGS))
def test_every_phrasing_states_the_problem_and_the_answer_is_right(phrasing: str):
    for row in ca.generate_chat_problems(40, seed=1, phrasing=phrasing):
        # the one-shot example is a fixed problem; the asked problem is the last one
        a, op, b = re.findall(r"(\d+) ([+-]) (\d+)[?.]", row["prompt"])[-1]
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert int(row["answer"]) >= 0


def test_default_phrasing_shows_the_answer_line_then_asks():
    prompt = ca.phrase(47, "+", 38)
    assert "23 + 19 = 42. Answer: 42" in prompt
    assert prompt.endswith("Question: What is 47 + 38?\nSolution:")
    assert ca.phrase(47, "+", 38, "answer_tag").startswith("What is 47 + 38? Think briefly")


@pytest.mark.parametrize(
    ("a", "op", "b", "text"),
    [
        (97, "-", 53, "97 - 53: 97 - 50 = 47, 47 - 3 = 44. Answer: 44"),
        (29, "+", 11, "29 + 11: 29 + 10 = 39, 39 + 1 = 40. Answer: 40"),
        (5, "+", 40, "5 + 40 = 45. Answer: 45"),
        (12, "-", 7, "12 - 7 = 5. Answer: 5"),
        (0, "+", 0, "0 + 0 = 0. Answer: 0"),
    ],
)
def test_solution_takes_the_tens_then_the_units(a: int, op: str, b: int, text: str):
    assert ca.solution(a, op, b) == text


def test_every_solution_earns_the_reward_and_shows_only_true_steps():
    for row in ca.generate_chat_problems(300, seed=2):
        assert ca.compute_score(row["prompt"], row["solution"], row["answer"]) == 1.0
        for x, op, y, z in re.findall(r"(\d+) ([+-]) (\d+) = (\d+)", row["solution"]):
            assert int(z) == (int(x) + int(y) if op == "+" else int(x) - int(y))


def test_unknown_phrasing():
    with pytest.raises(ValueError, match="unknown phrasing 'nope': use one of"):
        ca.phrase(1, "+", 2, "nope")


# --- prepare_chat ----------------------------------------------------------------------------


def _read(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_prepare_chat_is_deterministic_and_held_out(tmp_path: Path):
    a = ca.prepare_chat(tmp_path / "a", seed=3, n_train=300, n_test=50)
    b = ca.prepare_chat(tmp_path / "b", seed=3, n_train=300, n_test=50)
    for split in ("train", "test"):
        assert a[split].read_bytes() == b[split].read_bytes()
    train, test = _read(a["train"]), _read(a["test"])
    assert (len(train), len(test)) == (300, 50)
    assert set(train[0]) == {"prompt", "answer", "solution"}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert len({r["prompt"] for r in train}) == 300
    # the test split does not depend on n_train; another seed gives other problems
    bigger = ca.prepare_chat(tmp_path / "c", seed=3, n_train=500, n_test=50)
    assert bigger["test"].read_bytes() == a["test"].read_bytes()
    other = ca.prepare_chat(tmp_path / "d", seed=4, n_train=300, n_test=50)
    assert other["test"].read_bytes() != a["test"].read_bytes()


def test_prepare_chat_reuses_a_matching_directory(tmp_path: Path):
    kwargs = {"seed": 0, "n_train": 40, "n_test": 10, "max_value": 20}
    paths = ca.prepare_chat(tmp_path, **kwargs)  # type: ignore[arg-type]
    manifest = json.loads((tmp_path / "prepare.json").read_text())
    assert manifest["task"] == "chat_arithmetic"
    assert manifest["template"] == ca.PHRASINGS[ca.DEFAULT_PHRASING]
    stamp = paths["train"].stat().st_mtime_ns
    assert ca.prepare_chat(tmp_path, **kwargs) == paths  # type: ignore[arg-type]
    assert paths["train"].stat().st_mtime_ns == stamp
    ca.prepare_chat(tmp_path, **{**kwargs, "phrasing": "bare"})  # type: ignore[arg-type]
    assert _read(paths["train"])[0]["prompt"].endswith("?")
    assert json.loads((tmp_path / "prepare.json").read_text())["phrasing"] == "bare"
    (tmp_path / "prepare.json").unlink()  # as if interrupted before the manifest
    ca.prepare_chat(tmp_path, **kwargs)  # type: ignore[arg-type]
    assert _read(paths["train"])[0]["prompt"].startswith("Example:")


def test_prepare_chat_rejects_too_many_problems(tmp_path: Path):
    with pytest.raises(ValueError, match="distinct problems"):
        ca.prepare_chat(tmp_path, n_train=100, n_test=10, max_value=5, ops="+")


def test_prepared_rows_load_as_rl_prompts(tmp_path: Path, tiny_task: dict[str, Path]):
    paths = ca.prepare_chat(tmp_path, n_train=8, n_test=4)
    tok = load_tokenizer(tiny_task["model"])
    ds = load_prompt_dataset([paths["test"]], tok, TextOptions(max_prompt_length=512))
    rows = _read(paths["test"])
    assert [r["prompt_text"] for r in ds.rows] == [r["prompt"] for r in rows]
    assert [r["ground_truth"] for r in ds.rows] == [r["answer"] for r in rows]
    rendered = tok.decode(ds.rows[0]["prompt_ids"])
    assert rendered.startswith(f"<|im_start|>user\n{rows[0]['prompt']}<|im_end|>")
