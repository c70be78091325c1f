"""The RL driver's data-side options on a tiny model, local backend: DAPO dynamic sampling and
truncation masking, ReMax's greedy baseline. (KL in the reward, with resume:
tests/trainers/test_rl_e2e.py.)"""

from __future__ import annotations

import pytest
import tiny_runs
import torch

from treadle.config import load_config
from treadle.engines.inference import SamplingParams
from treadle.protocol import Batch
from treadle.rewards import load_reward_fn, score_batch
from treadle.trainers.rl import RLTrainer

N = 4


@pytest.fixture(scope="module")
def parity_reward(tmp_path_factory):
    """Equal rewards for every even-answer prompt; varied (by length) for odd ones."""
    path = tmp_path_factory.mktemp("reward") / "parity.py"
    path.write_text(
        "def score(prompt, response, ground_truth):\n"
        "    return 1.0 if int(ground_truth) % 2 == 0 else float(len(response) % 2)\n"
    )
    return f"{path}:score"


def trainer(task, out, reward, *overrides: str) -> RLTrainer:
    cfg = load_config(
        None,
        tiny_runs.overrides(
            task,
            out,
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=12",
            "rollout.engine=hf",
            f"reward.function={reward}",
            "trainer.backend=local",
            *overrides,
            prompts=4,
            samples=N,
        ),
    )
    return RLTrainer(cfg)


def groups(batch: Batch) -> dict[str, list[float]]:
    scores = batch["token_level_scores"].sum(-1).tolist()
    out: dict[str, list[float]] = {}
    for uid, s in zip(batch["uid"], scores, strict=True):
        out.setdefault(str(uid), []).append(s)
    return out


def test_dynamic_sampling_keeps_groups_with_varied_rewards(tiny_task, parity_reward, tmp_path):
    t = trainer(
        tiny_task,
        tmp_path,
        parity_reward,
        "algorithm.filter_groups=true",
        "algorithm.max_gen_rounds=6",
    )
    try:
        m: dict[str, float] = {}
        batch = t.source.sample(1, m)
    finally:
        t.close()
    rounds = int(m["rollout/gen_rounds"])
    assert len(batch) == 4 * N
    assert t.sampler.position == 4 * rounds  # each round drew a fresh batch of prompts
    by_group = groups(batch)
    assert len(by_group) == 4 and all(len(s) == N for s in by_group.values())
    varied = [len(set(s)) > 1 for s in by_group.values()]  # in batch order
    if rounds < 6:  # filled by kept groups alone
        assert all(varied)
    else:  # topped up: the kept (varied) groups come first
        assert varied == sorted(varied, reverse=True)
    # Every even-answer group has equal rewards, so none of them is among the kept ones.
    for uid, gt in zip(batch["uid"][::N], batch["ground_truth"][::N], strict=True):
        if int(gt) % 2 == 0:
            assert not varied[list(by_group).index(str(uid))]
    assert 0 < m["rollout/kept_group_frac"] <= 1
    assert m["timing/generate"] > 0 and m["timing/reward"] > 0


