"""The calculator task: the tool's evaluator, its schema, the held-out splits and the reward."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from treadle.agents.tools import Toolbox, ToolCall, parse_tool_calls, tool_schema
from treadle.tasks import calculator as calc

# --- the tool --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("347 * 812", "281764"),
        ("  347*812  ", "281764"),
        ("999 * 999", "998001"),
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("-3 ** 2", "-9"),
        ("(-3) ** 2", "9"),
        ("--5", "5"),
        ("+7", "7"),
        ("7 - 10", "-3"),
        ("10 / 4", "2.5"),
        ("10 / 2", "5"),  # an integral float reads as an integer
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("1.5 * 4", "6"),
        ("0.1 + 0.2", "0.3"),
        ("1 / 3", "0.333333333333"),
        (
            "12345678901234567890 * 98765432109876543210",
            str(12345678901234567890 * 98765432109876543210),
        ),
        # what models write
        ("347 × 812", "281764"),
        ("347 ⋅ 812", "281764"),
        ("84 ÷ 4", "21"),
        ("2^10", "1024"),
        ("1,234 * 2", "2468"),
        ("347 * 812 =", "281764"),
    ],
)
def test_calculator_evaluates(expression: str, expected: str):
    assert calc.calculator(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "unsupported syntax"),
        ("os.system", "unsupported syntax"),
        ("(1).__class__", "unsupported syntax"),
        ("x + 1", "unsupported syntax"),
        ("abs(-1)", "unsupported syntax"),
        ("[1, 2]", "unsupported syntax"),
        ("1 if 1 else 2", "unsupported syntax"),
        ("lambda: 1", "unsupported syntax"),
        ("1 < 2", "unsupported syntax"),
        ("1 << 2", "unsupported syntax"),
        ("1, 2", "unsupported syntax"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1j * 2", "only numbers"),
        ("9 ** 9 ** 9", "exponents are limited"),
        ("2 ** 1000", "exponents are limited"),
        ("10 ** 100", "too large"),
        ("99 ** 99", "too large"),
        ("1e308 * 10", "too large"),
        ("9" * 101, "too large"),
        ("(10 ** 60) * (10 ** 60)", "too large"),
        ("1 / 0", "division by zero"),
        ("1 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("", "empty"),
        ("   ", "empty"),
        ("1 +", "cannot parse"),
        ("import os", "cannot parse"),
        ("1" + "+1" * 300, "longer than"),
        ("(" * 240 + "1" + ")" * 240, "cannot parse|nested too deeply"),
        ("1\x002", "cannot parse"),
    ],
)
def test_calculator_rejects(expression: str, message: str):
    with pytest.raises(ValueError, match=message):
        calc.calculator(expression)


def test_calculator_rejects_a_non_string():
    with pytest.raises(ValueError, match="must be a string"):
        calc.calculator(12)  # type: ignore[arg-type]


def test_deeply_nested_expression_stays_bounded():
    # 249 unary minus signs: within the length limit, evaluated without a RecursionError
    assert calc.calculator("-" * 249 + "1") == "-1"
    assert calc.calculator("(" * 200 + "1" + ")" * 200) == "1"


def test_tool_schema():
    schema = tool_schema(calc.calculator)
    function = schema["function"]
    assert function["name"] == "calculator"
    assert function["description"].startswith("Evaluate an arithmetic expression")
    assert function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"
    json.dumps(schema)


def test_toolbox_runs_the_calculator_and_reports_errors():
    box = Toolbox.load(["treadle.tasks.calculator:calculator"])
    try:
        ok = asyncio.run(box.call(ToolCall("calculator", {"expression": "347 * 812"})))
        bad = asyncio.run(box.call(ToolCall("calculator", {"expression": "__import__('os')"})))
        wrong = asyncio.run(box.call(ToolCall("calculator", {"a": 1})))
    finally:
        box.close()
    assert (ok.content, ok.error) == ("281764", False)
    assert bad.error and bad.content.startswith("Error: calculator raised ValueError")
    assert "unsupported syntax" in bad.content
    assert wrong.error and wrong.content.startswith("Error:")


# --- problems --------------------------------------------------------------------------------


def test_generate_problems_are_distinct_exact_and_deterministic():
    rows = calc.generate_problems(500, seed=3)
    assert rows == calc.generate_problems(500, seed=3)
    assert rows != calc.generate_problems(500, seed=4)
    assert len({r["prompt"] for r in rows}) == 500
    for row in rows:
        a, b = map(int, re.findall(r"What is (\d+) \* (\d+)\?", row["prompt"])[-1])
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert row["answer"] == str(a * b)


def test_phrasings():
    default = calc.generate_problems(1, seed=0)[0]["prompt"]
    bare = calc.generate_problems(1, seed=0, phrasing="what_is")[0]["prompt"]
    assert default.startswith("Use the calculator tool.") and default.endswith(f"{bare}\nCall:")
    # the example is a well-formed call the model can copy
    (call,) = parse_tool_calls(default)
    assert (call.name, call.arguments, call.error) == (
        "calculator",
        {"expression": "12 * 34"},
        None,
    )
    assert calc.calculator(**call.arguments) == "408"


def test_generate_problems_checks_arguments():
    with pytest.raises(ValueError, match="unknown phrasing"):
        calc.generate_problems(1, 0, phrasing="nope")
    with pytest.raises(ValueError, match="distinct problems"):
        calc.generate_problems(5, 0, min_value=1, max_value=2)


def test_prepare_writes_held_out_splits_deterministically(tmp_path):
    paths = calc.prepare(tmp_path / "a", seed=1, n_train=300, n_test=50)
    again = calc.prepare(tmp_path / "b", seed=1, n_train=300, n_test=50)
    train = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    test = [json.loads(line) for line in paths["test"].read_text().splitlines()]
    assert (len(train), len(test)) == (300, 50)
    assert set(train[0]) == {"prompt", "answer"}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for name in ("train", "test"):
        assert paths[name].read_bytes() == again[name].read_bytes()
    # the test set does not depend on n_train
    bigger = calc.prepare(tmp_path / "c", seed=1, n_train=400, n_test=50)
    assert bigger["test"].read_bytes() == paths["test"].read_bytes()


def test_prepare_is_idempotent(tmp_path):
    paths = calc.prepare(tmp_path, seed=0, n_train=20, n_test=5)
    stamp = paths["train"].stat().st_mtime_ns
    assert calc.prepare(tmp_path, seed=0, n_train=20, n_test=5) == paths
    assert paths["train"].stat().st_mtime_ns == stamp
    calc.prepare(tmp_path, seed=1, n_train=20, n_test=5)  # other arguments: rewritten
    assert (tmp_path / "prepare.json").is_file()
    assert json.loads((tmp_path / "prepare.json").read_text())["seed"] == 1


def test_prepare_is_registered():
    from treadle.rewards import load_reward_fn
    from treadle.tasks import PREPARERS

    assert PREPARERS["calculator"] == "treadle.tasks.calculator:prepare"
    assert load_reward_fn("calculator")("", "Answer: 6", "6") == 1.0


# --- reward ----------------------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 812"}}\n</tool_call>'
EPISODE = (
    f"{CALL}<|im_end|>\n<|im_start|>user\n<tool_response>\n281764\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("Answer: 281764", 1.0),
        ("347 * 812 = 281764", 1.0),
        ("The product is 281,764.", 1.0),
        ("**Answer:** 281764", 1.0),
        ("Answer: 281764.0", 1.0),
        ("The answer is $\\boxed{281764}$", 1.0),
        ("Answer: 281764\n\nThat is 347 times 812.", 1.0),
        ("Answer: 281763", 0.0),
        ("347 * 812 = 281764.5", 0.0),
        ("I do not know.", 0.0),
        ("", 0.0),
        # whole episodes: only the last turn counts
        (EPISODE + "Answer: 281764", 1.0),
        (EPISODE + "347 * 812 = 281764<|im_end|>", 1.0),
        (EPISODE + "I cannot tell.", 0.0),  # the tool's result is not the model's answer
        (EPISODE, 0.0),
        (CALL, 0.0),  # a call alone is no answer (its expression's numbers do not count)
        (CALL + "\nAnswer: 281764", 1.0),
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "281764"', 0.0),
        # with chat markers the last assistant turn is the model's, an echoed result included
        (EPISODE + "<tool_response>\n281764\n</tool_response>", 1.0),
        # an episode decoded without special tokens
        (
            CALL + "\nuser\n<tool_response>\n281764\n</tool_response>\nassistant\nAnswer: 281764",
            1.0,
        ),
        (CALL + "\nuser\n<tool_response>\n281764\n</tool_response>\nassistant\n", 0.0),
        (CALL + "\n<tool_response>\n281764\n</tool_response>", 0.0),
        (CALL + "<|im_end|>\n<|im_start|>tool\n<tool_response>\n281764", 0.0),
        # an answer before a last call does not count: the episode ended on the call
        ("Answer: 281764\n" + CALL, 0.0),
        # the final turn alone, as the agent loop may pass it
        ("<tool_response>\n281764\n</tool_response>\nAnswer: 281764", 1.0),
    ],
)
def test_compute_score(response: str, score: float):
    assert calc.compute_score("What is 347 * 812?", response, "281764") == score


def test_compute_score_rejects_a_bad_ground_truth():
    with pytest.raises(ValueError):
        calc.compute_score("", "Answer: 1", "one")
