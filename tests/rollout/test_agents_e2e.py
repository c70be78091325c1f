"""Agent loops end to end on a tiny model: a custom two-turn loop by path (hf engine, local
backend) and the tools loop through `treadle train` (vLLM replicas, Ray)."""

from __future__ import annotations

import itertools
from pathlib import Path

import tiny_runs
import torch

from treadle.config import load_config
from treadle.trainers.rl import RLTrainer

EXAMPLE_LOOP = Path(__file__).resolve().parents[2] / "examples" / "tools" / "check_loop.py"
CALCULATOR = "treadle.tasks.calculator:calculator"


def overrides(task, out, *extra: str) -> list[str]:
    return tiny_runs.overrides(
        task, out, "data.max_prompt_length=896", "rollout.max_new_tokens=12", *extra
    )


def two_turns(task, out, reward: str, *extra: str) -> list[str]:
    """The two-turn example loop with the calculator on the hf engine, in this process."""
    return overrides(
        task,
        out,
        "rollout.engine=hf",
        "trainer.backend=local",
        f"rollout.agent_loop={EXAMPLE_LOOP}:answer_then_check",
        f"rollout.tools=[{CALCULATOR}]",
        "rollout.max_response_length=160",
        f"reward.function={reward}",
        *extra,
    )


def test_custom_loop_by_path_two_turns_masks_and_trains(long_task, length_reward, tmp_path):
    cfg = load_config(None, two_turns(long_task, tmp_path / "run", length_reward))
    trainer = RLTrainer(cfg)
    try:
        m: dict[str, float] = {}
        batch = trainer.source.sample(1, m)
        mask, attention = batch["response_mask"], batch["response_attention_mask"]
        assert batch["responses"].shape[1] == 160
        assert batch["turns"].tolist() == [2.0] * 4
        assert bool((mask <= attention).all())  # trained tokens are attended tokens
        for row in range(4):
            env = batch["responses"][row][(attention[row] == 1) & (mask[row] == 0)]
            text = trainer.rollout.agents.tokenizer.decode(env)
            question = batch["prompt_text"][row].removeprefix("What is ").rstrip("?")
            truth = batch["ground_truth"][row]
            assert f"The calculator says {question} = {truth}." in text
            # model tokens, then the note, then model tokens: the mask has exactly one gap
            on = mask[row][: int(attention[row].sum())].tolist()
            assert on[0] == 1 and on[-1] == 1
            assert sum(1 for a, b in itertools.pairwise(on) if a != b) == 2
        engine = trainer.group.workers[0].server.engine.model  # synced after the update
        before = {n: p.detach().clone() for n, p in engine.named_parameters()}
        metrics = trainer.run_step(1)
        after = dict(engine.named_parameters())
    finally:
        trainer.close()
    assert metrics["agent/turns_mean"] == 2.0
    assert metrics["agent/calculator_errors_mean"] == 0.0
    assert metrics["response/total_length_mean"] > metrics["response/length_mean"]
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_gemma_model_s_turns_go_as_its_template_writes_them(long_task, length_reward, tmp_path):
    """A tiny random Gemma 2 with Gemma 2's chat template (no system message, user and model
    turns alternating, each closed by <end_of_turn>, not its EOS) through the two-turn loop and
    the hf engine: the system prompt is in the first user turn, and between the model's turns
    the loop puts exactly what the template writes (after <end_of_turn> its newline), and a
    step runs on them."""
    from dataclasses import replace

    from tiny_models import TINY_SHAPE, chat_style

    from treadle.data.templating import end_of_turn
    from treadle.models.loading import load_tokenizer
    from treadle.tasks.arithmetic import build_tiny_model

    tok = chat_style(load_tokenizer(long_task["model"]), "gemma2")
    shape = replace(TINY_SHAPE, arch="gemma2", max_positions=1152)
    folder = build_tiny_model(tok, tmp_path / "gemma", shape, head_dim=32)
    more = [f"model.path={folder}", "data.system_prompt=Be brief."]
    cfg = load_config(None, two_turns(long_task, tmp_path / "run", length_reward, *more))
    trainer = RLTrainer(cfg)
    try:
        batch = trainer.source.sample(1, {})
        metrics = trainer.run_step(1)
    finally:
        trainer.close()
    end = end_of_turn(tok)[0]
    # the system message (the system prompt, then the tools' instructions) opens the user turn
    prompt = tok.decode(batch["prompts"][0], skip_special_tokens=False)
    assert "<bos><start_of_turn>user\nBe brief.\n\n# Tools\n" in prompt
    question = batch["prompt_text"][0]
    assert prompt.endswith(f"\n\n{question}<end_of_turn>\n<start_of_turn>model\n")
    mask, attention = batch["response_mask"], batch["response_attention_mask"]
    assert batch["turns"].tolist() == [2.0] * 4
    for row in range(4):
        ids = batch["responses"][row].tolist()
        first = next(i for i, m in enumerate(mask[row].tolist()) if m == 0)  # turn 1's end
        note = next(i for i in range(first, len(ids)) if mask[row][i] == 1)  # turn 2's start
        between = tok.decode(ids[first:note])
        ended = ids[first - 1] == end  # turn 1 closed its turn, or was cut at its length
        # (a turn cut at its length is closed as the template closes one)
        opens = "\n<start_of_turn>user\n" if ended else "<end_of_turn>\n<start_of_turn>user\n"
        assert between.startswith(opens)
        assert between.endswith("<end_of_turn>\n<start_of_turn>model\n")
        assert int(attention[row].sum()) >= note
    assert metrics["agent/turns_mean"] == 2.0 and metrics["agent/errors"] == 0.0


