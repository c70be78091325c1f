"""The actor's update (workers/actor.py, objectives.py): every policy loss, aggregation mode and
KL estimator in it, on the tiny model.

One trainer takes one RL step; then the actor's update runs again on that step's batch, from
the same weights, once per name (the config's ``algorithm`` swapped on the worker). What the
updates must show are identities of the gradient, checked through ``actor/grad_norm`` (taken
before clipping, so it depends on the weights and the batch only):

- on-policy (ratio 1) SAPO, DPPO-TV/KL, DRO and ``vanilla`` have PPO's gradient, GMPO has
  PPO's with ``seq-mean-token-mean`` (its advantages are per sequence);
- ``token-sum`` is ``token-mean`` times the number of tokens; ``loss_scale_factor`` divides;
- ``bypass_mode`` takes the rollout log-probs as the old policy: with them shifted down by 0.1
  the ratio is e^0.1 on every token, and so is the gradient's scale;
- verl's KL names equal treadle's; ``k1+``/``k3+`` report k1/k3 and have k2's gradient;
  ``full`` reports the exact KL, recomputed here from the two models' whole distributions.

A second trainer runs the driver end to end with bypass_mode, token-sum and the full KL.
"""

from __future__ import annotations

import math

import pytest
import tiny_runs
import torch

from treadle.algorithms import ADV_ESTIMATORS
from treadle.check import check_algorithm
from treadle.config import load_config
from treadle.models.loading import load_causal_lm
from treadle.protocol import Batch
from treadle.runtime.errors import ConfigError
from treadle.trainers.rl import RLTrainer, old_log_prob_pass
from treadle.workers.common import prompt_response

N = 4


def config(task, out, reward, *overrides: str):
    return load_config(
        None,
        tiny_runs.overrides(
            task,
            out,
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=12",
            "rollout.engine=hf",
            "actor.lr=1e-3",
            "algorithm.kl_coef=0.01",
            f"reward.function={reward}",
            "trainer.backend=local",
            *overrides,
            prompts=4,
            samples=N,
        ),
    )


class Rig:
    """A trainer after one step, its batch, and an update from the saved weights per name."""

    def __init__(self, task, out, reward) -> None:
        self.trainer = RLTrainer(config(task, out, reward))
        seen: list[Batch] = []
        self.update = self.trainer.group.update_actor

        def spy(batch: Batch) -> dict[str, float]:
            seen.append(batch)
            return self.update(batch)

        self.trainer.group.update_actor = spy  # type: ignore[method-assign]
        self.trainer.step(1)
        [self.batch] = seen
        self.worker = self.trainer.group.workers[0]  # local backend: the worker itself
        self.cfg = self.worker.cfg
        self.saved = [p.detach().clone() for p in self.worker.actor.params]

    def restore(self) -> None:
        """The actor's weights back to those after the first step."""
        with torch.no_grad():
            for p, s in zip(self.worker.actor.params, self.saved, strict=True):
                p.copy_(s)

    def run(self, batch: Batch | None = None, **algorithm) -> dict[str, float]:
        """The actor's update with ``algorithm`` keys changed (no KL unless given), from the
        saved weights; asserts that the weights moved."""
        self.restore()
        alg = self.cfg.algorithm.model_copy(update={"kl_coef": 0.0, **algorithm})
        self.worker.cfg = self.cfg.model_copy(update={"algorithm": alg})
        try:
            metrics = self.update(self.batch if batch is None else batch)
        finally:
            self.worker.cfg = self.cfg
        moved = any(
            not torch.equal(p, s) for p, s in zip(self.worker.actor.params, self.saved, strict=True)
        )
        assert moved and math.isfinite(metrics["actor/pg_loss"]), algorithm
        return metrics


@pytest.fixture(scope="module")
def rig(tiny_task, length_reward, tmp_path_factory):
    r = Rig(tiny_task, tmp_path_factory.mktemp("losses_e2e"), length_reward)
    yield r
    r.trainer.close()


def norm(m: dict[str, float]) -> float:
    return m["actor/grad_norm"]


