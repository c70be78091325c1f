"""The critic and reward-model roles: worker methods on a tiny model, GAE, the value loss,
and the start-up checks that reject combinations which cannot work."""

from __future__ import annotations

import pytest
import torch
from algorithm_calls import estimate
from torch.testing import assert_close

from treadle.algorithms import ADV_ESTIMATORS, value_loss
from treadle.config import load_config
from treadle.controller import WorkerGroup, free_port
from treadle.models.loading import load_tokenizer, load_value_model, save_hf_folder
from treadle.protocol import Batch
from treadle.runtime.errors import ConfigError
from treadle.workers import CriticWorker, RewardModelWorker

PROMPT, RESPONSE = 5, 6


def ppo_config(task, *overrides: str):
    return load_config(
        None,
        [
            f"model.path={task['model']}",
            f"data.train_files=[{task['train']}]",
            "algorithm.adv_estimator=gae",
            "data.batch_size=2",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size=3",  # 8 rows: micro-batches of 3, 3, 2
            "trainer.backend=local",
            *overrides,
        ],
    )


def rl_batch(n: int = 8, vocab: int = 100) -> Batch:
    """Left-padded prompts, right-padded responses of uneven length (one of them empty)."""
    g = torch.Generator().manual_seed(3)
    pmask = torch.ones(n, PROMPT, dtype=torch.long)
    pmask[0, :2] = 0
    pmask[5, :1] = 0
    lengths = [6, 3, 1, 5, 0, 6, 2, 4][:n]
    rmask = torch.tensor([[1] * k + [0] * (RESPONSE - k) for k in lengths])
    return Batch.from_dict(
        tensors={
            "prompts": torch.randint(3, vocab, (n, PROMPT), generator=g) * pmask,
            "prompt_mask": pmask,
            "responses": torch.randint(3, vocab, (n, RESPONSE), generator=g) * rmask,
            "response_mask": rmask,
            "returns": torch.randn(n, RESPONSE, generator=g) * rmask,
        },
        meta={"step": 1},
    )


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()].double()


# --------------------------------------------------------------------------- critic worker


def test_critic_update_fits_the_returns_and_reports_exact_metrics(tiny_task):
    cfg = ppo_config(tiny_task, "critic.lr=3e-3", "critic.cliprange_value=0.2")
    kwargs = {"config": cfg, "critic_path": str(tiny_task["model"])}
    group = WorkerGroup(CriticWorker, world_size=1, backend="local", kwargs=kwargs)
    batch = rl_batch()
    mask, returns = batch["response_mask"], batch["returns"]
    try:
        values = group.compute_values(batch)["values"]
        first = group.update_critic(batch.union(Batch.from_dict(tensors={"values": values})))
        for step in range(2, 16):  # PPO refreshes the old values every step
            batch.meta["step"] = step
            values_now = group.compute_values(batch)["values"]
            group.update_critic(batch.union(Batch.from_dict(tensors={"values": values_now})))
        after = group.compute_values(batch)["values"]
    finally:
        group.shutdown()
    # A causal-LM folder gives a new head at zero: the fresh critic predicts 0 everywhere.
    assert torch.equal(values, torch.zeros(8, RESPONSE))
    # One mini-batch of three micro-batches: the loss is 1/2 token-mean over all 27 tokens
    # (values == old values before the step, so nothing is clipped yet).
    r = masked(returns, mask)
    assert first["critic/vf_loss"] == pytest.approx(0.5 * float((r**2).mean()), rel=1e-5)
    assert first["critic/vf_clipfrac"] == 0.0
    assert first["critic/grad_norm"] > 0
    assert first["critic/values_mean"] == 0.0
    assert first["critic/returns_mean"] == pytest.approx(float(r.mean()), rel=1e-6)
    assert first["critic/vf_explained_var"] == pytest.approx(0.0, abs=1e-9)  # V = 0
    # The updates move the values toward the returns: the squared error falls.
    mse_before = float((r**2).mean())
    mse_after = float(((masked(after, mask) - r) ** 2).mean())
    assert mse_after < 0.5 * mse_before, (mse_before, mse_after)
    assert torch.equal(after[~mask.bool()], torch.zeros_like(after[~mask.bool()]))


