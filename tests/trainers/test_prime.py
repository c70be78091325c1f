"""PRIME end to end on the tiny model (local backend, hf engine): one step whose PRM update,
implicit rewards and advantages are checked against the pure functions and a plain
transformers forward; checkpoint + resume of the PRM; the start-up checks."""

from __future__ import annotations

import math

import pytest
import tiny_runs
import torch
from algorithm_calls import estimate
from safetensors.torch import load_file
from torch.testing import assert_close

from treadle.algorithms.prime import implicit_process_rewards, prime_ce_loss
from treadle.config import load_config
from treadle.models.loading import load_causal_lm
from treadle.protocol import Batch
from treadle.runtime.errors import ConfigError, RewardError
from treadle.tracking.tracker import read_metrics
from treadle.trainers.prime import outcome_labels
from treadle.trainers.rl import RLTrainer, train

PRIME_METRICS = {
    "prime/loss",
    "prime/grad_norm",
    "prime/lr",
    "prime/label_mean",
    "prime/reward_mean",
    "prime/raw_reward_mean",
    "prime/acc",
    "prime/acc_abs",
    "prime/acc_before",
    "prime/acc_abs_before",
    "timing/update_prm",
}


@pytest.fixture(scope="module")
def parity_reward(tmp_path_factory):
    """A 0/1 outcome that varies for an untrained model: the parity of the response's length."""
    path = tmp_path_factory.mktemp("reward") / "parity.py"
    path.write_text("def score(prompt, response, ground_truth):\n    return len(response) % 2\n")
    return f"{path}:score"


def prime_config(task, out, reward, *overrides: str):
    return load_config(
        None,
        tiny_runs.overrides(
            task,
            out,
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=12",
            "rollout.engine=hf",
            "actor.lr=1e-3",
            "algorithm.adv_estimator=prime",
            "prime.lr=1e-3",
            "prime.beta=0.5",
            "prime.micro_batch_size=6",  # 16 rows: micro-batches of 6, 6, 4
            f"reward.function={reward}",
            "trainer.backend=local",
            *overrides,
            prompts=4,
            samples=4,
        ),
    )


def hf_log_ratio(prm_state: dict, ref_path, batch: Batch) -> torch.Tensor:
    """log π_prm - log π_ref of the response tokens, from plain transformers forwards of each
    unpadded sequence."""
    ref = load_causal_lm(ref_path).eval()
    prm = load_causal_lm(ref_path)
    prm.load_state_dict(prm_state, strict=False)  # tied embeddings: lm_head follows
    prm.eval()
    out = torch.zeros(batch["responses"].shape)
    for i in range(len(batch)):
        prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()]
        valid = batch["response_mask"][i].bool()
        response = batch["responses"][i][valid]
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            lp = [
                m(input_ids=ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1) for m in (prm, ref)
            ]
        picked = [x.gather(-1, response[:, None])[:, 0] for x in lp]
        out[i, : len(response)] = picked[0] - picked[1]
    return out


def test_one_prime_step_trains_the_prm_and_its_rewards_reach_the_advantages(
    tiny_task, parity_reward, tmp_path
):
    cfg = prime_config(
        tiny_task,
        tmp_path,
        parity_reward,
        "prime.reward_gt_coef=2.0",
        "prime.reward_dpo_coef=3.0",
    )
    t = RLTrainer(cfg)
    seen: dict = {}
    rewards = t.prm.rewards

    def spy(batch, m):
        seen["batch"], seen["extra"] = batch, rewards(batch, m)
        return seen["extra"]

    t.prm.rewards = spy
    worker = t.prm.group.workers[0]
    initial = {k: v.clone() for k, v in worker.engine.full_state()}
    try:
        m = t.step(1)
        after = {k: v.clone() for k, v in worker.engine.full_state()}
        batch = seen["batch"]
        q = t.prm.group.compute_log_ratio(batch)["prm_log_ratio"]
    finally:
        t.close()
    assert m.keys() >= PRIME_METRICS, PRIME_METRICS - m.keys()
    # every PRM tensor moved (one optimizer step on the batch's outcomes)
    assert initial.keys() == after.keys()
    assert not [k for k in initial if torch.equal(initial[k], after[k])]
    mask = batch["response_mask"]
    labels = torch.tensor([len(r) % 2 for r in batch["response_text"]], dtype=torch.float32)
    assert 0 < float(labels.mean()) < 1, "the parity reward gave one label only"
    assert m["prime/label_mean"] == pytest.approx(float(labels.mean()))
    # before the update the PRM is its reference: q = 0, so the CE loss is ln 2 for every
    # sample and no implicit reward has a sign
    assert m["prime/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert m["prime/acc_abs_before"] == 0.0
    assert m["prime/grad_norm"] > 0 and m["prime/lr"] == pytest.approx(1e-3)
    # the worker's log-ratio (after the update) is a plain forward's, and the update lowered
    # the CE loss on the batch it learned from
    state = dict(after)
    assert_close(q, hf_log_ratio(state, tiny_task["model"], batch), rtol=1e-4, atol=1e-5)
    assert q.abs().max() > 0
    assert float(prime_ce_loss(q, mask, labels, 0.5).mean()) < math.log(2)
    # update=before: the rewards the estimator got are the updated PRM's, normalised ...
    given = seen["extra"]
    assert_close(given, implicit_process_rewards(q, mask, 0.5, "batch_norm"), rtol=0, atol=1e-7)
    assert m["prime/reward_mean"] == pytest.approx(float(given.sum(-1).mean()), abs=1e-6)
    # ... and the actor was trained on prime's advantages of them with the config's coefficients
    outcome = torch.zeros(mask.shape)
    rows = torch.arange(len(mask))
    outcome[rows, mask.sum(-1) - 1] = labels  # right-padded: the last valid token
    adv, returns = estimate(
        "prime",
        outcome,
        mask,
        group_ids=list(batch["uid"]),
        implicit_rewards=given,
        reward_gt_coef=2.0,
        reward_dpo_coef=3.0,
    )
    assert_close(batch["advantages"], adv, rtol=1e-6, atol=1e-6)
    assert_close(batch["returns"], returns, rtol=1e-6, atol=1e-6)
    assert m["actor/grad_norm"] > 0


def prm_weights(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "prm" / "model" / "model.safetensors"))


