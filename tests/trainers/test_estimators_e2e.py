"""One RL step per advantage estimator added for verl parity, on the tiny model (local backend).

One trainer serves every name (its estimator is swapped between steps): the reward returns
named components (GDPO reads them) and the old-log-prob pass asks the actor for Σπ² (the
optimal token baseline reads it). Each step must hand the update the advantages the
registered function computes from the batch, with finite metrics and a nonzero gradient.
"""

from __future__ import annotations

import math

import pytest
import tiny_runs
import torch
from algorithm_calls import estimate
from transformers import AutoModelForCausalLM

from treadle.algorithms import ADV_ESTIMATORS
from treadle.config import load_config
from treadle.protocol import Batch
from treadle.trainers.rl import RLTrainer

N = 4
KEYS = ["length", "parity"]
WEIGHTS = [1.0, 0.5]


@pytest.fixture(scope="module")
def parts_reward(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "parts.py"
    path.write_text(
        "def score(prompt, response, ground_truth):\n"
        "    return {'length': (len(response) % 7) / 6, 'parity': float(len(response) % 2)}\n"
    )
    return f"{path}:score"


@pytest.fixture(scope="module")
def run(tiny_task, parts_reward, tmp_path_factory):
    """The trainer, and ``step(name)``: one step with that estimator -> (metrics, the batch
    the update got, the actor's weights before and after)."""
    cfg = load_config(
        None,
        tiny_runs.overrides(
            tiny_task,
            tmp_path_factory.mktemp("run"),
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=10",
            "rollout.temperature=0.9",
            "rollout.engine=hf",
            "rollout.dtype=bfloat16",  # the sampler differs: rollout correction has work to do
            "actor.lr=1e-3",
            "algorithm.adv_estimator=optimal_token_baseline",
            "algorithm.rollout_correction=tis",
            f"algorithm.gdpo_reward_keys=[{','.join(KEYS)}]",
            f"algorithm.gdpo_reward_weights=[{','.join(map(str, WEIGHTS))}]",
            f"reward.function={parts_reward}",
            "trainer.backend=local",
            prompts=3,
            samples=N,
        ),
    )
    t = RLTrainer(cfg)
    worker = t.group.workers[0]  # local backend: the worker object itself
    update = t.group.update_actor
    seen: list[Batch] = []

    def spy(batch: Batch) -> dict[str, float]:
        seen.append(batch)
        return update(batch)

    t.group.update_actor = spy  # type: ignore[method-assign]
    counter = iter(range(1, 100))

    def step(name: str):
        t.estimator, t.needs = ADV_ESTIMATORS.get(name), ADV_ESTIMATORS.needs(name)
        t.cfg.algorithm.adv_estimator = name  # its settings are built from the config's name
        before = {k: v.clone() for k, v in worker.actor.full_state()}
        m = t.step(next(counter))
        after = {k: v.clone() for k, v in worker.actor.full_state()}
        return m, seen[-1], before, after

    yield t, step
    t.close()


def recomputed(name: str, batch: Batch) -> torch.Tensor:
    """The registered function on the batch's own fields, as a user would call it."""
    kw: dict = {}
    if "sum_pi_squared" in ADV_ESTIMATORS.needs(name):
        ratio = (batch["old_log_probs"] - batch["rollout_log_probs"]).clamp(-20, 20).exp()
        kw = {
            "old_log_probs": batch["old_log_probs"],
            "sum_pi_squared": batch["sum_pi_squared"],
            "rollout_is_weights": ratio.clamp(max=2.0) * batch["response_mask"],  # tis, cap 2
        }
    if "reward_weights" in ADV_ESTIMATORS.knobs(name):
        kw["reward_weights"] = WEIGHTS
    adv, _ = estimate(
        name,
        batch["token_level_rewards"],
        batch["response_mask"].float(),
        group_ids=list(batch["uid"]),
        reward_components=batch["reward_components"],
        **kw,
    )
    return adv


def hf_sum_pi_squared(model_path: str, batch: Batch, temperature: float) -> torch.Tensor:
    """Σ_v π(v)² at every response token, from transformers' own forward, one sample at a
    time without padding."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = torch.zeros(batch["responses"].shape)
    for i in range(len(batch)):
        prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()]
        valid = batch["response_mask"][i].bool()
        response = batch["responses"][i][valid]
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
        probs = torch.softmax(logits / temperature, -1)
        out[i, valid] = (probs**2).sum(-1).float()
    return out


NAMES = [
    "optimal_token_baseline",  # first: its old log-probs come from the initial weights
    "tir_optimal_token_baseline",
    "gdpo",
    "grpo_passk",
    "grpo_vectorized",
    "rloo_vectorized",
]


@pytest.mark.parametrize("name", NAMES)
def test_one_step(run, tiny_task, name):
    t, step = run
    m, batch, before, after = step(name)
    adv = batch["advantages"]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(adv, recomputed(name, batch))
    assert adv[mask].abs().max() > 0 and torch.all(adv[~mask] == 0)
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["actor/grad_norm"] > 0
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # every sample's components, as the reward function returned them
    lengths = torch.tensor([len(r) for r in batch["response_text"]])
    want = torch.stack([(lengths % 7) / 6, (lengths % 2).float()], -1)
    torch.testing.assert_close(batch["reward_components"], want)
    assert m["reward/length_mean"] == pytest.approx(float(want[:, 0].mean()))
    if "sum_pi_squared" in ADV_ESTIMATORS.needs(name):
        spsq = batch["sum_pi_squared"]
        assert torch.all(spsq[mask] <= 1) and torch.all(
            spsq[mask] >= batch["old_log_probs"][mask].exp() ** 2 - 1e-6
        )
        if name == NAMES[0]:
            ref = hf_sum_pi_squared(tiny_task["model"], batch, t.cfg.rollout.temperature)
            torch.testing.assert_close(spsq[mask], ref[mask], atol=1e-7, rtol=1e-5)
    else:
        assert "sum_pi_squared" not in batch
