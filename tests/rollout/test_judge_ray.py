"""The LLM judge split from the actors under Ray (``reward.judge.placement=split``), one Ray
start: a judge replica in a placement group of its own gives each sample the probability of
its reference answer that a forward pass of the judge gives here; killed, it is started again
(``rollout.max_restarts``) and the batch it held is answered all the same."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from tiny_models import tiny_model

from treadle.config import load_config
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.rewards.results import with_rows
from treadle.rollout.judge import LLMJudge

pytestmark = pytest.mark.slow

TEMPLATE = "Reply: {response} The answer?"


@torch.no_grad()
def _forward(model, tokenizer, response: str, answer: str) -> float:
    """p(answer | the judge prompt) by a forward pass of the judge."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": TEMPLATE.format(response=response)}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    target = tokenizer.encode(answer, add_special_tokens=False)
    logits = model(torch.tensor([ids + target])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(ids) - 1 : -1]
    return math.exp(float(lp.gather(-1, torch.tensor(target)[:, None]).sum()))


def test_a_split_judge_scores_as_its_forward_pass_and_is_restarted(
    tiny_task, ray_session, tmp_path
):
    judge_path = tiny_model(tmp_path / "judge", tiny_task["model"], max_positions=512, seed=5)
    cfg = load_config(
        None,
        [
            f"model.path={tiny_task['model']}",
            "trainer.backend=ray",
            "rollout.max_restarts=1",
            f"reward.judge.model_path={judge_path}",
            "reward.judge.placement=split",
            "reward.judge.cpus_per_replica=0.5",
            f'reward.judge.template="{TEMPLATE}"',
            "reward.judge.verdict=prob",
            'reward.judge.token="{answer}"',
        ],
    )
    responses = ["1 + 1 = 2", "it is 17", "3", "no idea at all"]
    rows = [{"answer": a} for a in ("2", "17", "30", "5")]
    model = load_causal_lm(str(judge_path), torch.float32).eval()
    tokenizer = load_tokenizer(judge_path)
    expected = [
        _forward(model, tokenizer, r, row["answer"]) for r, row in zip(responses, rows, strict=True)
    ]
    judge = LLMJudge(cfg)
    try:
        judge.start(None)  # type: ignore[arg-type]  # (split: no actors' group is needed)
        assert judge.rollout is not None and judge.rollout.names == ["judge replica 0"]
        outcomes = judge(with_rows(["p"] * 4, responses, ["t"] * 4, rows))
        assert [score for score, _ in outcomes] == pytest.approx(expected, abs=1e-6)
        pid = judge.rollout.replicas[0].describe.remote()
        os.kill(ray_session.get(pid)["pid"], signal.SIGKILL)
        again = judge(with_rows(["p"] * 4, responses, ["t"] * 4, rows))  # restarted, then answered
        assert [score for score, _ in again] == pytest.approx(expected, abs=1e-6)
        assert judge.rollout.counters.get("rollout/replica_restarts") == 1.0
    finally:
        judge.close()