@pytest.mark.slow
def test_prime_resume_restores_the_prm_bit_for_bit(tiny_task, parity_reward, tmp_path):
    """loss=dpo, update=after (the other paths), two PRM steps a batch; 2 steps straight
    against 1 step, stop, resume."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    opts = ("prime.loss=dpo", "prime.update=after", "prime.mini_batch_size=8")
    opts += ("trainer.total_steps=2", "trainer.save_every=1")
    train(prime_config(tiny_task, straight, parity_reward, *opts))
    train(prime_config(tiny_task, resumed, parity_reward, *opts, "trainer.total_steps=1"))
    train(prime_config(tiny_task, resumed, parity_reward, *opts))
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    assert a[0].keys() >= PRIME_METRICS | {"timing/prm_log_ratio"}
    # update=after: step 1's rewards are the update's first forward, where PRM = reference
    assert a[0]["prime/reward_mean"] != 0.0  # the second mini-batch saw a moved PRM
    for key in [*sorted(PRIME_METRICS - {"timing/update_prm"}), "actor/pg_loss"]:
        assert b[1][key] == a[1][key], key
    ckpt = straight / "checkpoints" / "step_1" / "prm"
    assert (ckpt / "optimizer.safetensors").is_file() and (ckpt / "rng_rank0.safetensors").is_file()
    wa = prm_weights(straight / "checkpoints/step_2")
    wb = prm_weights(resumed / "checkpoints/step_2")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    w1 = prm_weights(straight / "checkpoints/step_1")
    assert all(not torch.equal(wa[k], w1[k]) for k in wa)


# --------------------------------------------------------------------------- start-up checks


def test_prime_start_up_checks(tiny_task, parity_reward, tmp_path):
    out = tmp_path / "run"

    def cfg(*overrides):
        return prime_config(tiny_task, out, parity_reward, *overrides)

    with pytest.raises(
        ConfigError, match=r"sets the 'prime' section, .* algorithm\.adv_estimator=grpo"
    ):
        train(cfg("algorithm.adv_estimator=grpo"))
    with pytest.raises(ConfigError, match=r"drop reward\.model_path"):
        train(cfg(f"reward.model_path={tiny_task['model']}"))
    with pytest.raises(ConfigError, match=r"set reward\.overlong_buffer_len=0"):
        train(cfg("reward.overlong_buffer_len=4"))
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"prime\.mini_batch_size=5 must divide"):
        cfg("prime.mini_batch_size=5")
    with pytest.raises(ConfigError, match=r"set prime\.placement=colocated"):
        cfg("prime.placement=split")
    with pytest.raises(ConfigError, match=r"prime\.world_size=2 must equal actor\.world_size=1"):
        cfg("trainer.backend=ray", "prime.world_size=2")
    cfg("trainer.backend=ray", "prime.placement=split", "prime.world_size=2")


def test_outcome_labels_must_be_in_zero_one():
    scores = torch.tensor([[0.0, 1.0], [0.5, 0.0], [0.0, 0.0]])
    batch = Batch.from_dict(
        tensors={"token_level_scores": scores}, objects={"prompt_text": ["a", "b", "c"]}
    )
    assert torch.equal(outcome_labels(batch, "f"), torch.tensor([1.0, 0.5, 0.0]))
    batch["token_level_scores"] = torch.tensor([[0.0, 1.0], [0.0, 2.0], [-1.0, 0.0]])
    with pytest.raises(RewardError, match=r"reward function 'f' scored sample 1 \(prompt 'b'\)"):
        outcome_labels(batch, "f")


def test_prm_layout_shares_the_actors_bundles_or_splits_the_cpus(tiny_task, parity_reward):
    from treadle.trainers.roles import plan_roles

    ray = ("trainer.backend=ray", "trainer.num_cpus=6")
    colocated = plan_roles(prime_config(tiny_task, "out", parity_reward, *ray))
    assert (colocated.names, colocated.roles[0].split, colocated.colocated) == (("prm",), False, 2)
    split_cfg = prime_config(
        tiny_task,
        "out",
        parity_reward,
        *ray,
        "actor.world_size=2",
        "prime.placement=split",
        "prime.world_size=1",
    )
    split = plan_roles(split_cfg)
    assert (split.names, split.roles[0].split, split.colocated) == (("prm",), True, 1)
    assert split.placement(split_cfg).cpus_per_rank == 2.0  # 6 CPUs over 2 actor + 1 PRM ranks


def test_treadle_check_names_a_missing_prm_folder(tiny_task, parity_reward, tmp_path):
    from treadle.check.run import check

    missing = tmp_path / "no_such_model"
    for key in ("prime.model_path", "prime.ref_path"):
        cfg = prime_config(tiny_task, tmp_path / "run", parity_reward, f"{key}={missing}")
        with pytest.raises(ConfigError, match=rf"{key}\b.*no_such_model"):
            check(cfg, "train")
