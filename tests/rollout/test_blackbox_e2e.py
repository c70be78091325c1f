"""Black-box agents end to end on the tiny model: code that imports only `openai` talks to the
run's endpoint; its recorded calls are what is trained on (hf engine, local backend), a run of
two steps under Ray (the endpoint in the driver, the replica in the actor's process; the hf
engine: agents through vLLM replicas are tests/rollout/test_agents_e2e.py's tools loop), and
bad agents stopping the run with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_runs

from treadle.config import load_config
from treadle.data import prompt_batch
from treadle.rollout.sources import sampling_params
from treadle.trainers.rl import RLTrainer

AGENT = Path(__file__).resolve().parents[2] / "examples" / "openai_agent" / "agent.py"


def overrides(task, out, *extra: str) -> list[str]:
    return tiny_runs.overrides(
        task,
        out,
        "data.max_prompt_length=48",
        "rollout.max_new_tokens=8",
        "rollout.max_response_length=72",
        *extra,
    )


def test_the_agents_recorded_calls_are_the_trained_tokens(tiny_task, tmp_path):
    cfg = load_config(
        None,
        overrides(
            tiny_task,
            tmp_path / "run",
            "rollout.engine=hf",
            "trainer.backend=local",
            f"rollout.agent_loop=openai:{AGENT}:answer_then_check",
        ),
    )
    trainer = RLTrainer(cfg)
    recorded: list = []
    endpoint = trainer.rollout.endpoint
    close = endpoint.close_session

    def keep(session):
        calls = close(session)
        recorded.append(sorted(calls, key=lambda c: c.index))
        return calls

    endpoint.close_session = keep
    try:
        prompts = prompt_batch(trainer.train_ds, [0, 1], trainer.train_ds.pad_id)
        batch = trainer.rollout.generate(prompts, sampling_params(cfg, 1))
        metrics = trainer.run_step(1)
    finally:
        trainer.close()
    assert len(recorded) >= 4 and all(len(calls) == 2 for calls in recorded[:4])
    rows = iter(range(len(batch)))
    for calls in recorded[:4]:  # each session: one row, or one per segment
        first, second = calls
        row = next(rows)
        prompt = batch["prompts"][row][batch["prompt_mask"][row].bool()].tolist()
        assert prompt == first.prompt_ids
        mask = batch["response_mask"][row].tolist()
        tokens = batch["responses"][row].tolist()
        n1 = len(first.completion_ids)
        assert tokens[:n1] == first.completion_ids and mask[:n1] == [1] * n1
        assert batch["rollout_log_probs"][row, :n1].tolist() == pytest.approx(first.log_probs)
        if second.prompt_ids[: len(prompt) + n1] == prompt + first.completion_ids:
            between = second.prompt_ids[len(prompt) + n1 :]
            end = n1 + len(between) + len(second.completion_ids)
            assert tokens[n1:end] == between + second.completion_ids
            assert mask[:end] == [1] * n1 + [0] * len(between) + [1] * len(second.completion_ids)
        else:  # the prefix broke: the second call is a sample of its own
            row = next(rows)
            assert batch["prompts"][row][batch["prompt_mask"][row].bool()].tolist() == (
                second.prompt_ids
            )
    assert batch["trajectory_reward"].tolist() == [
        r for r in batch["trajectory_reward"].tolist() if r in (0.0, 1.0)
    ]
    assert metrics["agent/errors"] == 0 and "agent/prefix_breaks" in metrics


GYM_AGENT = """
async def ask_twice(client, row):
    # reasoning-gym's question, then "Sure?"; None: reward.function scores the last answer
    messages = [{"role": "user", "content": row["question"]}]
    first = await client.chat.completions.create(model="m", messages=messages)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Sure?"},
    ]
    await client.chat.completions.create(model="m", messages=messages)
    return None
"""


def test_a_black_box_agent_on_reasoning_gym_trains_two_steps_under_ray(
    tiny_task, tmp_path, ray_session
):
    agent, out = tmp_path / "gym_agent.py", tmp_path / "run"
    agent.write_text(GYM_AGENT)
    code, rows = tiny_runs.train(
        out,
        overrides(
            tiny_task,
            out,
            "data.train_files=[]",
            "data.source=reasoning_gym",
            "data.reasoning_gym.datasets=[{name: basic_arithmetic, config: {min_terms: 2, "
            "max_terms: 2, min_digits: 1, max_digits: 1}}]",
            "data.reasoning_gym.size=16",
            "data.reasoning_gym.val_size=4",
            "data.system_prompt=Be brief.",
            "reward.function=reasoning_gym",
            "rollout.engine=hf",
            "trainer.backend=ray",
            "trainer.total_steps=2",
            "trainer.save_every=0",
            "trainer.eval_every=2",
            f"rollout.agent_loop=openai:{agent}:ask_twice",
        ),
    )
    assert code == 0
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # two calls a run: one sample of two turns, or two of one (a broken prefix)
        assert r["agent/errors"] == 0 and 0 <= r["agent/prefix_breaks"] <= 4
        assert r["agent/turns_mean"] == pytest.approx(8 / (4 + r["agent/prefix_breaks"]))
        assert 0.0 <= r["reward/mean"] <= 1.0  # reasoning-gym's score_answer
    assert 0.0 <= rows[-1]["eval/val/accuracy"] <= 1.0


BAD_AGENTS = """
import asyncio

calls = 0


async def flaky(client, row):
    '''Fine on the first four runs (step 1), then each run goes wrong as MODE says.'''
    global calls
    calls += 1
    reply = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
    )
    if calls <= 4:
        return 1.0
    if MODE == "raise":
        raise RuntimeError("the checker is down")
    if MODE == "hang":
        await asyncio.Event().wait()
    return reply.choices[0].message.content  # a string, not a reward
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "problem"),
    [
        ("raise", "RuntimeError: the checker is down"),
        ("hang", "ran longer than rollout.agent_timeout_s=2 s"),
        ("junk", "TypeError: it returned '"),
    ],
)
def test_bad_agents_stop_the_run_with_one_line_and_lose_nothing(
    tiny_task, tmp_path, capsys, mode, problem
):
    agent = tmp_path / "bad_agent.py"
    agent.write_text(f"MODE = {mode!r}\n{BAD_AGENTS}")
    out = tmp_path / "run"
    code, rows = tiny_runs.train(
        out,
        overrides(
            tiny_task,
            out,
            "rollout.engine=hf",
            "trainer.backend=local",
            "trainer.total_steps=3",
            "trainer.save_every=1",
            "rollout.agent_timeout_s=2",
            f"rollout.agent_loop=openai:{agent}:flaky",
        ),
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert (
        f"4 of 4 agent runs failed in this batch, more than rollout.max_agent_error_frac=0.25; "
        f"the first: agent loop '{agent}:flaky' failed on sample train.jsonl:"
    ) in err
    assert problem in err
    # step 1 is kept: its metrics and its sealed checkpoint
    assert [r["step"] for r in rows] == [1]
    assert (out / "checkpoints" / "step_1").is_dir()
