"""The reward-model driver: a Bradley-Terry score learned from chosen/rejected pairs.

::

    pairs ─► update reward model (-log σ(r_chosen - r_rejected)) ─► [eval: held-out pairs]

The model starts from ``model.path``: a causal LM folder (usually the SFT model) becomes a
value model with a zero-initialised score head (every pair starts tied, loss ln 2), or a
value-model folder saved by treadle continues. A response's reward is the value at the last
token of prompt + response. A step is one optimizer step over ``data.batch_size`` pairs with
the ``actor`` section's optimizer settings and micro-batches; ``actor.world_size`` shards it.
Held-out ``eval/pair_accuracy`` (chosen scored above rejected) and ``eval/margin`` come from
``data.val_files``. ``final_model`` is a value-model folder, what an RL reward-model role
loads. Checkpoints and resume are the other drivers'.
"""

from __future__ import annotations

from treadle.config import Config
from treadle.controller import Actors, Placement, start_group
from treadle.data import PairDataset
from treadle.tracking.tracker import timed
from treadle.trainers.pairs import PairTrainer, held_out_batch, load_pairs, pair_batch, pair_means
from treadle.workers import RewardTrainerWorker


class RMTrainer(PairTrainer[PairDataset]):
    """Owns the pairs and the reward-model group; ``fit`` runs the loop."""

    kind = "rm"
    headline = "rm/loss"
    algorithm = "reward-model training (Bradley-Terry)"
    serves_rollout = False  # its workers score pairs

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg, load_pairs, with_ref=False)

    def build_workers(
        self, start_path: str, with_ref: bool, placement: Placement, wait: bool = True
    ) -> Actors:
        kwargs = {"model_path": start_path, "optimizer_steps": self.optimizer_steps()}
        return start_group(self.cfg, placement, RewardTrainerWorker, kwargs, wait)

    def update(self, indices: list[int], m: dict[str, float]) -> None:
        with timed(m, "update_rm"):
            m.update(self.group.train_rm(pair_batch(self.train, indices)))

    def evaluate(self, step: int) -> dict[str, float]:
        """Pair accuracy and margin of the scores of held-out pairs."""
        assert self.val is not None
        batch, pad = held_out_batch(self.cfg, self.val)
        scores = self.group.score_pairs(batch).unpad(pad)
        return pair_means(scores["chosen_scores"], scores["rejected_scores"], "eval/")


def rm(cfg: Config) -> dict[str, float]:
    """Train a reward model with ``cfg``; returns the last step's metrics."""
    return RMTrainer(cfg).fit()
