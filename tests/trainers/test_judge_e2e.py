"""An LLM judge (``reward.judge``) in a real two-step RL run through ``treadle train``: the
local backend, the transformers engine, a tiny judge model colocated in the actor's process.

The verdict is ``prob``: each sample's judge score is p("Yes") / (p("Yes") + p("No")) after the
judge prompt, so every reward the run logs can be checked against a forward pass of the judge
done here, weighed with the arithmetic rule's score (``reward.function_weight``)."""

from __future__ import annotations

import json

import pytest
import tiny_runs
import torch
from safetensors.torch import load_file
from tiny_models import tiny_model

from treadle.config.judge import DEFAULT_TEMPLATE
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.tasks.arithmetic import compute_score


@torch.no_grad()
def _judged(model, tokenizer, prompt: str, response: str) -> float:
    """p(Yes) / (p(Yes) + p(No)) by a forward pass of the judge."""
    content = DEFAULT_TEMPLATE.format(prompt=prompt, response=response)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    log_probs = []
    for answer in ("Yes", "No"):
        target = tokenizer.encode(answer, add_special_tokens=False)
        logits = model(torch.tensor([ids + target])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[len(ids) - 1 : -1]
        log_probs.append(float(lp.gather(-1, torch.tensor(target)[:, None]).sum()))
    return float(torch.sigmoid(torch.tensor(log_probs[0] - log_probs[1])))


def test_a_two_step_run_trains_on_the_judges_log_probs(tiny_task, tmp_path):
    judge = tiny_model(tmp_path / "judge", tiny_task["model"], max_positions=512, seed=11)
    out = tmp_path / "run"
    code, metrics = tiny_runs.train(
        out,
        tiny_runs.overrides(
            tiny_task,
            out,
            "rollout.engine=hf",
            "trainer.backend=local",
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=8",
            "trainer.total_steps=2",
            "trainer.log_samples=4",
            "trainer.log_samples_every=1",
            "reward.num_workers=0",
            "reward.function_weight=0.5",
            f"reward.judge.model_path={judge}",
            "reward.judge.verdict=prob",
            'reward.judge.token="Yes"',
            'reward.judge.against="No"',
            "reward.judge.weight=2.0",
        ),
    )
    assert code == 0 and [m["step"] for m in metrics] == [1, 2]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4  # every sample of both steps
    model = load_causal_lm(str(judge), "float32").eval()
    tokenizer = load_tokenizer(judge)
    verdicts = [_judged(model, tokenizer, s["prompt"], s["response"]) for s in samples]
    for s, verdict in zip(samples, verdicts, strict=True):
        rule = compute_score(s["prompt"], s["response"], s["ground_truth"])
        assert s["reward"] == pytest.approx(0.5 * rule + 2.0 * verdict, abs=1e-5)
    for step in (1, 2):
        mean = sum(verdicts[4 * (step - 1) : 4 * step]) / 4
        assert metrics[step - 1]["reward/judge_mean"] == pytest.approx(mean, abs=1e-6)
        assert metrics[step - 1]["timing/judge"] > 0
    assert len({round(v, 6) for v in verdicts}) > 1  # the judge tells the samples apart
    start = load_file(str(tiny_task["model"] / "model.safetensors"))
    final = load_file(str(out / "final_model" / "model.safetensors"))
    assert any(not torch.equal(start[k], final[k]) for k in start)  # the policy moved
