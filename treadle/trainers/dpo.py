"""The DPO driver: a policy learns from chosen/rejected pairs against a frozen reference.

::

    pairs ─► reference log-probs ─► update actor (preference loss) ─► [eval]

It runs on the RL actor's worker group: the actor is the policy, the worker's reference
(built from ``model.path``, also on resume) is the frozen initial policy. A step is one
optimizer step over ``data.batch_size`` pairs. The loss is chosen by name
(``dpo.loss_type``: ``sigmoid``, ``ipo``, ``hinge``, ... ``orpo``, ``simpo``;
:mod:`treadle.algorithms.preference`), on sequence log-probs summed over response tokens at
temperature 1, plus ``dpo.nll_coef`` times the chosen responses' token-mean NLL when set
(RPO, arXiv 2404.19733: it keeps DPO from lowering the likelihood of the chosen answers along
with the rejected ones). The reference log-probs of a batch are computed once, before the
update, in their own timed phase. A loss registered ``reference=False`` (ORPO, SimPO) gets
no reference model at all: the worker group is built without one and the phase is skipped.

Evaluation on ``data.val_files`` (pair files): ``eval/pair_accuracy`` and ``eval/margin`` of
the implicit reward ``β (log π - log π_ref)`` (reference-free: ``β log π / |y|``) on
held-out pairs (the reference's log-probs of them are computed once) and, with
``dpo.eval_task``, the validation sets' task metrics (``eval/val/accuracy``, ...;
:mod:`treadle.trainers.evaluation`), as ``treadle eval`` measures them. Checkpoints, resume and
``final_model`` are the SFT driver's.
"""

from __future__ import annotations

from treadle.algorithms import PREFERENCE_LOSSES, implicit_rewards, length_rewards
from treadle.config import Config
from treadle.config.rules import check_algorithm
from treadle.data import PairDataset
from treadle.tracking.tracker import timed
from treadle.trainers.pairs import PairTrainer, held_out_batch, load_pairs, pair_batch, pair_means


class DPOTrainer(PairTrainer[PairDataset]):
    """Owns the pairs and the actor group (with its reference); ``fit`` runs the loop."""

    kind = "dpo"
    headline = "dpo/loss"

    @property
    def algorithm(self) -> str:  # type: ignore[override]
        return f"DPO (dpo.loss_type={self.cfg.dpo.loss_type})"

    def __init__(self, cfg: Config) -> None:
        check_algorithm(cfg, "dpo")
        self.reference = PREFERENCE_LOSSES.info(cfg.dpo.loss_type).get("reference", True)
        super().__init__(cfg, load_pairs, with_ref=self.reference, eval_task=cfg.dpo.eval_task)

    def update(self, indices: list[int], m: dict[str, float]) -> None:
        batch = pair_batch(self.train, indices)
        if self.reference:
            with timed(m, "ref_log_probs"):
                batch = batch.union(self.group.compute_ref_pair_log_probs(batch))
        with timed(m, "update_actor"):
            m.update(self.group.train_dpo(batch))

    def evaluate(self, step: int) -> dict[str, float]:
        """Implicit-reward accuracy and margin on held-out pairs; task accuracy if asked."""
        assert self.val is not None
        batch, pad = held_out_batch(self.cfg, self.val)
        policy = self.group.compute_pair_log_probs(batch).unpad(pad)
        beta = self.cfg.dpo.beta
        if self.reference:
            if self.val_ref is None:
                self.val_ref = self.group.compute_ref_pair_log_probs(batch).unpad(pad)
            ref = self.val_ref
            chosen = implicit_rewards(policy["chosen_logps"], ref["ref_chosen_logps"], beta)
            rejected = implicit_rewards(policy["rejected_logps"], ref["ref_rejected_logps"], beta)
        else:
            pairs = batch.unpad(pad)
            chosen = length_rewards(policy["chosen_logps"], pairs["chosen_mask"].sum(1), beta)
            rejected = length_rewards(policy["rejected_logps"], pairs["rejected_mask"].sum(1), beta)
        return {**pair_means(chosen, rejected, prefix="eval/"), **self.task_accuracy(step)}


def dpo(cfg: Config) -> dict[str, float]:
    """Run DPO with ``cfg``; returns the last step's metrics."""
    return DPOTrainer(cfg).fit()
