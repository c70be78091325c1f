"""Reward functions by name or from a user file, and the checks on what they return."""

from __future__ import annotations

import math
import os
import pickle
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from treadle.rewards import (
    Scorer,
    component_matrix,
    load_reward_fn,
    sandboxed_reward,
    score_batch,
)
from treadle.runtime.errors import ConfigError, RewardError

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

def huge(prompt, response, ground_truth):
    return 1e39  # finite in Python, inf in float32

def quits(prompt, response, ground_truth):
    import sys
    if response == "exit":
        sys.exit(3)
    return 1.0

def vanishes(prompt, response, ground_truth):
    import os
    if response == "bye":
        os._exit(7)
    return 1.0

def self_kill(prompt, response, ground_truth):
    import os, signal
    if response == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0

def dies_once(prompt, response, ground_truth):
    # kills its process the first time it sees `response`; scores len(response) the next
    import os, pathlib, signal
    marker = pathlib.Path(__file__).with_name(f"died_{response}")
    if response.startswith("die") and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    if response == "raise":
        raise ValueError("no")
    return len(response)

def hangs(prompt, response, ground_truth):
    import time
    if response == "hang":
        time.sleep(3600)
    return float(len(response))

def pid(prompt, response, ground_truth):
    import os
    return float(os.getpid())

def two_args(prompt, response):
    return 1.0

def keywords(prompt, response, ground_truth, *, scale):
    return scale

def parts(prompt, response, ground_truth):
    import numpy as np
    exact = np.float32(response == ground_truth)  # numpy numbers count
    return {"format": float(response.startswith("<")), "accuracy": exact}

def bad_part(prompt, response, ground_truth):
    return {"format": 1.0, "accuracy": float("nan") if response == "b" else 0.0}

