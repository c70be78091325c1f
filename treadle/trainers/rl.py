"""The RL driver: one controller that runs the dataflow, step after step.

::

    prompts ─► generate ─► reward ─► old log-probs ─► ref log-probs ─► advantages
                                                                        │
         sync weights ◄─ update actor ◄────────────────────────────────┘

Every phase is a call on the actor worker group (or a pure function here on the driver) and is
timed into ``timing/<phase>``. Algorithms are chosen by name: the advantage estimator and the
policy loss come from :mod:`treadle.algorithms`' registries, so a new variant never touches
this loop. Resume: the newest complete checkpoint gives the actor weights, optimizer, data
position and RNG; sampling seeds are derived from (seed, step), so a resumed run draws the
same samples as an uninterrupted one.
"""

from __future__ import annotations

import math
import time

import torch

from treadle import checkpoint as ckpt
from treadle.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
from treadle.config import Config
from treadle.data import ResumableSampler
from treadle.engines.rollout import SamplingParams
from treadle.errors import ConfigError
from treadle.protocol import Batch
from treadle.rewards import load_reward_fn, score_batch
from treadle.tracking import Tracker, timed
from treadle.trainers.common import (
    build_actors,
    evaluate,
    load_prompts,
    prepare_run_dir,
    prompt_batch,
    resume_point,
    save_checkpoint,
)


def check_names(cfg: Config) -> None:
    """Fail before anything starts if a registered name is wrong."""
    alg = cfg.algorithm
    for key, registry, name in (
        ("algorithm.adv_estimator", ADV_ESTIMATORS, alg.adv_estimator),
        ("algorithm.policy_loss", POLICY_LOSSES, alg.policy_loss),
        ("algorithm.kl_estimator", KL_ESTIMATORS, alg.kl_estimator),
    ):
        if name not in registry.names():
            raise ConfigError(f"{key}: unknown name {name!r}; valid: {', '.join(registry.names())}")
    load_reward_fn(cfg.reward.function)


