"""PPO with a critic end to end on a tiny model: local mode (warm-up, deterministic resume)
and Ray (2 actor ranks, a colocated critic and reward model)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_rl_e2e import grpo_config, weights

from treadle.models.loading import load_tokenizer, load_value_model, save_hf_folder
from treadle.tracking.tracker import read_metrics
from treadle.trainers.rl import train

CRITIC = {
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/grad_norm",
    "critic/values_mean",
    "critic/returns_mean",
    "critic/vf_explained_var",
    "timing/values",
    "timing/update_critic",
}


def ppo_config(task, out, *overrides: str):
    return grpo_config(
        task,
        out,
        "algorithm.adv_estimator=gae",
        "algorithm.lam=0.95",
        "critic.lr=1e-3",
        *overrides,
    )


def critic_weights(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "critic" / "model" / "model.safetensors"))


def assert_all_changed(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    same = [k for k in before if torch.equal(before[k], after[k])]
    assert not same, f"unchanged: {same}"


@pytest.fixture(scope="module")
def length_reward(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "length_reward.py"
    path.write_text("def score(prompt, response, ground_truth):\n    return len(response) / 16\n")
    return f"{path}:score"


@pytest.fixture(scope="module")
def initial_critic(tiny_task, tmp_path_factory):
    """The critic's starting weights: the tiny causal LM's decoder and a zero score head."""
    model = load_value_model(tiny_task["model"])
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_ppo_local_warmup_and_resume_restore_the_critic(
    tiny_task, length_reward, initial_critic, tmp_path
):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    local = ("trainer.backend=local", "critic.warmup_steps=1", f"reward.function={length_reward}")
    train(ppo_config(tiny_task, straight, *local))
    train(ppo_config(tiny_task, resumed, *local, "trainer.total_steps=1"))
    train(ppo_config(tiny_task, resumed, *local))
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    for m in a:
        assert m.keys() >= CRITIC, CRITIC - m.keys()
        assert m["critic/grad_norm"] > 0
    # Warm-up: at step 1 only the critic trained; the actor's weights are the initial ones.
    assert "actor/pg_loss" not in a[0] and "timing/update_actor" not in a[0]
    assert a[1]["actor/grad_norm"] > 0
    start = weights(tiny_task["model"])
    step1 = weights(straight / "checkpoints/step_1/model")
    assert all(torch.equal(start[k], step1[k]) for k in start)
    assert_all_changed(start, weights(straight / "final_model"))
    # The critic's weights all moved, the zero head included, and were checkpointed.
    assert_all_changed(initial_critic, critic_weights(straight / "checkpoints/step_1"))
    # Resume restored the critic (weights, optimizer): step 2 is the uninterrupted run's.
    for key in ("critic/values_mean", "critic/vf_loss", "critic/grad_norm", "actor/pg_loss"):
        assert b[1][key] == pytest.approx(a[1][key], rel=1e-5, abs=1e-7), key
    wa = critic_weights(straight / "checkpoints/step_2")
    wb = critic_weights(resumed / "checkpoints/step_2")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def constant_reward_model(tiny_task, tmp_path_factory):
    """A reward model that scores every response 0.25 (zero weights, bias 0.25)."""
    model = load_value_model(tiny_task["model"])
    with torch.no_grad():
        model.score.bias.fill_(0.25)
    out = tmp_path_factory.mktemp("rm") / "constant"
    save_hf_folder(model.state_dict(), model.config, load_tokenizer(tiny_task["model"]), out)
    return out


@pytest.mark.slow
def test_ppo_ray_two_ranks_colocated_critic_and_reward_model(
    tiny_task, ray_session, initial_critic, constant_reward_model, tmp_path
):
    out = tmp_path / "run"
    ray2 = (
        "actor.world_size=2",
        f"reward.model_path={constant_reward_model}",
        "algorithm.lam=1.0",  # returns are then the rewards to go: 0.25 everywhere
    )
    train(ppo_config(tiny_task, out, *ray2))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m.keys() >= CRITIC, CRITIC - m.keys()
        assert m["reward/mean"] == pytest.approx(0.25, abs=1e-5)  # the RM's, not the rule's
        assert 0.0 <= m["reward/rule_mean"] <= 1.0
        assert m["critic/returns_mean"] == pytest.approx(0.25, abs=1e-5)
    assert metrics[1]["critic/values_mean"] != metrics[0]["critic/values_mean"]
    assert_all_changed(initial_critic, critic_weights(out / "checkpoints/step_2"))
    assert_all_changed(weights(tiny_task["model"]), weights(out / "final_model"))


@pytest.mark.slow
def test_ppo_ray_critic_in_its_own_pool(tiny_task, ray_session, length_reward, tmp_path):
    """critic.placement=split: the critic's ranks get a placement group of their own."""
    out = tmp_path / "split"
    cfg = ppo_config(
        tiny_task,
        out,
        "critic.placement=split",
        f"reward.function={length_reward}",
        "trainer.total_steps=1",
        "trainer.save_every=0",
        "data.val_files=[]",
    )
    train(cfg)
    (m,) = read_metrics(out)
    assert m.keys() >= CRITIC and m["critic/grad_norm"] > 0
