"""The RL driver: one controller that runs the dataflow, step after step.

::

    prompts ─► generate ─► reward ─► old log-probs ─► ref log-probs ─► values ─► advantages
                  ▲  (dynamic sampling: more rounds)                               │
                                                                                   ▼
         sync weights ◄─ update actor ◄─ update critic ◄───────────────────────────┘

Every phase is a call on the actor worker group (or a pure function here on the driver) and is
timed into ``timing/<phase>``. Algorithms are chosen by name: the advantage estimator and the
policy loss come from :mod:`treadle.algorithms`' registries, so a new variant never touches
this loop. What an estimator reads beyond rewards is part of its registration
(``needs=...``): one that needs ``values`` (GAE) gets a critic, one that needs
``baseline_rewards`` (ReMax) gets the scores of greedy responses, generated here.

PPO's critic (values, update critic) and a reward model (inside reward) are groups of their
own, present when the estimator reads values / ``reward.model_path`` is set
(:mod:`treadle.trainers.roles`); a checkpoint holds the critic in ``critic/``. PRIME's
implicit PRM (``needs=("implicit_rewards",)``) is one too, updated and read before the
advantages (:mod:`treadle.trainers.prime`); a checkpoint holds it in ``prm/``. An LLM judge
(``reward.judge``, :mod:`treadle.rollout.judge`) is served with them and scores inside reward,
weighed with the reward function.

DAPO's data-side pieces (arXiv 2503.14476) are options of the same loop: over-long reward
shaping (``reward.overlong_buffer_len``), dynamic sampling (``algorithm.filter_groups``: groups
whose rewards are all equal are dropped and more prompts are generated, at most
``algorithm.max_gen_rounds`` rounds), and masking truncated responses out of the loss
(``algorithm.mask_truncated``). The KL penalty can sit in the loss (``algorithm.kl_coef``) or
in the reward (``algorithm.kl_reward_coef``, fixed or adaptive with ``algorithm.kl_target``).

The step takes its batch from a :class:`~treadle.rollout.sources.RolloutSource` and hands the
new weights back to it; ``trainer.mode`` picks the source once: sync generates in the step,
one_step_off and async overlap generation with training (the split replicas generate ahead into
a buffer the step takes its batch from, weights are synced as ``async.sync_every`` says). The
step itself is the same in every mode, and DAPO's dynamic sampling is the sources' one group
filter.

Evaluation (``trainer.eval_every``, the validation sets of :mod:`treadle.trainers.evaluation`)
is the source's too: in sync mode it runs in the step, with the weights just synced; in the
modes that generate ahead it runs on the replicas beside training, on the weights of the step
that asked for it, and its metrics join that step's record when they come back (the record is
logged then: :class:`~treadle.trainers.base.HeldRecords`).

Resume: the newest complete checkpoint gives the actor (and critic) weights, optimizers, data
position, the adaptive KL coefficient and RNG; sampling seeds are derived from (seed, step,
round), so a resumed run draws the same samples as an uninterrupted one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import torch

from treadle.agents.registry import load_agent_loop
from treadle.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
)
from treadle.algorithms.correction import rollout_correction
from treadle.algorithms.diagnostics import (
    equal_reward_frac,
    group_reward_std,
    nonzero_advantage_frac,
)
from treadle.algorithms.inputs import EstimatorInputs
from treadle.algorithms.kl import kl_in_reward
from treadle.algorithms.shaping import overlong_penalty
from treadle.algorithms.utils import mismatch_metrics, mismatch_stats, trajectory_weights
from treadle.config import Config
from treadle.config.rules import Kind, check_algorithm
from treadle.data import PromptSampler
from treadle.engines.packing import balance_ranks
from treadle.protocol import Batch, response_attention
from treadle.rewards import component_matrix, load_reward_fn
from treadle.rollout.sources import RolloutSource, make_source
from treadle.runtime.faults import failpoint
from treadle.tracking.tracker import timed
from treadle.trainers.base import Trainer
from treadle.trainers.datasets import prompt_sampler
from treadle.trainers.evaluation import (
    agenerate_sets,
    eval_params,
    load_val_sets,
    make_scorer,
    rule_scores,
    score_sets,
    scorer_metrics,
)
from treadle.trainers.prime import ImplicitPRM
from treadle.trainers.prompts import load_prompts
from treadle.trainers.roles import plan_roles
from treadle.workers import ppo_steps


def check_names(cfg: Config, kind: Kind = "train") -> None:
    """Fail before anything starts if a registered name or a rule of an RL run's roles is
    broken (``treadle.config.rules``), or the reward function or agent loop does not load."""
    check_algorithm(cfg, kind)
    load_reward_fn(cfg.reward.function)
    load_agent_loop(cfg.rollout.agent_loop, cfg.rollout.env)


def outcome_rewards(mask: torch.Tensor, scores: list[float]) -> torch.Tensor:
    """The score of each response, placed on its last valid token (the model's last token of a
    multi-turn trajectory, whose mask has gaps where tool tokens are)."""
    rewards = torch.zeros(mask.shape, dtype=torch.float32)
    positions = torch.arange(mask.shape[-1]).expand(mask.shape)
    last = torch.where(mask.bool(), positions, 0).amax(-1)
    rewards[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    return rewards


def rollout_metrics(batch: Batch, component_keys: Sequence[str] = ()) -> dict[str, float]:
    """Rewards (and the means of the reward's named components, GDPO), lengths and, when the
    old log-probs were computed here, the rollout/train mismatch (otherwise the update reports
    it)."""
    mask = batch["response_mask"].float()
    lengths = mask.sum(-1)
    scores = batch["token_level_scores"].sum(-1)
    m = {
        "reward/mean": float(scores.mean()),
        "reward/max": float(scores.max()),
        "response/length_mean": float(lengths.mean()),
        "response/clip_ratio": float(sum(r == "length" for r in batch["stop_reason"]) / len(batch)),
        "generated_tokens": float(mask.sum()),
        "rollout/samples": float(len(batch)),  # trained this step (a soak checks none is lost)
        # the oldest weights any sample was generated with (all equal in a synchronous step)
        "rollout/weight_version": float(batch["weight_version"].min()),
    }
    if component_keys:
        parts = batch["reward_components"].T
        for key, part in zip(component_keys, parts, strict=True):
            m[f"reward/{key}_mean"] = float(part.mean())
    if "turns" in batch:  # an agent loop: per-trajectory turns and what its info reported
        m["agent/turns_mean"] = float(batch["turns"].mean())
        m["agent/turns_max"] = float(batch["turns"].max())
        m["response/total_length_mean"] = float(response_attention(batch).sum(-1).float().mean())
        for key in batch.tensors:
            if key.startswith("agent_"):
                m[f"agent/{key[len('agent_') :]}_mean"] = float(batch[key].mean())
    if "old_log_probs" in batch:
        stats = mismatch_stats(batch["old_log_probs"], batch["rollout_log_probs"], mask)
        m.update(mismatch_metrics(stats))
    return m


def signal_metrics(batch: Batch) -> dict[str, float]:
    """What the update can learn from (docs/diagnostics.md): ``advantages/nonzero_frac``, the
    share of the loss's response tokens with a non-zero advantage, and over the groups of two
    or more samples (none when ``rollout.n`` is 1) ``reward/frac_zero_std``, the share whose
    rewards are all equal (TRL's ``frac_reward_zero_std``), and ``reward/group_std``, the
    reward's spread within a group."""
    mask, scores, uids = batch["response_mask"], batch["token_level_scores"].sum(-1), batch["uid"]
    m = {"advantages/nonzero_frac": nonzero_advantage_frac(batch["advantages"], mask)}
    equal, spread = equal_reward_frac(scores, list(uids)), group_reward_std(scores, list(uids))
    if equal is not None and spread is not None:
        m.update({"reward/frac_zero_std": equal, "reward/group_std": spread})
    return m


def finished_only(batch: Batch) -> torch.Tensor:
    """``response_mask`` with the responses cut off at ``max_new_tokens`` masked out."""
    kept = torch.tensor([r != "length" for r in batch["stop_reason"]])
    return batch["response_mask"] * kept[:, None]


def sample_rows(batch: Batch, k: int) -> list[dict[str, Any]]:
    """``k`` samples spread over ``batch`` (other prompts, not one prompt's group), as the
    trackers' "samples" table holds them: prompt, response, reward, ground truth."""
    scores = batch["token_level_scores"].sum(-1).tolist()
    picks = sorted({i * len(batch) // k for i in range(min(k, len(batch)))})
    return [
        {
            "prompt": batch["prompt_text"][i],
            "response": batch["response_text"][i],
            "reward": float(scores[i]),
            "ground_truth": _text(batch["ground_truth"][i]),
        }
        for i in picks
    ]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def old_log_prob_pass(cfg: Config, needs: Sequence[str]) -> bool:
    """Whether a step computes the old policy's log-probs before the update: when PPO's
    several optimizer steps or the KL in the reward need them (``Config.needs_old_log_prob_pass``)
    or the estimator reads them; not for a loss whose old policy is the rollout's
    (``bypass_mode``), unless ``actor.recompute_old_log_probs`` says so."""
    if {"old_log_probs", "sum_pi_squared"} & set(needs):  # the pass computes them
        return True
    alg = cfg.algorithm
    bypass = POLICY_LOSSES.info(alg.policy_loss).get("old") == "rollout_log_probs"
    if bypass and alg.kl_reward_coef == 0 and cfg.actor.recompute_old_log_probs is None:
        return False
    return cfg.needs_old_log_prob_pass()


class RLTrainer(Trainer):
    """Owns the prompts, the reward and the actor worker group; ``fit`` runs the loop."""

    kind: Kind = "train"  # whose rules the config is checked with

    def __init__(self, cfg: Config) -> None:
        check_names(cfg, self.kind)
        self.layout = layout = plan_roles(cfg)  # critic? reward model? judge? where? (checked)
        super().__init__(cfg)
        self.resumed_state: dict[str, Any] = {}  # the checkpoint's driver state, when resumed
        use_ref = cfg.algorithm.kl_coef > 0 or cfg.algorithm.kl_reward_coef > 0
        self.begin_workers(use_ref, layout)  # on Ray: they start while the data loads
        try:
            sampler = self.load_data()
        except BaseException:
            self.abandon_workers()
            raise
        self.start_workers(sampler, use_ref, layout)  # (and the side roles, into self.side)
        self.critic, self.rm = self.side.get("critic"), self.side.get("reward_model")
        prm = self.side.get("prm")  # PRIME's implicit PRM (treadle.trainers.prime)
        self.prm = ImplicitPRM(cfg, prm) if prm is not None else None
        self.source: RolloutSource = make_source(
            cfg, self.rollout, self.train_ds, self.sampler, self.score, self.start
        )
        if self.resumed_state:
            self.source.load_state(self.resumed_state)

    def load_data(self) -> PromptSampler:
        """The prompts, the validation sets, the scorer and the step's settings; returns the
        sampler over the prompts."""
        cfg, alg = self.cfg, self.cfg.algorithm
        self.train_ds = load_prompts(cfg, cfg.data.train_files, "data.train_files")
        self.val_sets = load_val_sets(cfg)  # (closed by close())
        self.scorer = make_scorer(cfg, judge=self.layout.judge)  # now: the async producer scores
        self.estimator = ADV_ESTIMATORS.get(alg.adv_estimator)
        self.needs = ADV_ESTIMATORS.needs(alg.adv_estimator)  # what it reads beyond rewards
        self.kl_ctrl = (
            AdaptiveKLController(alg.kl_reward_coef, alg.kl_target, alg.kl_horizon)
            if alg.kl_target is not None
            else FixedKLController(alg.kl_reward_coef)
        )
        # the exact KL computes the reference's distribution in the update: no pass for it
        exact_kl = KL_ESTIMATORS.info(alg.kl_estimator).get("full_vocab", False)
        self.ref_pass = alg.kl_reward_coef > 0 or (alg.kl_coef > 0 and not exact_kl)
        self.old_log_prob_pass = old_log_prob_pass(cfg, self.needs)
        return prompt_sampler(cfg, len(self.train_ds))  # data.sampler: uniform | pass_rate

    @property
    def algorithm(self) -> str:  # type: ignore[override]
        alg, r = self.cfg.algorithm, self.cfg.rollout
        return (
            f"RL ({alg.adv_estimator} advantages, {alg.policy_loss} loss, rollout "
            f"{r.engine} {r.placement}, trainer.mode={self.cfg.trainer.mode})"
        )

    def optimizer_steps(self) -> int:
        """The actor's: every step after the critic's warm-up, PPO's mini-batches over its
        epochs of the nominal batch (:func:`~treadle.workers.ppo_steps`)."""
        a = self.cfg.actor
        per_step = ppo_steps(self.cfg, a.ppo_epochs, a.ppo_mini_batch_size, a.dp_size())
        return max(self.total - self.cfg.critic.warmup_steps, 0) * per_step

    def driver_state(self) -> dict[str, Any]:
        # the source's data position: ahead of training, the sampler's at what is not trained
        kl = {"kl_ctrl": self.kl_ctrl.state_dict()}
        return {**super().driver_state(), **kl, **self.source.state()}

    def load_driver_state(self, state: dict[str, Any]) -> None:
        super().load_driver_state(state)
        if "kl_ctrl" in state:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.resumed_state = state  # for the source, which starts after the workers

    def step(self, step: int) -> dict[str, float]:
        """One RL step: every phase a named, timed call, whatever ``trainer.mode``."""
        alg = self.cfg.algorithm
        m: dict[str, float] = {}
        # 1-2. rollout and reward (several rounds with dynamic sampling), generated in the step
        # or ahead of it, as the source says
        batch = self.source.sample(step, m)
        # Every data-parallel rank gets a similar token count (the dispatcher cuts contiguous
        # chunks), a prompt's samples on one rank where they fit (actor.share_prompts).
        a = self.cfg.actor
        batch = balance_ranks(batch, a.dp_size(), a.shares_prompts())
        # 3-4. the actor's "old" log-probs and the frozen reference's, when they are needed
        batch = self.log_prob_passes(batch, m)
        batch["token_level_rewards"] = self.kl_shaped_rewards(batch, m)
        # 5. the critic's value of the state before each response token (PPO)
        if self.critic is not None:
            with timed(m, "values"):
                batch = batch.union(self.critic.compute_values(batch))
        # 5b. PRIME: the implicit PRM learns from the outcomes, then rewards each token
        implicit = self.prm.rewards(batch, m) if self.prm is not None else None
        # 6. advantages and the critic's targets: a pure function on the driver
        with timed(m, "advantages"):
            batch["advantages"], batch["returns"] = self.estimator(
                self.estimator_inputs(batch, implicit), self.estimator_settings()
            )
        m.update(rollout_metrics(batch, alg.gdpo_reward_keys))
        if self.samples_due(step):
            self.samples = sample_rows(batch, self.cfg.trainer.log_samples)
        if alg.mask_truncated:  # DAPO: a cut-off response says nothing about its answer
            batch["response_mask"] = finished_only(batch)
        m.update(signal_metrics(batch))  # what the update can learn from
        # 7. update the critic toward the returns; 8. the actor, unless the critic warms up;
        # 9. push the actor's weights into the rollout engine
        batch.meta["step"] = step
        if self.critic is not None:
            with timed(m, "update_critic"):
                m.update(self.critic.update_critic(batch))
        if step > self.cfg.critic.warmup_steps:
            with timed(m, "update_actor"):
                m.update(self.group.update_actor(batch))
            with timed(m, "sync_weights"):  # now, or when due (async.sync_every)
                m.update(self.source.after_update(step))
        return m

    def log_prob_passes(self, batch: Batch, m: dict[str, float]) -> Batch:
        """3. the actor's own log-probs of the sampled tokens: the PPO "old" policy (on-policy,
        one optimizer step a batch: the update's first forward gives them, one pass fewer);
        4. the frozen reference's, for the KL term (in the loss, in the reward, or both)."""
        if self.old_log_prob_pass:
            # the optimal token baseline also reads Σ_v π(v)² of each token's distribution
            squares = "sum_pi_squared" in self.needs
            with timed(m, "old_log_probs"):
                batch = batch.union(self.group.compute_log_probs(batch, sum_pi_squared=squares))
        if self.ref_pass:
            with timed(m, "ref_log_probs"):
                batch = batch.union(self.group.compute_ref_log_probs(batch))
        return batch

    def score(self, batch: Batch, m: dict[str, float] | None = None) -> torch.Tensor:
        """Token-level scores [B, R]: the reward function's score, or the reward model's when
        there is one (the rule's mean is then logged as ``reward/rule_mean``), plus DAPO's
        over-long penalty, on each response's last valid token. With
        ``algorithm.gdpo_reward_keys`` the reward's named components go into the batch too
        (``reward_components`` [B, K])."""
        raw = rule_scores(self.scorer, batch)
        scores = torch.tensor(raw)
        if keys := self.cfg.algorithm.gdpo_reward_keys:  # the reward's parts, [B, K] (GDPO)
            batch["reward_components"] = component_matrix(raw, keys, self.cfg.reward.function)
        if self.rm is not None:
            if m is not None:
                m["reward/rule_mean"] = float(scores.mean())
            scores = self.rm.compute_rm_scores(batch)["rm_scores"].float()
        r = self.cfg.reward
        if r.overlong_buffer_len:
            lengths = batch["response_mask"].sum(-1)
            max_len = self.cfg.rollout.max_new_tokens
            scores = scores + overlong_penalty(
                lengths, max_len, r.overlong_buffer_len, r.overlong_penalty
            )
        return outcome_rewards(batch["response_mask"], scores.tolist())

    def estimator_inputs(
        self, batch: Batch, implicit_rewards: torch.Tensor | None = None
    ) -> EstimatorInputs:
        """What the estimator reads: rewards, mask, groups, values and greedy baselines when
        there are, and its ``needs``: the old policy's log-probs and Σπ² (optimal token
        baseline; with rollout correction, its importance weights too), the reward's
        components (GDPO), the implicit PRM's token rewards (PRIME); each sample's weight."""
        alg, out = self.cfg.algorithm, {}
        if "old_log_probs" in self.needs:
            out["old_log_probs"] = batch["old_log_probs"]
            if alg.rollout_correction != "none":
                out["rollout_is_weights"], _, _ = rollout_correction(
                    batch["old_log_probs"],
                    batch["rollout_log_probs"],
                    batch["response_mask"].float(),
                    alg.rollout_correction,
                    alg.rollout_correction_cap,
                )
        for name in ("sum_pi_squared", "reward_components"):
            if name in self.needs:
                out[name] = batch[name]
        out["sample_weights"] = _segment_weights(batch)  # a split session weighs as one
        return EstimatorInputs(
            batch["token_level_rewards"],
            batch["response_mask"].float(),
            list(batch["uid"]),
            values=batch.tensors.get("values"),
            baseline_rewards=batch.tensors.get("baseline_scores"),
            implicit_rewards=implicit_rewards,
            **out,
        )

    def estimator_settings(self) -> Any:
        """The estimator's settings: those of its fields that are config settings (GDPO's
        ``reward_weights`` is ``algorithm.gdpo_reward_weights``, PRIME's coefficients are
        ``prime.*``); its other fields keep their defaults."""
        alg, p = self.cfg.algorithm, self.cfg.prime
        config = {
            "gamma": alg.gamma,
            "lam": alg.lam,
            "norm_adv_by_std": alg.norm_adv_by_std,
            "reward_weights": alg.gdpo_reward_weights,
            "reward_gt_coef": p.reward_gt_coef,
            "reward_dpo_coef": p.reward_dpo_coef,
        }
        reads = ADV_ESTIMATORS.knobs(alg.adv_estimator)
        values = {key: value for key, value in config.items() if key in reads}
        return ADV_ESTIMATORS.settings(alg.adv_estimator)(**values)

    def kl_shaped_rewards(self, batch: Batch, m: dict[str, float]) -> torch.Tensor:
        """``token_level_scores`` minus the KL penalty when ``algorithm.kl_reward_coef`` > 0."""
        alg = self.cfg.algorithm
        if alg.kl_reward_coef == 0:
            return batch["token_level_scores"]
        rewards, seq_kl = kl_in_reward(
            batch["token_level_scores"],
            batch["old_log_probs"],
            batch["ref_log_probs"],
            batch["response_mask"],
            self.kl_ctrl.value,
            alg.kl_reward_estimator,
        )
        current = float(seq_kl.mean())
        m.update({"actor/reward_kl": current, "actor/reward_kl_coef": self.kl_ctrl.value})
        self.kl_ctrl.update(current, n_steps=len(batch))
        return rewards

    def run_step(self, step: int) -> dict[str, float]:
        """:meth:`step` plus throughput and, when due, the validation sets' metrics."""
        start = time.perf_counter()
        metrics = self.step(step)
        seconds = metrics["timing/step"] = time.perf_counter() - start
        metrics["throughput/tokens_per_s"] = metrics.pop("generated_tokens") / seconds
        metrics.update(self.source.metrics(seconds))
        metrics.update(scorer_metrics(self.scorer, self.val_sets))
        if self.val_sets and self.eval_due(step):
            # now (sync), or sent beside training, its metrics joining this step's later
            with timed(metrics, "eval"):
                metrics.update(self.source.evaluate(step, self.eval_requests, self.eval_scores))
        return metrics

    def eval_requests(self) -> Any:
        """The validation sets' generation (a coroutine for the rollout client's loop)."""
        failpoint("eval")
        return agenerate_sets(self.rollout, self.val_sets, eval_params(self.cfg))

    def eval_scores(self, outs: Any) -> dict[str, float]:
        return score_sets(self.cfg, self.val_sets, outs)

    def late_metrics(self, wait: bool) -> dict[int, dict[str, float]]:
        return self.source.late_metrics(wait)

    def evaluating(self) -> set[int]:
        return self.source.evaluating()


def train(cfg: Config) -> dict[str, float]:
    """Run RL with ``cfg``; returns the last step's metrics."""
    return RLTrainer(cfg).fit()


def _segment_weights(batch: Batch) -> torch.Tensor | None:
    """Each sample's weight in its group: 1 / the segments of its trajectory (the rows of one
    ``sample_index``, a session split where its prompts stopped extending each other)."""
    if "sample_index" not in batch:
        return None
    return trajectory_weights(list(batch["uid"]), batch["sample_index"].tolist())