def test_remax_baseline_is_the_greedy_response_score(tiny_task, length_reward, tmp_path):
    t = trainer(tiny_task, tmp_path, length_reward, "algorithm.adv_estimator=remax")
    try:
        batch = t.source.sample(1, {})
        firsts = batch.select(list(range(0, len(batch), N))).only(
            ["prompts", "prompt_mask"], ["uid", "prompt_text", "ground_truth"]
        )
        greedy = t.rollout.generate(firsts, SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
        m = t.step(2)
    finally:
        t.close()
    want = score_batch(
        load_reward_fn(length_reward),
        list(greedy["prompt_text"]),
        list(greedy["response_text"]),
        list(greedy["ground_truth"]),
    )
    torch.testing.assert_close(batch["baseline_scores"], torch.tensor(want).repeat_interleave(N))
    assert m["timing/generate_greedy"] > 0 and m["actor/grad_norm"] > 0


def test_mask_truncated_drops_cut_responses_from_the_loss(tiny_task, parity_reward, tmp_path):
    t = trainer(
        tiny_task,
        tmp_path,
        parity_reward,
        "algorithm.mask_truncated=true",
        # the tiny model ends a response at a step with p ~ 0.004: of 64 responses of up to 12
        # tokens ~3 finish (none: p ~ 0.05), the rest are cut
        "data.batch_size=16",
    )
    seen: list[Batch] = []
    update = t.group.update_actor

    def spy(batch: Batch) -> dict[str, float]:
        seen.append(batch)
        return update(batch)

    t.group.update_actor = spy  # type: ignore[method-assign]
    try:
        m = t.step(1)
    finally:
        t.close()
    [batch] = seen
    cut = torch.tensor([r == "length" for r in batch["stop_reason"]])
    assert 0 < int(cut.sum()) < len(batch), "need both cut and finished responses"
    assert batch["response_mask"][cut].sum() == 0
    assert (batch["response_mask"][~cut].sum(-1) > 0).all()
    assert m["response/length_mean"] > 0  # metrics count every generated token


def test_train_refuses_a_dpo_config(tiny_task, tmp_path):
    from treadle.runtime.errors import ConfigError
    from treadle.trainers.rl import train

    cfg = load_config(
        "examples/arithmetic/dpo.yaml",
        [f"model.path={tiny_task['model']}", f"trainer.output_dir={tmp_path / 'run'}"],
    )
    with pytest.raises(ConfigError, match=r"sets the 'dpo' section.*run `treadle dpo`"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_rollout_dtype_bfloat16_engine_gets_cast_weights(tiny_task, length_reward, tmp_path):
    t = trainer(tiny_task, tmp_path, length_reward, "rollout.dtype=bfloat16")
    try:
        m = t.step(1)
        worker = t.group.workers[0]  # local backend: the worker object itself
        engine_params = dict(worker.server.engine.model.named_parameters())
        actor = {name: tensor.clone() for name, tensor in worker.actor.full_state()}
    finally:
        t.close()
    assert {p.dtype for p in engine_params.values()} == {torch.bfloat16}
    for name, param in engine_params.items():  # the synced weights are the trained ones, cast
        assert torch.equal(param, actor[name].to(torch.bfloat16)), name
    # bfloat16 sampling differs from the float32 actor a little, and the metrics see it.
    assert 0 < m["rollout/logprob_diff_mean"] < 0.1


def test_on_policy_update_without_the_old_log_prob_pass_is_the_same(
    tiny_task, length_reward, tmp_path
):
    """One optimizer step a batch: the update's own forward stands for the old policy. The
    run equals one with the separate pass: same metrics (mismatch included), same weights."""
    runs = {}
    for name, flag in (("pass", "true"), ("fused", "null")):
        t = trainer(
            tiny_task, tmp_path / name, length_reward, f"actor.recompute_old_log_probs={flag}"
        )
        try:
            assert t.old_log_prob_pass == (flag == "true")
            metrics = [t.step(1), t.step(2)]
            weights = {k: v.clone() for k, v in t.group.workers[0].actor.full_state()}
        finally:
            t.close()
        runs[name] = metrics, weights
    (m_pass, w_pass), (m_fused, w_fused) = runs["pass"], runs["fused"]
    assert "timing/old_log_probs" in m_pass[0] and "timing/old_log_probs" not in m_fused[0]
    for a, b in zip(m_pass, m_fused, strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "rollout/is_ratio_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        # the mismatch is float32 rounding (two forwards of the same weights, batched apart):
        # equal to a unit in the last place of log-probs down to -16 (9.5e-7 at -8)
        for key in ("rollout/logprob_diff_mean", "rollout/logprob_diff_max"):
            assert b[key] == pytest.approx(a[key], abs=2e-6), key
    for k in w_pass:
        torch.testing.assert_close(w_fused[k], w_pass[k], rtol=1e-5, atol=1e-6)


def test_recompute_old_log_probs_false_is_refused_when_needed(tiny_task):
    from treadle.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"actor.recompute_old_log_probs=false needs one"):
        load_config(
            None,
            [
                f"model.path={tiny_task['model']}",
                "actor.ppo_epochs=2",
                "actor.recompute_old_log_probs=false",
            ],
        )


def test_on_ray_the_workers_begin_before_the_data_and_close_if_it_fails(
    tiny_task, parity_reward, tmp_path, monkeypatch
):
    """The RL driver starts its workers (on Ray) before it reads its data; data that fails
    then closes them (and gives the logs back) before the error reaches the caller."""
    from treadle.runtime.errors import DataError
    from treadle.trainers import launch

    order: list[str] = []

    class Begun:
        def close(self) -> None:
            order.append("closed")

    def begun(self, with_ref, layout, wait):
        order.append(f"launched wait={wait}")
        self._restore_logs = lambda: order.append("logs back")
        return Begun()

    def bad_data(self):
        order.append("data")
        raise DataError("data.train_files: train.jsonl row 3: no 'prompt'")

    monkeypatch.setattr(launch.Launch, "_launch", begun)
    monkeypatch.setattr(RLTrainer, "load_data", bad_data)
    with pytest.raises(DataError, match="row 3"):
        trainer(tiny_task, tmp_path, parity_reward, "trainer.backend=ray")
    assert order == ["launched wait=False", "data", "closed", "logs back"]


def test_the_segments_of_a_split_session_weigh_as_one_trajectory():
    """The driver hands the estimator each sample's weight in its group: the two rows of
    sample 0 (a session split into two segments) half each."""
    from types import SimpleNamespace

    batch = Batch.from_dict(
        {
            "token_level_rewards": torch.tensor([[1.0], [1.0], [0.0], [0.5]]),
            "response_mask": torch.ones(4, 1, dtype=torch.long),
            "sample_index": torch.tensor([0, 0, 1, 2]),
        },
        {"uid": ["a", "a", "a", "a"]},
    )
    fake = SimpleNamespace(cfg=load_config(None, []), needs=())
    inputs = RLTrainer.estimator_inputs(fake, batch)
    assert inputs.sample_weights.tolist() == [0.5, 0.5, 1.0, 1.0]
    whole = batch.select([1, 2, 3])
    assert RLTrainer.estimator_inputs(fake, whole).sample_weights is None