def test_on_policy_losses_have_ppos_gradient(rig):
    ppo = norm(rig.run(policy_loss="ppo"))
    assert ppo > 0
    for name, extra in [
        ("vanilla", {}),
        ("sapo", {}),
        ("dppo_tv", {}),
        ("dppo_kl", {}),
        ("dro", {"dro_beta": 0.1}),
    ]:
        m = rig.run(policy_loss=name, **extra)
        assert norm(m) == pytest.approx(ppo, rel=1e-5), name
        assert m["actor/clip_frac"] == 0.0, name
    # responses of different lengths (every other one ends after 5 tokens), where a sequence
    # mean weighs tokens unlike the token mean
    varied = rig.batch.select(list(range(len(rig.batch))))  # a copy
    mask = varied["response_mask"].clone()
    mask[::2, 5:] = 0
    varied["response_mask"] = mask
    token_ppo = norm(rig.run(varied, policy_loss="ppo"))
    seq_ppo = norm(rig.run(varied, policy_loss="ppo", loss_agg_mode="seq-mean-token-mean"))
    gmpo = rig.run(varied, policy_loss="geo_mean", loss_agg_mode="seq-mean-token-mean")
    assert norm(gmpo) == pytest.approx(seq_ppo, rel=1e-5)
    assert seq_ppo != pytest.approx(token_ppo, rel=1e-3)


def test_token_sum_and_loss_scale_factor(rig):
    tokens = float(rig.batch["response_mask"].sum())
    mean = norm(rig.run(loss_agg_mode="token-mean"))
    assert norm(rig.run(loss_agg_mode="token-sum")) == pytest.approx(mean * tokens, rel=1e-5)
    seq_sum = norm(rig.run(loss_agg_mode="seq-mean-token-sum"))
    normed = rig.run(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=8.0)
    assert norm(normed) == pytest.approx(seq_sum / 8, rel=1e-5)


def test_bypass_mode_takes_the_rollout_log_probs_as_the_old_policy(rig):
    ppo = norm(rig.run(policy_loss="ppo"))
    # the rollout's log-probs become this policy's own, shifted down: ratio e^0.1 everywhere
    rig.restore()
    own = rig.trainer.group.compute_log_probs(rig.batch)["old_log_probs"]
    shifted = rig.batch.select(list(range(len(rig.batch))))  # a copy
    shifted["rollout_log_probs"] = own - 0.1
    scale = math.exp(0.1)  # inside the clip range (1.2) and below the dual clip (3)
    clip = rig.run(shifted, policy_loss="bypass_mode")
    assert norm(clip) == pytest.approx(ppo * scale, rel=1e-4)
    pg = rig.run(shifted, policy_loss="bypass_mode", bypass_loss_type="reinforce")
    assert norm(pg) == pytest.approx(ppo * scale, rel=1e-4)  # token weights e^0.1 < cap 2
    # on the unshifted batch its old policy is the step's rollout (the weights before it)
    assert norm(rig.run(policy_loss="bypass_mode")) != pytest.approx(ppo, rel=1e-3)


