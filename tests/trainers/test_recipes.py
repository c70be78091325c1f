"""Every RL recipe in examples/arithmetic, and PRIME's in examples/prime, runs two RL steps end
to end (local backend)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from treadle.config import load_config
from treadle.tracking.tracker import read_metrics
from treadle.trainers.rl import train

RECIPES = [f"arithmetic/{r}" for r in ("grpo", "rloo", "reinforce_pp", "dr_grpo", "gspo")]
RECIPES += ["arithmetic/dapo", "arithmetic/ppo", "prime/prime"]
# What a recipe needs changed to fit the test's 12-token responses. DAPO's mask of truncated
# responses is off: the tiny model ends a response with p ~ 0.004 a token, so nearly all of
# them are cut and masked, and a step whose every response is has nothing to learn
# (trainers/test_rl.py tests the mask).
EXTRA = {"arithmetic/dapo": ["reward.overlong_buffer_len=4", "algorithm.mask_truncated=false"]}


@pytest.fixture(scope="module")
def varied_reward(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "varied.py"
    path.write_text("def score(prompt, response, ground_truth):\n    return len(response) % 2\n")
    return f"{path}:score"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_two_steps(recipe, tiny_task, varied_reward, tmp_path):
    out = tmp_path / "run"
    cfg = load_config(
        f"examples/{recipe}.yaml",
        [
            f"model.path={tiny_task['model']}",
            f"data.train_files=[{tiny_task['train']}]",
            f"data.val_files=[{tiny_task['test']}]",
            "data.batch_size=4",
            "data.val_size=4",
            "rollout.n=4",
            "rollout.max_new_tokens=12",
            "rollout.engine=hf",
            "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size=8",
            "actor.lr=1e-3",
            "critic.warmup_steps=0",  # ppo: the actor trains in both steps too
            f"reward.function={varied_reward}",
            "trainer.backend=local",
            "trainer.total_steps=2",
            "trainer.progress=false",
            f"trainer.output_dir={out}",
            *EXTRA.get(recipe, []),
        ],
    )
    train(cfg)
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    low = -1.0 if cfg.reward.overlong_buffer_len else 0.0  # over-long shaping can go below 0
    for m in metrics:
        assert low < m["reward/mean"] < 1.0
        assert ("rollout/gen_rounds" in m) == cfg.algorithm.filter_groups
        assert m["actor/grad_norm"] > 0
    assert ("actor/kl" in metrics[0]) == (cfg.algorithm.kl_coef > 0)
    assert ("critic/vf_loss" in metrics[0]) == (cfg.algorithm.adv_estimator == "gae")
    assert ("prime/loss" in metrics[0]) == (cfg.algorithm.adv_estimator == "prime")
    before = load_file(str(tiny_task["model"] / "model.safetensors"))
    after = load_file(str(out / "final_model" / "model.safetensors"))
    assert all(not torch.equal(before[k], after[k]) for k in before)