def outcome_rewards(batch: Batch, scores: list[float]) -> torch.Tensor:
    """The score of each response, placed on its last valid token."""
    mask = batch["response_mask"]
    rewards = torch.zeros(mask.shape, dtype=torch.float32)
    last = (mask.sum(-1) - 1).clamp(min=0)
    rewards[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    return rewards


def rollout_metrics(batch: Batch) -> dict[str, float]:
    mask = batch["response_mask"].float()
    lengths = mask.sum(-1)
    diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs() * mask
    ratio = torch.exp(batch["old_log_probs"] - batch["rollout_log_probs"]) * mask
    scores = batch["token_level_rewards"].sum(-1)
    n_tok = mask.sum().clamp(min=1)
    return {
        "reward/mean": float(scores.mean()),
        "reward/max": float(scores.max()),
        "response/length_mean": float(lengths.mean()),
        "response/clip_ratio": float(sum(r == "length" for r in batch["stop_reason"]) / len(batch)),
        "rollout/logprob_diff_mean": float(diff.sum() / n_tok),
        "rollout/logprob_diff_max": float(diff.max()),
        "rollout/is_ratio_mean": float(ratio.sum() / n_tok),
        "generated_tokens": float(mask.sum()),
    }


class RLTrainer:
    """Owns the data, the actor worker group and the run directory; ``fit`` runs the loop."""

    def __init__(self, cfg: Config) -> None:
        check_names(cfg)
        self.cfg = cfg
        self.out = prepare_run_dir(cfg)
        latest, actor_path = resume_point(cfg)
        self.train_ds = load_prompts(cfg, cfg.data.train_files, "data.train_files")
        self.val_ds = (
            load_prompts(cfg, cfg.data.val_files, "data.val_files") if cfg.data.val_files else None
        )
        self.reward_fn = load_reward_fn(cfg.reward.function)
        self.estimator = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
        self.sampler = ResumableSampler(
            len(self.train_ds), cfg.data.batch_size, cfg.trainer.seed, shuffle=cfg.data.shuffle
        )
        self.start, self.resumed_from = 0, latest
        if latest is not None:
            state = ckpt.read_state(latest)
            self.start = int(state["step"])
            self.sampler.load_state_dict(state["sampler"])
        self.use_ref = cfg.algorithm.kl_coef > 0
        self.actors = build_actors(cfg, actor_path, with_ref=self.use_ref)
        self.group = self.actors.group
        if latest is not None:
            self.group.load_checkpoint(str(latest))

    def sampling(self, step: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            seed=self.cfg.trainer.seed * 100_003 + step,
        )

    def step(self, step: int) -> dict[str, float]:
        """One RL step: every phase a named, timed call."""
        cfg, group = self.cfg, self.group
        m: dict[str, float] = {}
        prompts = prompt_batch(self.train_ds, self.sampler.next_indices(), self.train_ds.pad_id)
        # 1. rollout: n responses per prompt, with the engine's log-probs
        with timed(m, "generate"):
            batch = group.generate(prompts, self.sampling(step))
        # 2. reward: rule or user function, on the driver
        with timed(m, "reward"):
            scores = score_batch(
                self.reward_fn,
                list(batch["prompt_text"]),
                list(batch["response_text"]),
                list(batch["ground_truth"]),
                spec=cfg.reward.function,
            )
            batch["token_level_rewards"] = outcome_rewards(batch, scores)
        # 3. the actor's own log-probs of the sampled tokens: the PPO "old" policy
        with timed(m, "old_log_probs"):
            batch = batch.union(group.compute_log_probs(batch))
        # 4. the frozen reference, for the KL term
        if self.use_ref:
            with timed(m, "ref_log_probs"):
                batch = batch.union(group.compute_ref_log_probs(batch))
        # 5. advantages: a pure function on the driver
        with timed(m, "advantages"):
            alg = cfg.algorithm
            batch["advantages"], _ = self.estimator(
                batch["token_level_rewards"],
                batch["response_mask"].float(),
                group_ids=list(batch["uid"]),
                gamma=alg.gamma,
                lam=alg.lam,
                norm_adv_by_std=alg.norm_adv_by_std,
            )
        # 6. update the actor, then 7. push its weights into the rollout engine
        batch.meta["step"] = step
        with timed(m, "update_actor"):
            m.update(group.update_actor(batch))
        with timed(m, "sync_weights"):
            group.sync_weights()
        m.update(rollout_metrics(batch))
        return m

    def timed_step(self, step: int) -> dict[str, float]:
        """:meth:`step` plus throughput and, when due, held-out accuracy."""
        t = self.cfg.trainer
        start = time.perf_counter()
        metrics = self.step(step)
        metrics["timing/step"] = time.perf_counter() - start
        metrics["throughput/tokens_per_s"] = (
            metrics.pop("generated_tokens") / metrics["timing/step"]
        )
        due = step == t.total_steps or (t.eval_every and step % t.eval_every == 0)
        if self.val_ds is not None and due:
            with timed(metrics, "eval"):
                metrics["eval/accuracy"] = evaluate(
                    self.cfg, self.group, self.val_ds, self.val_ds.pad_id
                )
        return metrics

    def fit(self) -> dict[str, float]:
        """Run until ``trainer.total_steps``; returns the last step's metrics."""
        t, metrics = self.cfg.trainer, {}
        try:
            with Tracker(self.out, t.total_steps, self.start, t.progress) as tracker:
                if self.resumed_from is not None:
                    tracker.print(f"resumed from {self.resumed_from} (step {self.start})")
                for step in range(self.start + 1, t.total_steps + 1):
                    metrics = self.timed_step(step)
                    tracker.log(step, metrics)
                    if not all(math.isfinite(v) for v in metrics.values()):
                        raise FloatingPointError(f"step {step}: a metric is not finite: {metrics}")
                    last = step == t.total_steps
                    if last or (t.save_every and step % t.save_every == 0):
                        state = self.sampler.state_dict()
                        save_checkpoint(self.cfg, self.group, step, state, final=last)
        finally:
            self.actors.close()
        return metrics


def train(cfg: Config) -> dict[str, float]:
    """Run RL with ``cfg``; returns the last step's metrics."""
    return RLTrainer(cfg).fit()
