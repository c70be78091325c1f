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
``kto.eval_task``, the validation sets' task metrics (``eval/val/accuracy``, ...;
:mod:`treadle.trainers.evaluation`).
Checkpoints, resume and ``final_model`` are the SFT driver's.
"""

from __future__ import annotations

from treadle.algorithms import implicit_rewards
from treadle.config import Config
from treadle.config.rules import check_algorithm
from treadle.data import UnpairedDataset
from treadle.tracking.tracker import timed
from treadle.trainers.pairs import PairTrainer, held_out_unpaired, load_unpaired, unpaired_batch


class KTOTrainer(PairTrainer[UnpairedDataset]):
    """Owns the examples and the actor group (with its reference); ``fit`` runs the loop."""

    kind = "kto"
    headline = "kto/loss"

    @property
    def algorithm(self) -> str:  # type: ignore[override]
        return f"KTO (kto.loss_type={self.cfg.kto.loss_type})"

    def __init__(self, cfg: Config) -> None:
        check_algorithm(cfg, "kto")
        super().__init__(cfg, load_unpaired, with_ref=True, eval_task=cfg.kto.eval_task)

    def update(self, indices: list[int], m: dict[str, float]) -> None:
        batch = unpaired_batch(self.train, indices)
        with timed(m, "ref_log_probs"):
            batch = batch.union(self.group.compute_ref_unpaired_log_probs(batch))
        with timed(m, "update_actor"):
            m.update(self.group.train_kto(batch))

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
        return {**metrics, **self.task_accuracy(step)}


def kto(cfg: Config) -> dict[str, float]:
    """Run KTO with ``cfg``; returns the last step's metrics."""
    return KTOTrainer(cfg).fit()
