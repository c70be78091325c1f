"""The ``env`` agent loop: a gym-style text environment played turn by turn, token by token.

The model is a scripted replica (a test double behind the real client); the game is the one of
examples/text_game. The end-to-end run on the tiny model is the last test.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import ClassVar

import pytest
import tiny_runs

from treadle.agents.env import env_loop, load_env_loop
from treadle.agents.loops import AgentClient, Limits, Sample, _Batcher
from treadle.agents.registry import load_agent_loop
from treadle.agents.tools import Toolbox
from treadle.engines.inference import SamplingParams
from treadle.runtime.errors import ConfigError
from treadle.serving.client import RolloutClient
from treadle.serving.server import Request, Response

GAME_DIR = Path(__file__).resolve().parents[2] / "examples" / "text_game"
GAME = f"{GAME_DIR / 'game.py'}:make_env"


class ScriptedReplica:
    """Answers each request with the next scripted text + EOS, log-prob -0.5 per token."""

    def __init__(self, tok, script: list[str]) -> None:
        self.name, self.tok, self.script = "scripted", tok, list(script)
        self.calls: list[Request] = []

    async def generate(self, requests: list[Request]) -> list[Response]:
        out = []
        for r in requests:
            self.calls.append(r)
            ids = [*self.tok(self.script.pop(0), add_special_tokens=False)["input_ids"]]
            ids = [*ids, self.tok.eos_token_id][: r.params.max_new_tokens]
            stop = "stop" if ids[-1] == self.tok.eos_token_id else "length"
            out.append(Response(r.request_id, ids, [-0.5] * len(ids), stop, 7, self.name))
        return out


@pytest.fixture(scope="module")
def tok(tiny_task):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_task["model"])


def play(tok, loop, script, *, row=None, uid="games.jsonl:3", limits=None):
    """One trajectory of ``loop`` against the scripted model; (trajectory, replica)."""
    replica = ScriptedReplica(tok, script)
    client = RolloutClient([replica])
    sample = Sample(uid, [1, 2, 3], "ignored", "", row or {"low": 1, "high": 10, "seed": 4})
    params = SamplingParams(max_new_tokens=40)
    agent = AgentClient(_Batcher(client), tok, params, limits or Limits(4, 600, 64), "s1")
    try:
        t = client.run(loop(agent, sample, Toolbox([])))
    finally:
        client.close()
    t.check()
    return t, replica


def enc(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_the_game_is_played_token_by_token_and_its_reward_summed(tok):
    target = random.Random(4).randint(1, 10)  # the game's number for seed 4
    low, high = str(target - 1), str(target + 1)
    t, replica = play(tok, load_env_loop(GAME), [high, low, str(target)])
    first = (
        "I am thinking of a whole number from 1 to 10. Guess it: answer with one number. "
        "I will tell you whether it is higher or lower."
    )
    # The environment speaks first: its observation is the prompt, not the row's.
    assert t.prompt_ids == enc(tok, f"<|im_start|>user\n{first}<|im_end|>\n<|im_start|>assistant\n")
    eos = tok.eos_token_id
    turns = [[*enc(tok, guess), eos] for guess in (high, low, str(target))]
    lower = enc(tok, "\n<|im_start|>user\nLower.<|im_end|>\n<|im_start|>assistant\n")
    higher = enc(tok, "\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n")
    assert t.token_ids == turns[0] + lower + turns[1] + higher + turns[2]
    model, env = [1] * len(turns[0]), [0] * len(lower)
    assert t.loss_mask == model + env + [1] * len(turns[1]) + [0] * len(higher) + [1] * len(
        turns[2]
    )
    assert t.log_probs == [-0.5 if m else 0.0 for m in t.loss_mask]
    assert t.token_versions == [7 if m else -1 for m in t.loss_mask]
    assert (t.turns, t.stop_reason, t.reward, t.response_text) == (3, "stop", 1.0, str(target))
    assert t.info == {"env_steps": 3, "env_done": 1.0}
    # each turn continued exactly the conversation so far, in the sample's session
    assert [list(r.prompt_ids) for r in replica.calls] == [
        t.prompt_ids,
        t.prompt_ids + turns[0] + lower,
        t.prompt_ids + turns[0] + lower + turns[1] + higher,
    ]
    assert {r.session_id for r in replica.calls} == {"s1"}


def test_turns_and_the_budget_bound_an_episode(tok):
    wrong = ["0"] * 5  # never the number: 1..10
    t, _ = play(tok, load_env_loop(GAME), wrong, limits=Limits(3, 600, 64))
    assert (t.turns, t.stop_reason, t.reward, t.info["env_done"]) == (3, "max_turns", 0.0, 0.0)
    t, replica = play(tok, load_env_loop(GAME), wrong, limits=Limits(5, 30, 64))
    assert t.stop_reason == "length" and len(t.token_ids) <= 30
    for request in replica.calls:  # every turn asked for at most what was left of the budget
        used = len(request.prompt_ids) - len(t.prompt_ids)
        assert request.params.max_new_tokens == min(40, 30 - used)


class Recorder:
    """An environment of the older gym shape (bare reset, 4-tuple step), async, recording what
    it is given; its observations are long."""

    made: ClassVar[list[Recorder]] = []

    def __init__(self, row):
        self.row, self.seeds, self.actions, self.closed = row, [], [], False
        Recorder.made.append(self)

    async def reset(self, seed=None):
        self.seeds.append(seed)
        return "go"

    async def step(self, action):
        self.actions.append(action)
        return "word " * 100, 0.25, len(self.actions) == 2, {}

    def close(self):
        self.closed = True


def test_gym_shapes_async_envs_seeds_cut_observations_and_close(tok):
    Recorder.made.clear()
    loop = env_loop(Recorder)
    t, _ = play(tok, loop, ["a", "b"], row={"seed": 11}, limits=Limits(4, 600, 5))
    play(tok, loop, ["a", "b"], row={}, uid="u:9")
    play(tok, loop, ["a", "b"], row={}, uid="u:9")
    first, second, third = Recorder.made
    assert first.seeds == [11] and first.actions == ["a", "b"] and first.closed
    assert second.seeds == third.seeds != [None]  # a prompt's samples play the same episode
    assert (t.reward, t.turns, t.stop_reason) == (0.5, 2, "stop")
    cut = tok.decode(enc(tok, "word " * 100)[:5]) + " ...(cut)"  # 5 tokens, then the mark
    assert f"<|im_start|>user\n{cut}<|im_end|>" in tok.decode(t.token_ids)


class NoSeed:
    def __init__(self, row):
        self.reset_args = None

    def reset(self):
        return ("hello", {"info": 1})

    def step(self, action):
        return ["a list, not a tuple"]


class NumbersNotText:
    def __init__(self, row):
        pass

    def reset(self, seed=None, options=None):
        return [1, 2, 3], {}


def test_an_environment_that_breaks_the_api_is_named(tok):
    with pytest.raises(TypeError, match=r"step\(\) returned list .* expected \(observation, rew"):
        play(tok, env_loop(NoSeed), ["a"])
    with pytest.raises(TypeError, match=r"reset\(\) gave a list observation; the env loop needs"):
        play(tok, env_loop(NumbersNotText), ["a"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.agent_loop=env"], "rollout.agent_loop=env needs rollout.env"),
        ([f"rollout.env={GAME}"], "rollout.env is played by the env agent loop"),
        (
            ["rollout.agent_loop=env", f"rollout.env={GAME}", "data.apply_chat_template=false"],
            "set data.apply_chat_template=true",
        ),
    ],
)
def test_env_config_mistakes_are_named(overrides, message):
    from treadle.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_env_loop_is_a_built_in_loop_by_name():
    loop = load_agent_loop("env", GAME)
    assert asyncio.iscoroutinefunction(loop) and loop.__qualname__ == f"env {GAME}"
    with pytest.raises(ConfigError, match=r"rollout.agent_loop=env needs rollout.env"):
        load_agent_loop("env")
    with pytest.raises(ConfigError, match=r"rollout.env: file 'nope\.py' does not exist"):
        load_agent_loop("env", "nope.py:make_env")
    with pytest.raises(ConfigError, match="built-in loops are single_turn, tools, env"):
        load_agent_loop("envs")


def test_check_loads_the_environment_factory(tiny_task, tmp_path):
    from treadle.check.run import check
    from treadle.config import load_config

    cfg = load_config(
        None,
        [
            f"model.path={tiny_task['model']}",
            f"data.train_files=[{GAME_DIR / 'games.jsonl'}]",
            "rollout.agent_loop=env",
            f"rollout.env={tmp_path / 'missing.py'}:make_env",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(ConfigError, match=r"rollout.env: file '.*missing.py' does not exist"):
        check(cfg, "train")


# ----------------------------------------------------------------------------- end to end


def test_the_text_game_trains_two_steps(long_task, tmp_path):
    out = tmp_path / "run"
    code, rows = tiny_runs.train(
        out,
        tiny_runs.overrides(
            long_task,
            out,
            f"data.train_files=[{GAME_DIR / 'games.jsonl'}]",
            "rollout.engine=hf",
            "rollout.agent_loop=env",
            f"rollout.env={GAME}",
            "rollout.max_new_tokens=8",
            "rollout.max_turns=3",
            "rollout.max_tool_response_tokens=16",
            "rollout.max_response_length=96",
            "trainer.backend=local",
            "trainer.total_steps=2",
            "trainer.save_every=0",
        ),
    )
    assert code == 0
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 1.0 <= r["agent/turns_mean"] <= 3.0
        assert r["agent/env_steps_mean"] == r["agent/turns_mean"]  # one action per turn
        assert 0.0 <= r["reward/mean"] <= 1.0 and "agent/env_done_mean" in r