def exact_kl(rig) -> float:
    """Token-mean of Σ_v π(v) log(π(v)/π_ref(v)), from plain HF models of the two policies."""
    ref = load_causal_lm(rig.cfg.model.path)
    actor = load_causal_lm(rig.cfg.model.path)
    rig.restore()
    missing, _ = actor.load_state_dict(dict(rig.worker.actor.full_state()), strict=False)
    assert set(missing) <= {"lm_head.weight"}  # tied to the embedding
    ids, mask = prompt_response(rig.batch, torch.device("cpu"))
    r = rig.batch["responses"].shape[1]
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    t = rig.cfg.rollout.temperature
    with torch.no_grad():
        logp, logq = (
            torch.log_softmax(
                m(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[
                    :, -r - 1 : -1
                ]
                / t,
                -1,
            ).double()
            for m in (actor, ref)
        )
    kl = (logp.exp() * (logp - logq)).sum(-1)
    rmask = rig.batch["response_mask"].bool()
    return float(kl[rmask].mean())


def test_kl_estimators_in_the_update(rig):
    runs = {
        name: rig.run(kl_coef=0.5, kl_estimator=name)
        for name in ("k1", "kl", "k2", "k3", "low_var_kl", "k1+", "k3+", "full")
    }
    kl = {name: m["actor/kl"] for name, m in runs.items()}
    grad = {name: norm(m) for name, m in runs.items()}
    assert kl["kl"] == kl["k1"] and grad["kl"] == grad["k1"]
    assert kl["low_var_kl"] == kl["k3"] and grad["low_var_kl"] == grad["k3"]
    assert kl["k1+"] == pytest.approx(kl["k1"], rel=1e-6)
    assert kl["k3+"] == pytest.approx(kl["k3"], rel=1e-6)
    assert grad["k1+"] == pytest.approx(grad["k2"], rel=1e-5)
    assert grad["k3+"] == pytest.approx(grad["k2"], rel=1e-5)
    assert grad["k3"] != pytest.approx(grad["k2"], rel=1e-5)  # the straight-through matters
    want = exact_kl(rig)
    assert want > 1e-4  # the step moved the actor away from the reference
    assert kl["full"] == pytest.approx(want, rel=1e-4)


# LoRA: the reference is the actor with its adapters disabled, in the same module
@pytest.mark.parametrize(
    "model", [["actor.lr=1e-4"], ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lr=1e-2"]]
)
def test_the_driver_runs_bypass_mode_token_sum_and_the_full_kl(
    tiny_task, length_reward, tmp_path, model
):
    cfg = config(
        tiny_task,
        tmp_path,
        length_reward,
        "algorithm.policy_loss=bypass_mode",
        "algorithm.loss_agg_mode=token-sum",
        "algorithm.kl_estimator=full",
        "actor.ppo_mini_batch_size=8",  # two optimizer steps a batch
        *model,
    )
    t = RLTrainer(cfg)
    try:
        first, second = t.step(1), t.step(2)
    finally:
        t.close()
    # bypass_mode's old policy is the rollout's and the full KL computes the reference's
    # distribution in the update: neither pass runs before it, even with two mini-batches
    assert "timing/old_log_probs" not in first and "timing/ref_log_probs" not in first
    # the first mini-batch's KL is 0 (the actor is the reference), the second's is not
    assert 0 < first["actor/kl"] < second["actor/kl"] and math.isfinite(second["actor/pg_loss"])
    assert first["actor/grad_norm"] > 0 and second["actor/grad_norm"] > 0


def test_which_passes_run_before_the_update(tiny_task, length_reward, tmp_path):
    def passes(*overrides: str) -> bool:
        cfg = config(tiny_task, tmp_path, length_reward, "actor.ppo_epochs=2", *overrides)
        return old_log_prob_pass(cfg, ADV_ESTIMATORS.needs(cfg.algorithm.adv_estimator))

    bypass = "algorithm.policy_loss=bypass_mode"
    assert passes() and not passes(bypass)
    assert passes(bypass, "algorithm.kl_reward_coef=0.1")  # the reward's KL reads them
    assert passes(bypass, "actor.recompute_old_log_probs=true")
    assert passes(bypass, "algorithm.adv_estimator=optimal_token_baseline")  # reads Σπ²


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.kl_reward_estimator=full"],
            r"algorithm.kl_reward_estimator=full needs the reference's whole distribution",
        ),
        (["algorithm.policy_loss=dro"], r"algorithm.policy_loss=dro needs algorithm.dro_beta"),
        (
            ["algorithm.policy_loss=bypass_mode", "algorithm.rollout_correction=tis"],
            r"set algorithm.rollout_correction=none \(got tis\)",
        ),
        (
            ["algorithm.policy_loss=geo_mean"],
            r"loss_agg_mode=token-mean cannot be used with algorithm.policy_loss=geo_mean",
        ),
    ],
)
def test_check_refuses_what_cannot_work(tiny_task, overrides, message):
    cfg = load_config(None, [f"model.path={tiny_task['model']}", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_algorithm(cfg, "train")