def test_critic_update_metrics_of_given_values(tiny_task):
    """values_mean and explained variance against a plain computation (V != 0)."""
    cfg = ppo_config(tiny_task, "critic.lr=1e-12")
    kwargs = {"config": cfg, "critic_path": str(tiny_task["model"])}
    group = WorkerGroup(CriticWorker, world_size=1, backend="local", kwargs=kwargs)
    batch = rl_batch()
    g = torch.Generator().manual_seed(5)
    batch["values"] = torch.randn(8, RESPONSE, generator=g) * batch["response_mask"]
    try:
        m = group.update_critic(batch)
    finally:
        group.shutdown()
    v, r = (
        masked(batch["values"], batch["response_mask"]),
        masked(batch["returns"], batch["response_mask"]),
    )
    assert m["critic/values_mean"] == pytest.approx(float(v.mean()), rel=1e-6)
    explained = 1 - float((r - v).var(unbiased=False) / r.var(unbiased=False))
    assert m["critic/vf_explained_var"] == pytest.approx(explained, rel=1e-6)


# --------------------------------------------------------------------------- reward model


@pytest.fixture(scope="module")
def reward_model(tiny_task, tmp_path_factory):
    """A value-model folder with a random score head, as `treadle rm` would save one."""
    model = load_value_model(tiny_task["model"])
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g))
        model.score.bias.fill_(0.25)
    out = tmp_path_factory.mktemp("rm") / "rm"
    save_hf_folder(model.state_dict(), model.config, load_tokenizer(tiny_task["model"]), out)
    return out


def test_a_keyword_a_role_does_not_take_is_an_error(tiny_task):
    """The worker base passes a role's own keywords to its setup: a misspelt one fails."""
    import torch.distributed as dist

    cfg = ppo_config(tiny_task)
    made = not dist.is_initialized()  # not one an earlier test's in-process vLLM still uses
    try:
        with pytest.raises(TypeError, match="critic_pth"):
            RewardModelWorker(0, 1, "127.0.0.1", free_port(), config=cfg, critic_pth="x")
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()


def test_reward_model_scores_the_last_token_of_prompt_and_response(tiny_task, reward_model):
    cfg = ppo_config(tiny_task, f"reward.model_path={reward_model}", "reward.micro_batch_size=3")
    group = WorkerGroup(RewardModelWorker, world_size=1, backend="local", kwargs={"config": cfg})
    batch = rl_batch()
    try:
        scores = group.compute_rm_scores(batch)["rm_scores"]
    finally:
        group.shutdown()
    # Independently: the HF model's own forward on each unpadded sequence, its last position.
    hf = load_value_model(reward_model).eval()
    expected = []
    for i in range(len(batch)):
        prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()]
        response = batch["responses"][i][batch["response_mask"][i].bool()]
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            expected.append(hf(input_ids=ids).logits[0, -1, 0])
    assert_close(scores, torch.stack(expected), rtol=1e-4, atol=1e-5)
    assert scores.std() > 0.01  # the head is not constant: positions matter


# --------------------------------------------------------------------------- algorithms


