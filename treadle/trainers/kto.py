"""The KTO driver: a policy learns from unpaired desirable/undesirable examples.

::

    examples ─► reference log-probs (+ mismatched pairs) ─► update actor (KTO loss) ─► [eval]

KTO (Ethayarajh et al., arXiv 2402.01306) needs no pairs: each row is a prompt, a completion
and a label (desirable or not; a file of pairs gives two rows per pair). A step is one
optimizer step over ``data.batch_size`` examples, on the RL actor's worker group with the
frozen initial policy as reference, like DPO. The loss (``kto.loss_type``: ``kto``,
``apo_zero_unpaired``; :mod:`treadle.algorithms.preference`) compares each example's
log-ratio with the reference point z0, the batch's estimate of KL(π || π_ref) from
mismatched prompt/completion pairs: prompt i with the completion of example i - 1 of the
batch (TRL's rotation). The reference's log-probs of both are computed before the update, in
their own timed phase; the policy's of the mismatched pairs, without gradients, by the worker.

Evaluation on ``data.val_files`` (unpaired or pair files): ``eval/chosen_reward`` and
``eval/rejected_reward``, the mean implicit reward ``β (log π - log π_ref)`` of the
desirable and the undesirable held-out examples, and ``eval/margin`` between them; with
``kto.eval_task``, the held-out task accuracy of greedy generations (``eval/accuracy``).
Checkpoints, resume and ``final_model`` are the SFT driver's.
"""

from __future__ import annotations

import time

from treadle.algorithms import implicit_rewards
from treadle.check import check_algorithm
from treadle.config import Config
from treadle.protocol import Batch
from treadle.rewards import load_reward_fn
from treadle.tracking import timed
from treadle.trainers.base import Trainer
from treadle.trainers.evaluation import evaluate
from treadle.trainers.pairs import held_out_unpaired, load_unpaired, pair_sampler, unpaired_batch
from treadle.trainers.prompts import load_prompts


class KTOTrainer(Trainer):
    """Owns the examples and the actor group (with its reference); ``fit`` runs the loop."""

    headline = "kto/loss"

    @property
    def algorithm(self) -> str:  # type: ignore[override]
        return f"KTO (kto.loss_type={self.cfg.kto.loss_type})"

    def __init__(self, cfg: Config) -> None:
        check_algorithm(cfg, "kto")
        if cfg.kto.eval_task:
            load_reward_fn(cfg.reward.function)
        d = cfg.data  # all data is checked before the run directory is made
        self.train = load_unpaired(cfg, d.train_files, "data.train_files")
        self.val = load_unpaired(cfg, d.val_files, "data.val_files") if d.val_files else None
        self.val_prompts = (
            load_prompts(cfg, d.val_files, "data.val_files") if cfg.kto.eval_task else None
        )
        self.val_ref: Batch | None = None  # the reference never changes: score it once
        super().__init__(cfg)
        sampler, self.steps_per_epoch, self.total = pair_sampler(cfg, self.train)
        self.start_workers(sampler, with_ref=True)

    def run_step(self, step: int) -> dict[str, float]:
        m: dict[str, float] = {}
        start = time.perf_counter()
        batch = unpaired_batch(self.train, self.sampler.next_indices())
        with timed(m, "ref_log_probs"):
            batch = batch.union(self.group.compute_ref_unpaired_log_probs(batch))
        with timed(m, "update_actor"):
            m.update(self.group.train_kto(batch))
        m["timing/step"] = time.perf_counter() - start
        m["epoch"] = step / self.steps_per_epoch
        if self.val is not None and self.eval_due(step):
            with timed(m, "eval"):
                m.update(self.evaluate(step))
        return m

    def evaluate(self, step: int) -> dict[str, float]:
        """Mean implicit rewards of held-out desirable and undesirable examples; task accuracy
        if asked."""
        assert self.val is not None
        batch, pad = held_out_unpaired(self.cfg, self.val)
        if self.val_ref is None:
            self.val_ref = self.group.compute_ref_unpaired_log_probs(batch).unpad(pad)
        policy = self.group.compute_unpaired_log_probs(batch).unpad(pad)
        labels = batch.unpad(pad)["labels"].bool()
        rewards = implicit_rewards(policy["logps"], self.val_ref["ref_logps"], self.cfg.kto.beta)
        metrics = {}
        for name, rows in (("chosen", labels), ("rejected", ~labels)):
            if rows.any():
                metrics[f"eval/{name}_reward"] = float(rewards[rows].mean())
        if len(metrics) == 2:
            metrics["eval/margin"] = metrics["eval/chosen_reward"] - metrics["eval/rejected_reward"]
        if self.val_prompts is not None:
            self.rollout.sync_weights(version=step)  # generate with the trained weights
            pad_id = self.val_prompts.pad_id
            metrics["eval/accuracy"] = evaluate(
                self.cfg, self.rollout, self.val_prompts, pad_id, self.scorer
            )
        return metrics


def kto(cfg: Config) -> dict[str, float]:
    """Run KTO with ``cfg``; returns the last step's metrics."""
    return KTOTrainer(cfg).fit()