def mixed(prompt, response, ground_truth):
    return 1.0 if response == "x" else {"format": 1.0}

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
    ("name", "shown"),
    [("text", "'abc'"), ("nothing", "None"), ("not_a_number", "nan"), ("huge", "1e+39")],
)
def test_non_numbers_are_rejected(user_file: str, name: str, shown: str):
    spec = f"{user_file}:{name}"
    with pytest.raises(RewardError) as info:
        score_batch(load_reward_fn(spec), ["p"], ["r"], ["g"])
    assert str(info.value) == (
        f"reward function '{spec}' failed on sample 0: returned {shown}, not a finite number "
        "(float32) (prompt 'p', response 'r')"
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


@pytest.mark.parametrize(
    ("name", "signature"),
    [
        ("two_args", "(prompt, response)"),
        ("keywords", "(prompt, response, ground_truth, *, scale)"),
    ],
)
def test_a_wrong_signature_is_a_config_error_at_load(user_file: str, name: str, signature: str):
    spec = f"{user_file}:{name}"
    with pytest.raises(ConfigError) as info:
        load_reward_fn(spec)
    assert str(info.value) == (
        f"reward.function: '{spec}' has the signature {signature}, but a reward function is "
        "called as fn(prompt, response, ground_truth)"
    )


def test_sys_exit_in_process_is_an_error_not_the_end_of_the_run(user_file: str):
    with pytest.raises(RewardError, match=r"failed on sample 0: raised SystemExit: 3"):
        score_batch(load_reward_fn(f"{user_file}:quits"), ["p"], ["exit"], ["g"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def test_the_pool_scores_in_order_in_other_processes_and_leaves_none_behind(user_file: str):
    with Scorer(f"{user_file}:pid", num_workers=2, timeout_s=10) as scorer:
        assert scorer.pool is not None
        pids = scorer(["p"] * 6, ["r"] * 6, ["g"] * 6)
        workers = scorer.pool.pids()
        assert set(pids) <= set(map(float, workers)) and os.getpid() not in pids
        assert 1 <= len(set(pids)) <= 2
        length = Scorer(f"{user_file}:length", num_workers=2)
        try:
            assert length(["p"] * 5, ["", "a", "ab", "abc", "abcd"], ["g"] * 5) == pytest.approx(
                [0.0, 0.1, 0.2, 0.3, 0.4]
            )
        finally:
            length.close()
    assert not any(_alive(p) for p in workers)


@pytest.mark.parametrize(
    ("name", "response", "problem"),
    [
        ("quits", "exit", "raised SystemExit: 3"),
        ("vanishes", "bye", r"its worker process ended \(exit code 7\) while scoring it"),
        ("self_kill", "kill", r"its worker process ended \(killed by SIGKILL\) while scoring it"),
    ],
)
def test_a_reward_that_ends_its_process_is_an_error_naming_it(
    user_file: str, name: str, response: str, problem: str
):
    spec = f"{user_file}:{name}"
    with Scorer(spec, num_workers=2) as scorer:
        with pytest.raises(RewardError) as info:
            scorer(["p", "q", "s"], ["fine", response, "fine"], ["g"] * 3)
        assert re.fullmatch(
            rf"reward function '{re.escape(spec)}' failed on sample 1: {problem} "
            rf"\(prompt 'q', response '{response}'\)",
            str(info.value),
        ), str(info.value)
        # the pool goes on (a process that ended has a new one in its place)
        assert scorer(["p"] * 3, ["fine"] * 3, ["g"] * 3) == [1.0] * 3


def test_a_worker_that_dies_scoring_is_started_again_and_the_sample_scored_again(
    user_file: str,
):
    with Scorer(f"{user_file}:dies_once", num_workers=2) as scorer:
        assert scorer.pool is not None and scorer.restarts == 0
        responses = ["a", "die1", "abc", "die22", "abcde"]
        assert scorer(["p"] * 5, responses, ["g"] * 5) == [1.0, 4.0, 3.0, 5.0, 5.0]
        assert scorer.restarts == 2
        assert all(Path(user_file).with_name(f"died_{r}").exists() for r in ("die1", "die22"))
        assert scorer(["p"] * 2, ["die1", "xy"], ["g"] * 2) == [4.0, 2.0]  # no deaths now
        assert scorer.restarts == 2
        # a retry still runs when another sample fails meanwhile: the error names that one
        with pytest.raises(RewardError, match="failed on sample 1: raised ValueError: no"):
            scorer(["p"] * 3, ["die3", "raise", "abc"], ["g"] * 3)
        assert scorer.restarts == 3
    with Scorer(f"{user_file}:dies_once", num_workers=0) as scorer:
        assert scorer.restarts == 0  # no pool, nothing to restart


def test_a_worker_killed_between_batches_is_started_again(user_file: str):
    with Scorer(f"{user_file}:dies_once", num_workers=2) as scorer:
        assert scorer(["p"] * 2, ["a", "bc"], ["g"] * 2) == [1.0, 2.0]
        assert scorer.pool is not None
        # the ready ones (one may still be loading: one that dies loading is an error)
        ready = [w.process.pid for w in scorer.pool._workers if w.ready]
        for pid in ready:  # idle: nothing in flight
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # (its own child: reaped, so it is surely gone)
        assert scorer(["p"] * 3, ["a", "bc", "def"], ["g"] * 3) == [1.0, 2.0, 3.0]
        assert ready and scorer.restarts == len(ready)


def test_a_reward_that_kills_its_process_every_time_is_the_error_after_one_retry(
    user_file: str,
):
    spec = f"{user_file}:self_kill"
    with Scorer(spec, num_workers=1) as scorer:
        with pytest.raises(RewardError) as info:
            scorer(["p", "q"], ["fine", "kill"], ["g"] * 2)
        assert str(info.value) == (
            f"reward function '{spec}' failed on sample 1: its worker process ended (killed by "
            "SIGKILL) while scoring it (prompt 'q', response 'kill')"
        )
        assert scorer.restarts == 2  # the retry's process died too
        assert scorer(["p"], ["fine"], ["g"]) == [1.0]


def test_a_hanging_reward_times_out_and_the_pool_goes_on(user_file: str):
    spec = f"{user_file}:hangs"
    with Scorer(spec, num_workers=2, timeout_s=1.0) as scorer:
        assert scorer.pool is not None
        scorer(["p"], ["warm"], ["g"])  # processes started
        before = scorer.pool.pids()
        start = time.monotonic()
        with pytest.raises(RewardError) as info:
            scorer(["p"] * 4, ["a", "hang", "abc", "abcd"], ["g"] * 4)
        assert time.monotonic() - start < 5
        assert str(info.value) == (
            f"reward function '{spec}' failed on sample 1: took longer than reward.timeout_s=1 s "
            "(its worker process was killed and a new one started) "
            "(prompt 'p', response 'hang')"
        )
        assert scorer(["p"] * 2, ["ab", "abc"], ["g"] * 2) == [2.0, 3.0]
        assert len(set(before) - set(scorer.pool.pids())) == 1  # one process was replaced
        assert not any(_alive(p) for p in set(before) - set(scorer.pool.pids()))


def test_zero_workers_call_the_function_in_this_process(user_file: str):
    with Scorer(f"{user_file}:pid", num_workers=0) as scorer:
        assert scorer.pool is None
        assert scorer(["p"] * 2, ["r"] * 2, ["g"] * 2) == [float(os.getpid())] * 2
    with Scorer("code", num_workers=3) as scorer:  # sandboxed: threads, no pool
        assert scorer.pool is None


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dict_reward_scores_the_sum_and_keeps_its_components(user_file: str, workers: int):
    spec = f"{user_file}:parts"
    with Scorer(spec, num_workers=workers) as scorer:
        scores = scorer(["p"] * 3, ["<a>", "b", "<c>"], ["<a>", "x", "y"])
    assert scores == [2.0, 0.0, 1.0]
    assert scores.components == [
        {"format": 1.0, "accuracy": 1.0},
        {"format": 0.0, "accuracy": 0.0},
        {"format": 1.0, "accuracy": 0.0},
    ]
    matrix = component_matrix(scores, ["accuracy", "format"], spec)
    assert matrix.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]
    with pytest.raises(RewardError, match=r"components \['accuracy', 'format'\] for sample 0, "
                       r"without \['length'\] of algorithm.gdpo_reward_keys"):  # fmt: skip
        component_matrix(scores, ["format", "length"], spec)
    plain = score_batch(load_reward_fn(f"{user_file}:length"), ["p"], ["ab"], ["g"])
    assert plain.components is None
    with pytest.raises(RewardError, match=r"returned numbers, but algorithm\.gdpo_reward_keys"):
        component_matrix(plain, ["format"], "length")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_component_names_the_function_the_sample_and_the_component(
    user_file: str, workers: int
):
    spec = f"{user_file}:bad_part"
    with Scorer(spec, num_workers=workers) as scorer, pytest.raises(RewardError) as info:
        scorer(["p"] * 3, ["a", "b", "c"], ["g"] * 3)
    assert str(info.value) == (
        f"reward function '{spec}' failed on sample 1: returned component 'accuracy': nan, not "
        "a finite number (float32) (prompt 'p', response 'b')"
    )


def test_numbers_and_dicts_do_not_mix_in_a_batch(user_file: str):
    spec = f"{user_file}:mixed"
    with pytest.raises(RewardError, match=r"failed on sample 1: returned \{'format': 1.0\}, but "
                       "sample 0 returned a number: return one kind"):  # fmt: skip
        score_batch(load_reward_fn(spec), ["p"] * 2, ["x", "y"], ["g"] * 2)
    with pytest.raises(RewardError, match="returned an empty dict"):
        score_batch(lambda p, r, g: {}, ["p"], ["r"], ["g"])
