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

import time

import torch

from treadle.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
from treadle.config import Config
from treadle.data import ResumableSampler
from treadle.engines.packing import balance_ranks
from treadle.engines.rollout import SamplingParams
from treadle.errors import ConfigError
from treadle.protocol import Batch
from treadle.rewards import load_reward_fn, score_batch
from treadle.tracking import timed
from treadle.trainers.common import (
    Trainer,
    evaluate,
    load_prompts,
    prompt_batch,
)

# Estimators whose inputs the driver cannot produce yet, and what they need.
NEEDS_MORE = {"gae": "a critic's values", "remax": "a greedy baseline rollout"}


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
    if alg.adv_estimator in NEEDS_MORE:
        usable = [n for n in ADV_ESTIMATORS.names() if n not in NEEDS_MORE]
        raise ConfigError(
            f"algorithm.adv_estimator={alg.adv_estimator} needs {NEEDS_MORE[alg.adv_estimator]}, "
            f"which treadle's RL driver does not provide yet; use one of {', '.join(usable)}"
        )
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


class RLTrainer(Trainer):
    """Owns the prompts, the reward and the actor worker group; ``fit`` runs the loop."""

    def __init__(self, cfg: Config) -> None:
        check_names(cfg)
        super().__init__(cfg)
        self.train_ds = load_prompts(cfg, cfg.data.train_files, "data.train_files")
        self.val_ds = (
            load_prompts(cfg, cfg.data.val_files, "data.val_files") if cfg.data.val_files else None
        )
        self.reward_fn = load_reward_fn(cfg.reward.function)
        self.estimator = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
        self.use_ref = cfg.algorithm.kl_coef > 0
        sampler = ResumableSampler(
            len(self.train_ds), cfg.data.batch_size, cfg.trainer.seed, shuffle=cfg.data.shuffle
        )
        self.start_workers(sampler, with_ref=self.use_ref)

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
        # Every rank gets a similar token count (the dispatcher cuts contiguous chunks).
        batch = balance_ranks(batch, cfg.actor.world_size)
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

    def run_step(self, step: int) -> dict[str, float]:
        """:meth:`step` plus throughput and, when due, held-out accuracy."""
        start = time.perf_counter()
        metrics = self.step(step)
        metrics["timing/step"] = time.perf_counter() - start
        metrics["throughput/tokens_per_s"] = (
            metrics.pop("generated_tokens") / metrics["timing/step"]
        )
        if self.val_ds is not None and self.eval_due(step):
            with timed(metrics, "eval"):
                metrics["eval/accuracy"] = evaluate(
                    self.cfg, self.group, self.val_ds, self.val_ds.pad_id
                )
        return metrics


def train(cfg: Config) -> dict[str, float]:
    """Run RL with ``cfg``; returns the last step's metrics."""
    return RLTrainer(cfg).fit()
