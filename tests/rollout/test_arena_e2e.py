"""A TextArena game, unchanged, trained on for two steps through the run's OpenAI-compatible
endpoint and the black-box agent loop (tiny model, hf engine, local backend)."""

from __future__ import annotations

import json

import pytest
import tiny_runs


@pytest.mark.slow
def test_a_textarena_game_trains_two_steps_through_the_endpoint(long_task, tmp_path):
    games = tmp_path / "games.jsonl"
    rows = [
        {"prompt": "p", "answer": "a", "env_id": "GuessTheNumber-v0-raw", "seed": i, "max_turns": 2}
        for i in range(4)
    ]
    games.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    code, metrics = tiny_runs.train(
        out,
        tiny_runs.overrides(
            long_task,
            out,
            f"data.train_files=[{games}]",
            "data.max_prompt_length=768",  # the endpoint takes prompts up to this long
            "rollout.engine=hf",
            "rollout.agent_loop=openai:treadle.agents.arena:play",
            "rollout.max_new_tokens=8",
            "rollout.max_response_length=120",
            "trainer.backend=local",
            "trainer.total_steps=2",
            "trainer.save_every=0",
        ),
    )
    assert code == 0
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["agent/errors"] == 0
        assert 1.0 <= m["agent/moves_mean"] <= 2.0  # the row's bound, or the game ended first
        assert 0.0 <= m["reward/mean"] <= 1.0 and "agent/invalid_move_mean" in m
