"""The RL driver's side of PRIME (Cui et al., arXiv 2502.01456): its implicit PRM role.

``algorithm.adv_estimator=prime`` is registered with ``needs=("implicit_rewards",)``, so a run
with it gets this role, as one whose estimator needs values gets a critic (both are rows of
the table in :mod:`treadle.trainers.roles`, which starts them). Each step, after the rewards
(and old/ref log-probs):

::

    outcome labels y (the reward function's scores, in [0, 1])
        │   (loss=dpo: PRM forward -> each sample's opponents' Q in its group)
        ▼
    update_prm (one pass, prime.mini_batch_size per step) ─► q of its forward ─┐ update=after
        │ update=before (verl's default): another forward with the new PRM     │
        ▼                                                                      ▼
    implicit token rewards r_t = β q_t (normalised) ─► the prime estimator, beside the outcome

Choices:

- **Labels** are each response's score, the sum of its ``token_level_scores``; they must lie
  in [0, 1] (a BCE target). A reward model or DAPO's over-long penalty would leave that range,
  so they are refused at start-up; a reward function that returns something outside it stops
  the run naming the function.
- **Placement** as the critic's: colocated on the actor's bundles (``prime.placement``), or a
  pool of its own (``split``, ``prime.world_size`` ranks).
- **Checkpoints** hold the PRM in ``prm/`` (model, optimizer, RNG); resume starts the PRM from
  ``<checkpoint>/prm/model`` and the reference from ``prime.ref_path`` (or the PRM's start) as
  the first run did.
- **Metrics** under ``prime/``: ``loss`` (the update's forward), ``grad_norm``, ``lr``,
  ``label_mean``, ``reward_mean`` (Σ_t r_t) and ``raw_reward_mean`` (Σ_t q_t) of the rewards
  given, and verl's accuracies of the PRM against the labels: ``acc`` (pairs within a group
  ordered as their labels) and ``acc_abs`` (sign of Σ_t r_t against the label), of the rewards
  given, and ``acc_before``/``acc_abs_before`` of the update's forward (with several PRM
  mini-batches a step, the later ones are scored after the earlier ones' optimizer steps).
"""

from __future__ import annotations

import torch

from treadle.algorithms.prime import (
    dpo_opponents,
    implicit_process_rewards,
    pairwise_accuracy,
    sequence_log_ratio,
    sign_accuracy,
)
from treadle.config import Config, rules
from treadle.controller import WorkerGroup
from treadle.models.loading import shared_vocabulary
from treadle.protocol import Batch
from treadle.runtime.errors import RewardError
from treadle.tracking.tracker import timed
from treadle.workers.common import ATTENTION, SEQUENCES


def uses_prm(cfg: Config) -> bool:
    """Whether the run has PRIME's PRM (``treadle.config.rules.uses_prm``: ConfigError when
    the config cannot work with it), whose models must share the actor's vocabulary."""
    if not rules.uses_prm(cfg):
        return False
    _check_vocabulary(cfg)
    return True


def _check_vocabulary(cfg: Config) -> None:
    """The PRM and its reference score the actor's token ids: the same vocabulary size."""
    p = cfg.prime
    if not cfg.model.path or not (p.model_path or p.ref_path):
        return
    paths = [("prime.model_path", p.model_path), ("prime.ref_path", p.ref_path)]
    given = [(key, path) for key, path in paths if path]
    shared_vocabulary(cfg.model.path, given, cfg.model.allow_download)


def outcome_labels(batch: Batch, function: str) -> torch.Tensor:
    """Each response's score (float32 [B]), checked to lie in [0, 1]."""
    labels = batch["token_level_scores"].float().sum(-1)
    bad = ((labels < 0) | (labels > 1)).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        raise RewardError(
            f"algorithm.adv_estimator=prime learns from outcome labels in [0, 1], but reward "
            f"function '{function}' scored sample {i} (prompt {batch['prompt_text'][i]!r}) "
            f"{float(labels[i])}: make it return 0/1 correctness (or a probability)"
        )
    return labels


class ImplicitPRM:
    """The PRM's worker group, as the driver calls it once a step (:meth:`rewards`)."""

    def __init__(self, cfg: Config, group: WorkerGroup) -> None:
        self.p, self.group, self.function = cfg.prime, group, cfg.reward.function

    def rewards(self, batch: Batch, m: dict[str, float]) -> torch.Tensor:
        """Update the PRM on ``batch``'s outcomes and reward its tokens; returns the implicit
        token rewards [B,T] (the prime estimator's ``implicit_rewards``), logs ``prime/*``."""
        p, mask, ids = self.p, batch["response_mask"], list(batch["uid"])
        labels = outcome_labels(batch, self.function)
        work = batch.only([k for k in (*SEQUENCES, *ATTENTION) if k in batch])
        work["prm_labels"] = labels
        if p.loss == "dpo":  # the opponents' Q before the update (verl's "reverse" order)
            with timed(m, "prm_log_ratio"):
                first = self.group.compute_log_ratio(work)
            q0 = first["prm_log_ratio"]
            work["prm_opponents"] = dpo_opponents(sequence_log_ratio(q0, mask), labels, ids)
            work["prm_ref_log_probs"] = first["prm_ref_log_probs"]
        with timed(m, "update_prm"):
            out = self.group.update_prm(work)
        q = out["prm_log_ratio"]
        work["prm_ref_log_probs"] = out["prm_ref_log_probs"]  # frozen: no second ref pass
        before = implicit_process_rewards(q, mask, p.beta, p.norm)
        rewards = before
        if p.update == "before":
            with timed(m, "prm_rewards"):
                q = self.group.compute_log_ratio(work)["prm_log_ratio"]
            rewards = implicit_process_rewards(q, mask, p.beta, p.norm)
        seq = rewards.sum(-1)
        m.update(
            {
                "prime/loss": float(out["prm_loss"].mean()),
                "prime/grad_norm": float(out.meta["prime/grad_norm"]),
                "prime/lr": float(out.meta["prime/lr"]),
                "prime/label_mean": float(labels.mean()),
                "prime/reward_mean": float(seq.mean()),
                "prime/raw_reward_mean": float(sequence_log_ratio(q, mask).mean()),
                "prime/acc": pairwise_accuracy(seq, labels, ids),
                "prime/acc_abs": sign_accuracy(seq, labels),
                "prime/acc_before": pairwise_accuracy(before.sum(-1), labels, ids),
                "prime/acc_abs_before": sign_accuracy(before.sum(-1), labels),
            }
        )
        return rewards
