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

import time

from treadle.config import Config
from treadle.controller import Actors, Placement, start_group
from treadle.tracking import timed
from treadle.trainers.base import Trainer
from treadle.trainers.pairs import held_out_batch, load_pairs, pair_batch, pair_means, pair_sampler
from treadle.workers import RewardTrainerWorker


class RMTrainer(Trainer):
    """Owns the pairs and the reward-model group; ``fit`` runs the loop."""

    headline = "rm/loss"
    algorithm = "reward-model training (Bradley-Terry)"

    def __init__(self, cfg: Config) -> None:
        d = cfg.data  # all data is checked before the run directory is made
        self.train = load_pairs(cfg, d.train_files, "data.train_files")
        self.val = load_pairs(cfg, d.val_files, "data.val_files") if d.val_files else None
        super().__init__(cfg)
        sampler, self.steps_per_epoch, self.total = pair_sampler(cfg, self.train)
        self.start_workers(sampler, with_ref=False)

    def build_workers(self, start_path: str, with_ref: bool, placement: Placement) -> Actors:
        kwargs = {"model_path": start_path}
        return start_group(self.cfg, placement, RewardTrainerWorker, kwargs)

    def run_step(self, step: int) -> dict[str, float]:
        m: dict[str, float] = {}
        start = time.perf_counter()
        batch = pair_batch(self.train, self.sampler.next_indices())
        with timed(m, "update_rm"):
            m.update(self.group.train_rm(batch))
        m["timing/step"] = time.perf_counter() - start
        m["epoch"] = step / self.steps_per_epoch
        if self.val is not None and self.eval_due(step):
            with timed(m, "eval"):
                batch, pad = held_out_batch(self.cfg, self.val)
                scores = self.group.score_pairs(batch).unpad(pad)
                m.update(pair_means(scores["chosen_scores"], scores["rejected_scores"], "eval/"))
        return m


def rm(cfg: Config) -> dict[str, float]:
    """Train a reward model with ``cfg``; returns the last step's metrics."""
    return RMTrainer(cfg).fit()
