"""Preference-pair methods of the actor's worker: DPO's log-probs and update.

:class:`PreferenceMixin` is part of :class:`~treadle.workers.actor.ActorRolloutRefWorker`: it
trains the same actor engine against the same reference, so it shares their processes. A pair
is laid out as two sequences, the prompt with its chosen and with its rejected response
(:func:`~treadle.workers.common.pair_sequences`), scored in one forward.

======================  ======================================  ==================================
method                  reads                                   adds / returns
======================  ======================================  ==================================
compute_pair_log_probs  prompts, prompt_mask, chosen,           chosen_logps, rejected_logps [B]
                        chosen_mask, rejected, rejected_mask
compute_ref_pair_...    (same)                                  ref_chosen_logps, ref_rejected_...
train_dpo               (same) + ref_chosen_logps,              metrics (dpo/*)
                        ref_rejected_logps
======================  ======================================  ==================================
"""

from __future__ import annotations

import torch

from treadle.algorithms import PREFERENCE_LOSSES, implicit_rewards, masked_sum, pair_stats
from treadle.config import Config
from treadle.controller import Collect, Dispatch, register
from treadle.engines.fsdp import TrainEngine
from treadle.protocol import Batch
from treadle.workers.common import PAIRS, global_sums, pair_sequences


class PreferenceMixin:
    """DPO on the actor's engines; the worker class provides the attributes declared here."""

    cfg: Config
    device: torch.device
    world_size: int
    actor: TrainEngine
    ref: TrainEngine | None

    def _pair_logps(self, engine: TrainEngine, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence log-probs (summed over response tokens) of chosen and rejected, one forward."""
        ids, mask, width, rmask = pair_sequences(mb, self.device)
        logp, _ = engine.log_probs(ids, mask, width)  # temperature 1: the model's own policy
        seq = masked_sum(logp, rmask.to(logp.device), dim=-1).float()
        return seq[: len(mb)], seq[len(mb) :]

    @torch.no_grad()
    def _pair_logps_all(self, engine: TrainEngine, batch: Batch, prefix: str) -> Batch:
        chosen, rejected = [], []
        for mb in batch.split(self.cfg.actor.micro_batch_size):
            c, r = self._pair_logps(engine, mb)
            chosen.append(c.cpu())
            rejected.append(r.cpu())
        return Batch.from_dict(
            tensors={
                f"{prefix}chosen_logps": torch.cat(chosen),
                f"{prefix}rejected_logps": torch.cat(rejected),
            }
        )

    @register(Dispatch.DP, Collect.CONCAT, reads=PAIRS, returns=("chosen_logps", "rejected_logps"))
    def compute_pair_log_probs(self, batch: Batch) -> Batch:
        """The policy's ``chosen_logps``, ``rejected_logps`` ``[B]`` of preference pairs."""
        return self._pair_logps_all(self.actor, batch, "")

    @register(
        Dispatch.DP,
        Collect.CONCAT,
        reads=PAIRS,
        returns=("ref_chosen_logps", "ref_rejected_logps"),
    )
    def compute_ref_pair_log_probs(self, batch: Batch) -> Batch:
        """The reference's ``ref_chosen_logps``, ``ref_rejected_logps`` ``[B]``."""
        if self.ref is None:
            raise RuntimeError("this worker group was built without a reference")
        return self._pair_logps_all(self.ref, batch, "ref_")

    def _dpo_loss(self, mb: Batch, pairs: float, tokens: float) -> tuple[torch.Tensor, dict]:
        """A micro-batch's share of the batch loss, and its metrics (to be summed)."""
        d = self.cfg.dpo
        chosen, rejected = self._pair_logps(self.actor, mb)
        ref_c = mb["ref_chosen_logps"].to(chosen.device)
        ref_r = mb["ref_rejected_logps"].to(chosen.device)
        loss_fn = PREFERENCE_LOSSES.get(d.loss_type)
        losses = loss_fn(
            chosen, rejected, ref_c, ref_r, beta=d.beta, label_smoothing=d.label_smoothing
        )
        nll = -chosen.sum() / tokens  # the chosen responses' token-mean NLL (RPO's SFT term)
        loss = losses.sum() / pairs + (d.nll_coef * nll if d.nll_coef else 0.0)
        rewards = pair_stats(
            implicit_rewards(chosen.detach(), ref_c, d.beta),
            implicit_rewards(rejected.detach(), ref_r, d.beta),
        )
        stats = {
            "dpo/loss": float(losses.detach().sum()),
            "dpo/reward_accuracy": rewards["accuracy"],
            "dpo/margin": rewards["margin"],
            "dpo/chosen_reward": rewards["chosen"],
            "dpo/rejected_reward": rewards["rejected"],
            "dpo/chosen_logp": float(chosen.detach().sum()),
            "dpo/rejected_logp": float(rejected.detach().sum()),
        }
        stats = {k: v / pairs for k, v in stats.items()}
        stats["dpo/nll"] = float(nll.detach())
        return loss, stats

    @register(Dispatch.DP, Collect.MEAN, reads=(*PAIRS, "ref_chosen_logps", "ref_rejected_logps"))
    def train_dpo(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of a preference loss over the batch's pairs (pair-mean).

        Reads the pairs and their reference log-probs; ``actor.micro_batch_size`` pairs (twice
        as many sequences) per forward. Losses and metrics are divided by the pairs (chosen
        tokens, for the NLL term) of all ranks, so the sum over micro-batches and the mean
        over ranks are the batch means.
        """
        pairs, tokens = (
            x / self.world_size for x in global_sums(len(batch), float(batch["chosen_mask"].sum()))
        )
        micros = batch.split(self.cfg.actor.micro_batch_size)
        tokens = max(tokens, 1.0)
        return self.actor.train_step(
            micros, lambda mb: self._dpo_loss(mb, pairs, tokens), prefix="dpo/"
        )
