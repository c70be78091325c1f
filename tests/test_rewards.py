"""Reward functions by name or from a user file, and the checks on what they return."""

from __future__ import annotations

import math
import pickle
import threading
import time
from pathlib import Path

import pytest

from treadle.errors import ConfigError, RewardError
from treadle.rewards import load_reward_fn, sandboxed_reward, score_batch

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


def test_sandboxed_rewards_run_in_parallel_up_to_workers_with_the_timeout():
    running, peak, seen, lock = 0, 0, [], threading.Lock()

    @sandboxed_reward
    def slow(prompt: str, response: str, ground_truth: str, *, timeout_s: float = 0) -> float:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            seen.append(timeout_s)
        time.sleep(0.05)
        with lock:
            running -= 1
        return len(response)

    responses = ["x" * i for i in range(9)]
    assert score_batch(slow, ["p"] * 9, responses, ["g"] * 9, workers=3, timeout_s=2.5) == [
        float(i) for i in range(9)
    ]
    assert peak == 3 and seen == [2.5] * 9
    assert score_batch(slow, ["p"], ["abc"], ["g"]) == [3.0] and seen[-1] == 0  # no timeout_s


def test_plain_rewards_stay_sequential_and_parallel_errors_name_the_first_sample():
    threads = set()

    def plain(prompt: str, response: str, ground_truth: str) -> float:
        threads.add(threading.get_ident())
        return 1.0

    assert score_batch(plain, ["p"] * 4, ["r"] * 4, ["g"] * 4, workers=4, timeout_s=1) == [1.0] * 4
    assert threads == {threading.get_ident()}

    @sandboxed_reward
    def picky(prompt: str, response: str, ground_truth: str, *, timeout_s: float = 0) -> float:
        if response in ("b", "d"):
            raise ValueError(f"bad {response}")
        return 1.0

    with pytest.raises(RewardError, match="failed on sample 1: raised ValueError: bad b"):
        score_batch(picky, ["p"] * 4, ["a", "b", "c", "d"], ["g"] * 4, workers=4)
    assert load_reward_fn("code").treadle_sandboxed
    assert not load_reward_fn("arithmetic").treadle_sandboxed
