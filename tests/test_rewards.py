"""Reward functions by name or from a user file, and the checks on what they return."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest

from treadle.errors import ConfigError, RewardError
from treadle.rewards import load_reward_fn, score_batch

USER_FILE = """
def length(prompt, response, ground_truth):
    return len(response) / 10

def is_exact(prompt, response, ground_truth):
    return response == ground_truth

def divide(prompt, response, ground_truth):
    return 1 / (len(response) - 2)

def text(prompt, response, ground_truth):
    return "abc"

def nothing(prompt, response, ground_truth):
    return None

def not_a_number(prompt, response, ground_truth):
    return float("nan")

THRESHOLD = 0.5
"""


@pytest.fixture
def user_file(tmp_path: Path) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return str(path)


def test_builtin_arithmetic():
    fn = load_reward_fn("arithmetic")
    scores = score_batch(
        fn, ["What is 1+2?"] * 3, ["Answer: 3", "1+2: 1+2=3. Answer: 3", "4"], ["3"] * 3
    )
    assert scores == [1.0, 1.0, 0.0]


def test_unknown_builtin_has_a_hint():
    with pytest.raises(
        ConfigError, match="unknown reward 'arithmatic' \\(did you mean 'arithmetic'\\?\\)"
    ):
        load_reward_fn("arithmatic")


def test_user_function_from_file(user_file: str):
    assert score_batch(
        load_reward_fn(f"{user_file}:length"), ["p", "p"], ["abcd", ""], ["", ""]
    ) == [0.4, 0.0]
    exact = load_reward_fn(f"{user_file}:is_exact")
    assert score_batch(exact, ["p", "p"], ["7", "8"], ["7", "7"]) == [1.0, 0.0]  # bools count


def test_reward_fn_pickles_as_its_spec(user_file: str):
    fn = pickle.loads(pickle.dumps(load_reward_fn(f"{user_file}:length")))
    assert fn.spec == f"{user_file}:length"
    assert fn("p", "abcde", "") == 0.5


def test_bad_specs_name_the_file_or_function(user_file: str, tmp_path: Path):
    missing = tmp_path / "missing.py"
    with pytest.raises(ConfigError, match=f"file '{missing}' does not exist"):
        load_reward_fn(f"{missing}:fn")
    with pytest.raises(ConfigError, match=f"'{user_file}' has no function 'scorer'"):
        load_reward_fn(f"{user_file}:scorer")
    with pytest.raises(ConfigError, match=r"'THRESHOLD' in .* is a float, not a function"):
        load_reward_fn(f"{user_file}:THRESHOLD")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_xyz\n")
    with pytest.raises(ConfigError, match=r"importing .*broken\.py' raised ModuleNotFoundError"):
        load_reward_fn(f"{broken}:fn")


def test_raising_function_names_function_sample_and_cause(user_file: str):
    spec = f"{user_file}:divide"
    with pytest.raises(RewardError) as info:
        score_batch(
            load_reward_fn(spec), ["What is 1+1?", "What is 2+2?"], ["abc", "ab"], ["2", "4"]
        )
    message = str(info.value)
    assert message.startswith(
        f"reward function '{spec}' failed on sample 1: raised ZeroDivisionError"
    )
    assert "prompt 'What is 2+2?', response 'ab'" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(
    ("name", "shown"), [("text", "'abc'"), ("nothing", "None"), ("not_a_number", "nan")]
)
def test_non_numbers_are_rejected(user_file: str, name: str, shown: str):
    spec = f"{user_file}:{name}"
    with pytest.raises(RewardError) as info:
        score_batch(load_reward_fn(spec), ["p"], ["r"], ["g"])
    assert str(info.value) == (
        f"reward function '{spec}' failed on sample 0: returned {shown}, not a finite number "
        "(prompt 'p', response 'r')"
    )


def test_plain_callables_and_long_texts_are_shortened():
    def grumpy(prompt: str, response: str, ground_truth: str) -> float:
        raise ValueError("no")

    with pytest.raises(RewardError) as info:
        score_batch(grumpy, ["x" * 500], ["y" * 500], ["1"])
    message = str(info.value)
    assert (
        "reward function 'test_plain_callables_and_long_texts_are_shortened.<locals>.grumpy'"
        in message
    )
    assert "x" * 77 + "..." in message and "x" * 78 not in message
    assert score_batch(lambda p, r, g: 1, ["p"], ["r"], ["g"], spec="ones") == [1.0]
    assert math.isclose(score_batch(lambda p, r, g: 0.25, ["p"], ["r"], ["g"])[0], 0.25)
    with pytest.raises(ValueError, match="must match"):
        score_batch(lambda p, r, g: 1, ["p", "q"], ["r"], ["g"])