def test_gae_by_hand_with_uneven_lengths():
    """γ = λ = 0.5. Row 0: 3 valid tokens; row 1: 1 valid token, then padding."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [2.0, 9.0, 9.0]])
    values = torch.tensor([[0.5, 0.2, 0.4], [1.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv, returns = estimate(
        "gae", rewards, mask, group_ids=[0, 1], values=values, gamma=0.5, lam=0.5
    )
    # row 0: δ2 = 1 - 0.4 = 0.6; δ1 = 0 + 0.5·0.4 - 0.2 = 0; δ0 = 0.5·0.2 - 0.5 = -0.4
    #        A2 = 0.6, A1 = 0 + 0.25·0.6 = 0.15, A0 = -0.4 + 0.25·0.15 = -0.3625
    # row 1: δ0 = 2 - 1 = 1 = A0 (the padding's values and rewards do not count)
    raw = torch.tensor([[-0.3625, 0.15, 0.6], [1.0, 0.0, 0.0]])
    assert_close(returns, torch.tensor([[0.1375, 0.35, 1.0], [2.0, 0.0, 0.0]]))
    valid = raw[mask.bool()]
    whitened = (raw - valid.mean()) / (valid.var() + 1e-8).sqrt() * mask
    assert_close(adv, whitened)


def test_value_loss_gradient_inside_and_outside_the_clip_range():
    """The clipped term only wins (and blocks the gradient) when it is the larger error."""
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.1, 1.0, -1.0, 1.0]], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([[0.5, 2.0, 0.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4)
    loss, clipfrac = value_loss(values, old.double(), returns, mask, cliprange_value=0.2)
    (grad,) = torch.autograd.grad(loss, values)
    # t0: inside the range, plain (V - R) / n; t1: V=1 clipped to 0.2, (0.2-2)² > (1-2)², so
    # the clipped (constant) term wins: no gradient; t2: clipped -0.2, (−0.2)² < 1: plain;
    # t3: clipped 0.2, (1.2)² < 2²: plain.
    n = 4
    assert_close(grad, torch.tensor([[-0.4 / n, 0.0, -1.0 / n, 2.0 / n]], dtype=torch.float64))
    assert clipfrac == pytest.approx(0.25)
    # Finite differences agree away from the kinks.
    eps = 1e-6
    for t in range(4):
        bump = torch.zeros(1, 4, dtype=torch.float64)
        bump[0, t] = eps
        up, _ = value_loss(values.detach() + bump, old.double(), returns, mask, 0.2)
        down, _ = value_loss(values.detach() - bump, old.double(), returns, mask, 0.2)
        assert float((up - down) / (2 * eps)) == pytest.approx(float(grad[0, t]), abs=1e-6)


# --------------------------------------------------------------------------- start-up checks


def test_estimators_declare_that_they_need_values():
    assert ADV_ESTIMATORS.needs("gae") == ("values",)
    assert ADV_ESTIMATORS.needs("grpo") == ()
    with pytest.raises(ValueError, match="unknown advantage estimator 'gea'"):
        ADV_ESTIMATORS.needs("gea")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("critic.enable=false",),
            r"adv_estimator=gae needs a critic's values, but critic\.enable=false: drop "
            r"critic\.enable .* or use an estimator without a critic: dr_grpo, gdpo, gpg, grpo,",
        ),
        (
            ("algorithm.adv_estimator=grpo", "critic.enable=true"),
            r"critic\.enable=true, but algorithm\.adv_estimator=grpo does not use values",
        ),
        (
            ("algorithm.adv_estimator=rloo", "critic.warmup_steps=2"),
            r"critic\.warmup_steps=2 holds the actor back .* set critic\.warmup_steps=0",
        ),
    ],
)
def test_critic_combinations_that_cannot_work_fail_at_start(
    tiny_task, tmp_path, overrides, message
):
    from treadle.trainers.rl import train

    out = tmp_path / "run"
    cfg = ppo_config(tiny_task, f"trainer.output_dir={out}", *overrides)
    with pytest.raises(ConfigError, match=message):
        train(cfg)
    assert not out.exists()  # failed before anything was written


def test_reward_model_must_be_a_value_model_with_the_actors_vocabulary(tiny_task, tmp_path):
    import json
    import shutil

    from treadle.trainers.rl import train

    out = tmp_path / "run"
    causal = ppo_config(
        tiny_task, f"trainer.output_dir={out}", f"reward.model_path={tiny_task['model']}"
    )
    with pytest.raises(
        ConfigError,
        match=r"reward\.model_path: .* is not a reward model \(architectures: "
        r"Qwen2ForCausalLM\); train one with `treadle rm`",
    ):
        train(causal)
    other = tmp_path / "other_vocab"
    shutil.copytree(tiny_task["model"], other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 1
    (other / "config.json").write_text(json.dumps(config))
    for key in ("reward.model_path", "critic.model_path"):
        cfg = ppo_config(tiny_task, f"trainer.output_dir={out}", f"{key}={other}")
        with pytest.raises(
            ConfigError, match=rf"{key}: .* has a vocabulary of \d+ tokens, the actor"
        ):
            train(cfg)
    assert not out.exists()


def test_critic_placement_rules_are_config_errors(tiny_task):
    with pytest.raises(
        ConfigError,
        match=r"critic\.world_size=2 must equal actor\.world_size=1 when "
        r"critic\.placement=colocated",
    ):
        ppo_config(tiny_task, "trainer.backend=ray", "critic.world_size=2")
    with pytest.raises(
        ConfigError, match=r"trainer\.backend=local .* set critic\.placement=colocated"
    ):
        ppo_config(tiny_task, "critic.placement=split")
    with pytest.raises(ConfigError, match=r"critic\.ppo_mini_batch_size=3 must divide"):
        ppo_config(tiny_task, "critic.ppo_mini_batch_size=3")
    ppo_config(tiny_task, "trainer.backend=ray", "critic.placement=split", "critic.world_size=2")


def test_role_layout_shares_the_actors_bundles_or_splits_the_cpus(tiny_task, reward_model):
    from treadle.trainers.roles import plan_roles

    ray = ("trainer.backend=ray", "trainer.num_cpus=6", "data.batch_size=4")
    colocated = plan_roles(ppo_config(tiny_task, *ray, f"reward.model_path={reward_model}"))
    assert (colocated.names, colocated.colocated) == (("critic", "reward_model"), 3)
    assert [p.split for p in colocated.roles] == [False, False]
    placement = colocated.placement(ppo_config(tiny_task, *ray))
    assert (placement.cpus_per_rank, placement.share) == (6.0, 1 / 3)  # all CPUs / actor ranks
    split_cfg = ppo_config(
        tiny_task, *ray, "actor.world_size=2", "critic.placement=split", "critic.world_size=1"
    )
    split = plan_roles(split_cfg)
    assert (split.names, split.roles[0].split, split.colocated) == (("critic",), True, 1)
    assert split.roles[0].world_size == 1
    assert split.placement(split_cfg).cpus_per_rank == 2.0  # 6 CPUs over 2 actor + 1 critic ranks
    grpo = plan_roles(ppo_config(tiny_task, "algorithm.adv_estimator=grpo"))
    assert (grpo.names, grpo.colocated) == ((), 1)


def test_a_colocated_critic_stays_on_the_actors_bundles_beside_a_split_rollout(tiny_task):
    """A split rollout cuts the training side's bundles smaller: a colocated critic must still
    join the actors' bundles, and only a split one get a pool."""
    from treadle.trainers import roles

    class Actors:  # records where start_roles adds each group
        def __init__(self) -> None:
            self.added: list[tuple[str, int, bool]] = []

        def add(self, cls, kwargs, world_size, split=False):  # type: ignore[no-untyped-def]
            self.added.append((cls.__name__, world_size, split))
            return cls.__name__

    ray = ("trainer.backend=ray", "trainer.num_cpus=6", "rollout.placement=split")
    for placement in ("colocated", "split"):
        cfg = ppo_config(tiny_task, *ray, f"critic.placement={placement}", "critic.world_size=1")
        layout = roles.plan_roles(cfg)
        split = placement == "split"
        # the split rollout's pool (3 of the 6 CPUs) is cut off; a split critic's rank shares
        # the rest with the actor's
        assert layout.placement(cfg).cpus_per_rank == (1.5 if split else 3.0)
        actors = Actors()
        assert roles.start_roles(cfg, actors, layout, None) == {"critic": "CriticWorker"}
        assert actors.added == [("CriticWorker", 1, split)], placement


def test_a_side_role_starts_from_its_model_or_resumes_from_its_checkpoint_folder(
    tiny_task, tmp_path
):
    from treadle.trainers.roles import SIDE_ROLES

    critic, reward_model, prm = SIDE_ROLES
    assert (critic.saved, reward_model.saved, prm.saved) == (True, False, True)
    cfg = ppo_config(tiny_task, f"critic.model_path={tiny_task['model']}")
    assert critic.start_path(cfg, None) == str(tiny_task["model"])
    assert prm.start_path(cfg, None) == cfg.model.path  # prime.model_path: model.path
    checkpoint = tmp_path / "step_3"
    (checkpoint / "critic" / "model").mkdir(parents=True)
    (checkpoint / "critic" / "model" / "config.json").write_text("{}")
    assert critic.start_path(cfg, checkpoint) == str(checkpoint / "critic" / "model")
    with pytest.raises(ConfigError, match=r"step_3 has no PRIME PRM \(no prm/model\)"):
        prm.start_path(cfg, checkpoint)
