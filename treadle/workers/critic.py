"""The critic's worker: PPO's value model, regressed on the returns.

The critic is a value model (``*ForTokenClassification``, one label) run through
:class:`~treadle.engines.value.ValueHead`, its own worker group (its own process group),
colocated on the actor's bundles by default or on a pool of its own
(``critic.placement=split``); the driver calls the groups in turn.

=================  ======================================  ==================================
method             reads                                   adds / returns
=================  ======================================  ==================================
compute_values     prompts, prompt_mask, responses,        values (0 where the mask is 0)
                   response_mask
update_critic      (same) + values, returns                metrics critic/* (mean of ranks)
=================  ======================================  ==================================
"""

from __future__ import annotations

import torch

from treadle.algorithms import Aggregation, value_loss
from treadle.controller import Collect, Dispatch, register
from treadle.engines.schedule import LrSchedule
from treadle.protocol import Batch
from treadle.runtime.memory import release_heap
from treadle.workers.base import TrainingWorker
from treadle.workers.common import (
    ATTENTION,
    SEQUENCES,
    global_sums,
    mean_over_steps,
    ppo_mini_batches,
    ppo_steps,
    prompt_response,
    value_engine,
)


class CriticWorker(TrainingWorker):
    """PPO's critic: a value model (FSDP2, its own AdamW) regressed on the returns.

    ``values[b, t]`` is V(state before response token t), the baseline of that token's action.
    The update is PPO's clipped value loss (``critic.cliprange_value``), token-mean over the
    mini-batch across ranks, in mini-batches (one optimizer step each) and micro-batches.
    """

    role = "critic"
    parallel_section = "critic"

    def setup(self, *, critic_path: str) -> None:
        config, world_size = self.cfg, self.layout.dp  # the data-parallel ranks
        a, c = config.actor, config.critic
        self.c = c
        self.epochs = c.ppo_epochs or a.ppo_epochs
        mini = c.ppo_mini_batch_size or a.ppo_mini_batch_size
        self.mini = mini // world_size
        self.micro = c.micro_batch_size or a.micro_batch_size
        self.tokenizer = self.load_tokenizer()
        self.engine = value_engine(
            config,
            critic_path,
            "critic.model_path",
            trainable=True,
            lr=c.lr,
            weight_decay=c.weight_decay,
            # every RL step trains the critic (its warm-up steps too)
            schedule=LrSchedule(
                0,
                c.lr_schedule,
                c.min_lr_ratio,
                config.trainer.total_steps * ppo_steps(config, self.epochs, mini, world_size),
            ),
            grad_clip=c.grad_clip,
            meshes=self.meshes,
            section="critic",
        )
        self.dp_group = self.meshes.dp_group if self.meshes is not None else None
        self.engine.offload()  # (actor.offload_params: until its first values)

    def _values(self, mb: Batch) -> torch.Tensor:
        ids, mask = prompt_response(mb, self.device)
        values: torch.Tensor = self.engine.loaded()(ids, mask, mb["responses"].shape[1])
        return values  # 0 on padding (ValueHead)

    @register(Dispatch.DP, Collect.CONCAT, reads=SEQUENCES, optional=ATTENTION, returns=("values",))
    def compute_values(self, batch: Batch) -> Batch:
        with torch.no_grad():
            parts = [self._values(mb).cpu() for mb in batch.split(self.micro)]
        self.engine.offload()  # (actor.offload_params: until the update)
        return Batch.from_dict(tensors={"values": torch.cat(parts)})

    @register(
        Dispatch.DP, Collect.MEAN, reads=(*SEQUENCES, "values", "returns"), optional=ATTENTION
    )
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """PPO value-function update; metrics averaged over optimizer steps, then over ranks."""
        minis = ppo_mini_batches(batch, self.epochs, self.mini)
        metrics = mean_over_steps(self._critic_step, minis) | self._data_metrics(batch)
        release_heap()  # (treadle.runtime.memory)
        self.engine.offload()  # (actor.offload_params: until the next step's values)
        return metrics

    def _critic_step(self, mb: Batch) -> dict[str, float]:
        """One optimizer step over a mini-batch, gradients accumulated over micro-batches."""
        local = float(mb["response_mask"].sum())
        # Global counts make the micro-batch losses (averaged over ranks) the mini-batch loss.
        (tokens,) = global_sums(local, group=self.dp_group)
        agg = {"num_tokens": max(tokens / self.layout.dp, 1.0)}
        out = self.engine.train_step(
            mb.split(self.micro), lambda m: self._critic_loss(m, agg), prefix="critic/"
        )
        out["critic/vf_clipfrac"] /= max(local, 1.0)  # clipped tokens / the rank's tokens
        return out

    def _critic_loss(
        self, micro: Batch, agg: dict[str, float]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        values = self._values(micro)
        mask = micro["response_mask"].to(values)
        loss, clipfrac = value_loss(
            values,
            micro["values"].to(values),
            micro["returns"].to(values),
            mask,
            self.c.cliprange_value,
            Aggregation(num_tokens=agg["num_tokens"]),
        )
        clipped = clipfrac * float(mask.sum())
        return loss, {"critic/vf_loss": float(loss.detach()), "critic/vf_clipfrac": clipped}

    def _data_metrics(self, batch: Batch) -> dict[str, float]:
        """Values and returns of the whole batch (before the update), exact over all ranks."""
        mask = batch["response_mask"].bool()
        v, r = batch["values"][mask].double(), batch["returns"][mask].double()
        n, sv, sr, sr2, sd, sd2 = global_sums(
            float(mask.sum()),
            float(v.sum()),
            float(r.sum()),
            float((r * r).sum()),
            float((r - v).sum()),
            float(((r - v) ** 2).sum()),
            group=self.dp_group,
        )
        n = max(n, 1.0)
        var_r, var_d = sr2 / n - (sr / n) ** 2, sd2 / n - (sd / n) ** 2
        return {
            "critic/values_mean": sv / n,
            "critic/returns_mean": sr / n,
            # 1 - Var(R - V) / Var(R): 1 is a perfect critic, 0 no better than the mean
            "critic/vf_explained_var": 1.0 - var_d / var_r if var_r > 1e-12 else 0.0,
        }