def test_tools_loop_end_to_end_with_vllm_replicas(long_task, tmp_path, ray_session):
    out = tmp_path / "run"
    code, rows = tiny_runs.train(
        out,
        overrides(
            long_task,
            out,
            "rollout.engine=vllm",
            "rollout.kv_cache_gib=0.25",
            "trainer.backend=ray",
            "trainer.total_steps=2",
            "trainer.save_every=0",
            "rollout.agent_loop=tools",
            f"rollout.tools=[{CALCULATOR}]",
            "rollout.max_turns=3",
            "rollout.max_tool_response_tokens=16",
            "rollout.max_response_length=200",
        ),
    )
    assert code == 0
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 1.0 <= r["agent/turns_mean"] <= 3.0
        assert r["agent/tool_calls_mean"] >= 0.0 and "agent/tool_errors_mean" in r


def test_single_turn_loop_samples_what_the_plain_fan_out_samples(tiny_task, tmp_path):
    """The single-turn agent loop against the driver's generate before agent loops (one request
    per sample, all sent at once, a prompt's samples in one session): the same tokens and
    log-probs, so every number downstream is the same."""
    from dataclasses import replace

    from treadle.data import prompt_batch
    from treadle.rollout.sources import sampling_params
    from treadle.serving.server import Request

    cfg = load_config(
        None,
        [
            f"model.path={tiny_task['model']}",
            f"data.train_files=[{tiny_task['train']}]",
            "data.batch_size=4",
            "rollout.n=3",
            "rollout.max_new_tokens=12",
            "rollout.engine=hf",
            "actor.ppo_mini_batch_size=12",
            "trainer.backend=local",
            "trainer.progress=false",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    trainer = RLTrainer(cfg)
    try:
        prompts = prompt_batch(trainer.train_ds, [0, 1, 2, 3], trainer.train_ds.pad_id)
        params = sampling_params(trainer.cfg, step=1)
        batch = trainer.rollout.generate(prompts, params)
        client = trainer.rollout.client
        sessions = [client.new_id("s") for _ in range(4)]
        requests = [
            Request(
                client.new_id(), tuple(trainer.train_ds[i]["prompt_ids"]), replace(params, n=1), s
            )
            for i, s in enumerate(sessions)
            for _ in range(3)
        ]
        responses = client.generate(requests)
    finally:
        trainer.close()
    assert "response_attention_mask" not in batch and "turns" not in batch
    for row, r in enumerate(responses):
        n = len(r.token_ids)
        assert batch["responses"][row, :n].tolist() == r.token_ids
        assert batch["response_mask"][row].tolist() == [1] * n + [0] * (12 - n)
        assert batch["rollout_log_probs"][row, :n].tolist() == r.log_probs
    assert len({tuple(r.token_ids) for r in responses}) > 1  # sampled, not all alike
