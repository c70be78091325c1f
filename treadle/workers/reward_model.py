"""The reward model's workers: a frozen scorer for RL, and the trainer that makes one.

A reward model is a value model (``*ForTokenClassification``, one label) held by one FSDP2
:class:`~treadle.engines.fsdp.TrainEngine`. A response's score is the value at the last valid
token of prompt + response (its EOS), :func:`~treadle.engines.value.last_token_values`: the
trainer and the RL role read the same number from the same saved folder.

- :class:`RewardModelWorker` scores RL rollouts (``reward.model_path``), frozen, its own
  worker group colocated on the actor's bundles.
- :class:`RewardTrainerWorker` learns a Bradley-Terry score on preference pairs (``treadle
  rm``); from a causal LM folder its head starts at zero, so every pair starts tied. Its
  checkpoints hold ``model/`` as a value-model folder (what ``final_model`` becomes), the
  optimizer and the RNG state, as the actor's do.

=================  =============================================  ===========================
method             reads                                          returns
=================  =============================================  ===========================
compute_rm_scores  prompts, prompt_mask, responses,               rm_scores [B]
                   response_mask
train_rm           prompts, prompt_mask, chosen, chosen_mask,     metrics (rm/*), one optimizer
                   rejected, rejected_mask                        step over the batch
score_pairs        (same)                                         chosen_scores, rejected_scores
save_checkpoint    a directory                                    value-model folder + optimizer
=================  =============================================  ===========================
"""

from __future__ import annotations

import torch

from treadle.algorithms import bradley_terry_loss, pair_stats
from treadle.controller import Collect, Dispatch, register
from treadle.engines.value import last_token_values
from treadle.protocol import Batch
from treadle.runtime.errors import ConfigError
from treadle.workers.base import RoleWorker, TrainingWorker
from treadle.workers.common import (
    ATTENTION,
    PAIRS,
    SEQUENCES,
    actor_optimizer,
    global_sums,
    pair_sequences,
    per_pair,
    prompt_response,
    value_engine,
)


class RewardModelWorker(RoleWorker):
    """A frozen reward model: the score of each prompt+response, read at its last valid token."""

    role = "reward model"

    def setup(self) -> None:
        config = self.cfg
        path = config.reward.model_path or ""
        self.engine = value_engine(config, path, "reward.model_path", False)
        self.engine.offload()  # (actor.offload_params: until its first scores)

    @register(
        Dispatch.DP, Collect.CONCAT, reads=SEQUENCES, optional=ATTENTION, returns=("rm_scores",)
    )
    def compute_rm_scores(self, batch: Batch) -> Batch:
        scores = []
        with torch.no_grad():
            for mb in batch.split(self.cfg.reward.micro_batch_size):
                ids, mask = prompt_response(mb, self.device)
                scores.append(last_token_values(self.engine.loaded(), ids, mask).cpu())
        self.engine.offload()  # (actor.offload_params: until the next step's scores)
        return Batch.from_dict(tensors={"rm_scores": torch.cat(scores)})


class RewardTrainerWorker(TrainingWorker):
    """A value model trained as a reward model; optimizer settings from the ``actor`` section."""

    role = "reward model"

    def setup(self, *, model_path: str, optimizer_steps: int = 0) -> None:
        """``optimizer_steps``: the run's (one a step), where a decaying lr schedule ends."""
        config = self.cfg
        if config.actor.lora.rank:
            raise ConfigError(
                f"actor.lora.rank={config.actor.lora.rank}: treadle rm trains the whole reward "
                "model (LoRA is for the actor of train, sft and dpo); set actor.lora.rank=0"
            )
        a = config.actor
        if a.tensor_parallel_size * a.sequence_parallel_size > 1:
            raise ConfigError(
                "treadle rm trains data-parallel only: set actor.tensor_parallel_size=1 and "
                "actor.sequence_parallel_size=1"
            )
        self.tokenizer = self.load_tokenizer(model_path)
        opt = actor_optimizer(config, optimizer_steps)
        self.engine = value_engine(config, model_path, "model.path", True, **opt)

    def _scores(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask, _, _ = pair_sequences(mb, self.device)
        scores = last_token_values(self.engine.loaded(), ids, mask)
        return scores[: len(mb)], scores[len(mb) :]

    @register(Dispatch.DP, Collect.MEAN, reads=PAIRS)
    def train_rm(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the Bradley-Terry loss, pair-mean over micro-batches and ranks."""
        per_rank = global_sums(len(batch))[0] / self.world_size
        micros = batch.split(self.cfg.actor.micro_batch_size)
        return self.engine.train_step(micros, lambda mb: self._rm_loss(mb, per_rank), "rm/")

    def _rm_loss(self, mb: Batch, per_rank: float) -> tuple[torch.Tensor, dict[str, float]]:
        """A micro-batch's share of the pair-mean loss, and its metrics (to be summed)."""
        chosen, rejected = self._scores(mb)
        losses = bradley_terry_loss(chosen, rejected)
        pair = pair_stats(chosen, rejected)
        stats = {
            "rm/loss": float(losses.detach().sum()),
            "rm/accuracy": pair["accuracy"],
            "rm/margin": pair["margin"],
            "rm/chosen_score": pair["chosen"],
            "rm/rejected_score": pair["rejected"],
        }
        return losses.sum() / per_rank, {k: v / per_rank for k, v in stats.items()}

    @register(
        Dispatch.DP, Collect.CONCAT, reads=PAIRS, returns=("chosen_scores", "rejected_scores")
    )
    @torch.no_grad()
    def score_pairs(self, batch: Batch) -> Batch:
        """``chosen_scores``, ``rejected_scores`` ``[B]``."""
        chosen, rejected = per_pair(batch, self.cfg.actor.micro_batch_size, self._scores)
        return Batch.from_dict(tensors={"chosen_scores": chosen, "rejected_scores": rejected})
