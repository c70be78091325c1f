"""Role workers: SPMD programs over the engines, one class per colocated set of roles.

:class:`ActorRolloutRefWorker` fuses three roles in one process, as verl's hybrid engine does:
the actor (FSDP2 training engine), its rollout engine (a private inference copy, refreshed
from the actor after every update) and the reference (frozen initial weights, FSDP2 too).
Each public method is declared with its dispatch mode; the driver calls the group, never a
rank. The worker knows how to compute a phase, not in which order phases run.

Batch fields each method reads and adds (see :mod:`treadle.protocol` for the table):

=====================  ======================================  ==================================
method                 reads                                   adds / returns
=====================  ======================================  ==================================
generate               prompts, prompt_mask, objects           responses, response_mask,
                                                               rollout_log_probs, response_text,
                                                               stop_reason (n rows per prompt)
compute_log_probs      prompts, prompt_mask, responses,        old_log_probs, entropy
                       response_mask
compute_ref_log_probs  (same)                                  ref_log_probs
update_actor           + old_log_probs, advantages,            metrics (averaged over ranks)
                       ref_log_probs (when kl_coef > 0)
train_sft              input_ids, attention_mask, loss_mask    metrics
compute_pair_log_probs prompts, prompt_mask, chosen,           chosen_logps, rejected_logps [B]
                       chosen_mask, rejected, rejected_mask
compute_ref_pair_...   (same)                                  ref_chosen_logps, ref_rejected_...
train_dpo              (same) + ref_chosen_logps,              metrics (dpo/*)
                       ref_rejected_logps
=====================  ======================================  ==================================

The critic (:class:`CriticWorker`) and the reward model (:class:`RewardModelWorker`) are value
models, each its own worker group; they are at the end of the file with their own table.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from treadle.algorithms import (
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    agg_loss,
    implicit_rewards,
    kl_penalty,
    masked_sum,
    pair_stats,
    value_loss,
)
from treadle.algorithms.utils import mismatch_metrics, mismatch_stats
from treadle.config import Config
from treadle.controller import Collect, Dispatch, Worker, register
from treadle.engines.fsdp import DTYPES, TrainEngine
from treadle.engines.packing import first_fit_decreasing, token_micro_batches
from treadle.engines.rollout import HFRolloutEngine, RolloutEngine, SamplingParams
from treadle.engines.value import ValueHead, last_token_values
from treadle.models import load_causal_lm, load_tokenizer, load_value_model
from treadle.protocol import Batch


def engine_options(cfg: Config) -> dict[str, Any]:
    """How every training engine (actor, reference, critic, reward model) runs its forward:
    packed without padding (``actor.remove_padding``), in ``actor.mixed_precision``."""
    a = cfg.actor
    return {
        "chunk_size": a.logprob_chunk_size,
        "row_tokens": a.pack_row_tokens if a.remove_padding else None,
        "compute_dtype": torch.bfloat16 if a.mixed_precision == "bf16" else None,
    }


def actor_optimizer(cfg: Config) -> dict[str, Any]:
    """The ``actor`` section's optimizer settings (the actor's, and the reward-model trainer's)."""
    a = cfg.actor
    return {
        "lr": a.lr,
        "betas": a.betas,
        "weight_decay": a.weight_decay,
        "warmup_steps": a.warmup_steps,
        "grad_clip": a.grad_clip,
        "gradient_checkpointing": a.gradient_checkpointing,
    }


def global_sums(*values: float) -> list[float]:
    """Each value summed over the ranks of the default process group, in float64."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def _prompt_response(mb: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt then response: token ids and attention mask ``[B, P + R]`` on ``device``."""
    ids = torch.cat([mb["prompts"], mb["responses"]], 1).to(device)
    mask = torch.cat([mb["prompt_mask"], mb["response_mask"]], 1).to(device)
    return ids, mask


def _left_trim(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


def pair_sequences(
    mb: Batch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Preference pairs as ``2B`` sequences: every prompt with its chosen, then with its rejected.

    Returns ``(input_ids [2B, P+R], attention_mask, R, response_mask [2B, R])``.
    """
    prompts = torch.cat([mb["prompts"], mb["prompts"]])
    pmask = torch.cat([mb["prompt_mask"], mb["prompt_mask"]])
    responses = torch.cat([mb["chosen"], mb["rejected"]])
    rmask = torch.cat([mb["chosen_mask"], mb["rejected_mask"]])
    ids = torch.cat([prompts, responses], 1).to(device)
    mask = torch.cat([pmask, rmask], 1).to(device)
    return ids, mask, responses.shape[1], rmask


def _pad_right(rows: list[list[Any]], width: int, value: Any, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


class ActorRolloutRefWorker(Worker):
    """Actor + rollout engine + reference, colocated in one process per rank."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        *,
        config: Config,
        actor_path: str,
        with_ref: bool,
        threads: int = 1,
    ) -> None:
        torch.set_num_threads(threads)
        super().__init__(rank, world_size, master_addr, master_port)
        self.cfg = config
        dtype = DTYPES[config.model.dtype]
        self.tokenizer = load_tokenizer(config.model.tokenizer_path or actor_path)
        self.actor = TrainEngine(
            self._load(actor_path, dtype), **engine_options(config), **actor_optimizer(config)
        )
        self.ref = (
            TrainEngine(
                self._load(config.model.path, dtype), **engine_options(config), trainable=False
            )
            if with_ref
            else None
        )
        self.rollout: RolloutEngine = self._make_rollout(actor_path)

    def _load(self, path: str, dtype: torch.dtype) -> nn.Module:
        model: nn.Module = load_causal_lm(path, dtype)
        return model.to(self.device)

    def _make_rollout(self, path: str) -> RolloutEngine:
        r = self.cfg.rollout
        dtype = r.dtype or self.cfg.model.dtype
        if r.engine == "vllm":
            from treadle.engines.vllm_rollout import VLLMRolloutEngine

            return VLLMRolloutEngine(
                path,
                dtype=dtype,
                seed=self.cfg.trainer.seed,
                max_model_len=self.cfg.data.max_prompt_length + r.max_new_tokens,
                bucket_mb=r.weight_sync_bucket_mb,
                kv_cache_gib=r.kv_cache_gib,
                gpu_memory_utilization=r.gpu_memory_utilization,
            )
        tok = self.tokenizer
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        return HFRolloutEngine(
            self._load(path, DTYPES[dtype]),
            eos_token_ids=eos,
            pad_token_id=pad,
            micro_batch_size=r.micro_batch_size,
        )

    # ------------------------------------------------------------------ rollout

    @register(Dispatch.DP, Collect.CONCAT)
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        params = dataclasses.replace(params, seed=params.seed * 9973 + self.rank)
        self.rollout.wake()
        out = self.rollout.generate(_left_trim(batch["prompts"], batch["prompt_mask"]), params)
        self.rollout.sleep()
        expanded = batch.repeat(params.n, interleave=True)
        width = params.max_new_tokens
        pad = self.tokenizer.pad_token_id or 0
        expanded["responses"] = _pad_right(out.token_ids, width, pad, torch.long)
        expanded["response_mask"] = _pad_right(
            [[1] * len(t) for t in out.token_ids], width, 0, torch.long
        )
        expanded["rollout_log_probs"] = _pad_right(out.log_probs, width, 0.0, torch.float32)
        expanded["response_text"] = self.tokenizer.batch_decode(
            out.token_ids, skip_special_tokens=True
        )
        expanded["stop_reason"] = out.stop_reasons
        return expanded

    @register(Dispatch.ALL, Collect.RANK0)
    def sync_weights(self) -> None:
        """Stream the actor's full weights into this rank's rollout engine, in memory."""
        self.rollout.update_weights(self.actor.full_state())

    # ------------------------------------------------------------------ log-probs

    def _sequences(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor, int]:
        return *_prompt_response(mb, self.device), mb["responses"].shape[1]

    def _micro_batches(
        self, batch: Batch, lengths: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Index groups of ``batch``, one per micro-batch, the same count on every rank.

        By ``actor.max_tokens_per_micro_batch`` (``lengths`` = valid tokens per sample;
        default: prompt + response tokens) when set, else ``actor.micro_batch_size`` samples each.
        """
        a = self.cfg.actor
        if a.max_tokens_per_micro_batch is None:
            return list(torch.arange(len(batch)).split(a.micro_batch_size))
        if lengths is None:
            lengths = batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)
        lens = lengths.tolist()
        need = torch.tensor([len(first_fit_decreasing(lens, a.max_tokens_per_micro_batch))])
        dist.all_reduce(need, op=dist.ReduceOp.MAX)  # FSDP collectives: same count everywhere
        groups = token_micro_batches(lens, a.max_tokens_per_micro_batch, int(need))
        return [torch.tensor(g, dtype=torch.long) for g in groups]

    @torch.no_grad()
    def _log_probs(self, engine: TrainEngine, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        groups = self._micro_batches(batch)
        logps, ents = [], []
        for idx in groups:
            ids, mask, r = self._sequences(batch.select(idx))
            lp, ent = engine.log_probs(ids, mask, r, self.cfg.rollout.temperature)
            logps.append(lp.float().cpu())
            ents.append(ent.float().cpu())
        order = torch.cat(groups).argsort()  # back to the batch's order
        return torch.cat(logps)[order], torch.cat(ents)[order]

    @register(Dispatch.DP, Collect.CONCAT)
    def compute_log_probs(self, batch: Batch) -> Batch:
        logp, ent = self._log_probs(self.actor, batch)
        return Batch.from_dict(tensors={"old_log_probs": logp, "entropy": ent})

    @register(Dispatch.DP, Collect.CONCAT)
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        if self.ref is None:
            raise RuntimeError("this worker group was built without a reference (kl_coef=0)")
        logp, _ = self._log_probs(self.ref, batch)
        return Batch.from_dict(tensors={"ref_log_probs": logp})

    # ------------------------------------------------------------------ training

    def _actor_loss(self, mb: Batch, agg: dict[str, float]) -> tuple[torch.Tensor, dict]:
        alg = self.cfg.algorithm
        ids, mask, r = self._sequences(mb)
        logp, ent = self.actor.log_probs(ids, mask, r, self.cfg.rollout.temperature)
        rmask = mb["response_mask"].to(logp.dtype)
        if "old_log_probs" in mb:
            old = mb["old_log_probs"]
        else:  # on-policy, one optimizer step: this forward is the old policy (see update_actor)
            old = logp.detach()
            self._mismatch.append(
                mismatch_stats(old.cpu(), mb["rollout_log_probs"], mb["response_mask"])
            )
        loss_fn = POLICY_LOSSES.get(alg.policy_loss)
        is_weights = None
        if alg.rollout_is_cap is not None:  # truncated IS: pi_train / pi_rollout, capped
            ratio = torch.exp(old - mb["rollout_log_probs"])
            is_weights = ratio.clamp(max=alg.rollout_is_cap).to(logp.dtype)
        pg_loss, stats = loss_fn(
            logp,
            old,
            mb["advantages"],
            rmask,
            loss_agg_mode=alg.loss_agg_mode,
            clip_ratio_low=alg.clip_ratio_low,
            clip_ratio_high=alg.clip_ratio_high,
            clip_ratio_c=alg.clip_ratio_c,
            rollout_is_weights=is_weights,
            agg_kwargs=agg,
        )
        loss = pg_loss
        metrics = {
            "actor/pg_loss": float(pg_loss.detach()),
            "actor/clip_frac": stats["pg_clipfrac"],
        }
        if alg.kl_coef > 0:
            kl = agg_loss(
                kl_penalty(logp, mb["ref_log_probs"], alg.kl_estimator),
                rmask,
                alg.loss_agg_mode,
                **agg,
            )
            loss = loss + alg.kl_coef * kl
            metrics["actor/kl"] = float(kl.detach())
        entropy = agg_loss(ent, rmask, alg.loss_agg_mode, **agg)
        if alg.entropy_coef:
            loss = loss - alg.entropy_coef * entropy
        metrics["actor/entropy"] = float(entropy.detach())
        return loss, metrics

    @register(Dispatch.DP, Collect.MEAN)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over mini-batches, one optimizer step each; metrics averaged.

        Without ``old_log_probs`` in the batch (the driver skipped that pass: on-policy, one
        optimizer step) each micro-batch's own forward is the old policy, and the rollout
        mismatch is measured here, over every rank's tokens.
        """
        a = self.cfg.actor
        mini = a.ppo_mini_batch_size // self.world_size
        per_step: list[dict[str, float]] = []
        self._mismatch: list[torch.Tensor] = []
        gen = torch.Generator().manual_seed(int(batch.meta.get("step", 0)))
        for _ in range(a.ppo_epochs):
            shuffled = batch.select(torch.randperm(len(batch), generator=gen))
            for mb in shuffled.split(mini):
                per_step.append(self._actor_step(mb))
        metrics = {k: sum(m[k] for m in per_step) / len(per_step) for k in per_step[0]}
        if "old_log_probs" not in batch:
            stats = torch.stack(self._mismatch)
            sums, top = stats[:, :3].sum(0), stats[:, 3].max().reshape(1)
            dist.all_reduce(sums)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            metrics.update(mismatch_metrics(torch.cat([sums, top])))
        return metrics

    def _actor_step(self, mb: Batch) -> dict[str, float]:
        """One optimizer step over a mini-batch, in micro-batches with accumulated gradients."""
        # Global counts make the micro-batch losses (summed over ranks) the mini-batch loss.
        tokens = global_sums(float(mb["response_mask"].sum()))[0] / self.world_size
        agg = {"num_tokens": max(tokens, 1.0), "num_seqs": float(len(mb))}
        micros = [mb.select(idx) for idx in self._micro_batches(mb)]
        sums: dict[str, float] = defaultdict(float)
        for i, micro in enumerate(micros):
            self.actor.module.set_requires_gradient_sync(i == len(micros) - 1)
            loss, m = self._actor_loss(micro, agg)
            loss.backward()
            for k, v in m.items():
                sums[k] += v
        sums["actor/clip_frac"] /= len(micros)
        sums.update({f"actor/{k}": v for k, v in self.actor.step().items()})
        return dict(sums)

    @register(Dispatch.DP, Collect.MEAN)
    def train_sft(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of next-token loss on response tokens (token-mean over ranks)."""
        tokens = global_sums(float(batch["loss_mask"][:, 1:].sum()))[0] / self.world_size
        groups = self._micro_batches(batch, batch["attention_mask"].sum(1))
        loss_sum = 0.0
        for i, idx in enumerate(groups):
            mb = batch.select(idx)
            self.actor.module.set_requires_gradient_sync(i == len(groups) - 1)
            ids = mb["input_ids"].to(self.device)
            mask = mb["attention_mask"].to(self.device)
            lmask = mb["loss_mask"][:, 1:].to(self.device)
            # Log-probs of loss positions only: no LM-head compute on the prompts.
            logp, _ = self.actor.log_probs(ids, mask, ids.shape[1] - 1, label_mask=lmask)
            lmask = lmask.to(logp.dtype)
            loss = agg_loss(-logp, lmask, "token-mean", num_tokens=max(tokens, 1.0))
            loss.backward()
            loss_sum += float(loss.detach())
        stats = self.actor.step()
        return {"sft/loss": loss_sum, "sft/grad_norm": stats["grad_norm"], "sft/lr": stats["lr"]}

    # ------------------------------------------------------------------ preference pairs (DPO)

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

    @register(Dispatch.DP, Collect.CONCAT)
    def compute_pair_log_probs(self, batch: Batch) -> Batch:
        """The policy's ``chosen_logps``, ``rejected_logps`` ``[B]`` of preference pairs."""
        return self._pair_logps_all(self.actor, batch, "")

    @register(Dispatch.DP, Collect.CONCAT)
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

    @register(Dispatch.DP, Collect.MEAN)
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
        sums: dict[str, float] = defaultdict(float)
        for i, mb in enumerate(micros):
            self.actor.module.set_requires_gradient_sync(i == len(micros) - 1)
            loss, stats = self._dpo_loss(mb, pairs, max(tokens, 1.0))
            loss.backward()
            for k, v in stats.items():
                sums[k] += v
        step = self.actor.step()
        return {**sums, "dpo/grad_norm": step["grad_norm"], "dpo/lr": step["lr"]}

    # ------------------------------------------------------------------ checkpoints

    @register(Dispatch.ALL, Collect.RANK0)
    def save_checkpoint(self, path: str, with_optimizer: bool = True) -> None:
        """Model as an HF safetensors folder (rank 0), optimizer gathered, RNG per rank."""
        self.actor.save_checkpoint(Path(path), self.rank, self.tokenizer, with_optimizer)

    @register(Dispatch.ALL, Collect.RANK0)
    def load_checkpoint(self, path: str) -> None:
        """Optimizer and RNG; the model weights were loaded at start from ``path/model``."""
        self.actor.load_checkpoint(Path(path), self.rank)


# ---------------------------------------------------------------------------------- value roles
#
# The critic and the reward model are value models (``*ForTokenClassification``, one label) run
# through :class:`ValueHead`. Each is its own worker group (its own process group), colocated
# on the actor's bundles by default; the driver calls the groups in turn.
#
# =====================  ======================================  ==================================
# method                 reads                                   adds / returns
# =====================  ======================================  ==================================
# compute_values         prompts, prompt_mask, responses,        values (0 where the mask is 0)
#                        response_mask
# update_critic          + values, returns                       metrics critic/* (mean of ranks)
# compute_rm_scores      (as compute_values)                     rm_scores [B]
# =====================  ======================================  ==================================


def value_engine(
    cfg: Config, path: str, key: str, device: torch.device, trainable: bool, **opt: Any
) -> TrainEngine:
    """A value model (critic, reward model) as a training engine; ``opt``: optimizer settings."""
    model: nn.Module = load_value_model(path, DTYPES[cfg.model.dtype], key=key)
    return TrainEngine(
        model.to(device), **engine_options(cfg), trainable=trainable, head=ValueHead, **opt
    )


class CriticWorker(Worker):
    """PPO's critic: a value model (FSDP2, its own AdamW) regressed on the returns.

    ``values[b, t]`` is V(state before response token t), the baseline of that token's action.
    The update is PPO's clipped value loss (``critic.cliprange_value``), token-mean over the
    mini-batch across ranks, in mini-batches (one optimizer step each) and micro-batches.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        *,
        config: Config,
        critic_path: str,
        threads: int = 1,
    ) -> None:
        torch.set_num_threads(threads)
        super().__init__(rank, world_size, master_addr, master_port)
        a, c = config.actor, config.critic
        self.c = c
        self.epochs = c.ppo_epochs or a.ppo_epochs
        self.mini = (c.ppo_mini_batch_size or a.ppo_mini_batch_size) // world_size
        self.micro = c.micro_batch_size or a.micro_batch_size
        self.tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path)
        self.engine = value_engine(
            config,
            critic_path,
            "critic.model_path",
            self.device,
            trainable=True,
            lr=c.lr,
            weight_decay=c.weight_decay,
            grad_clip=c.grad_clip,
        )

    def _values(self, mb: Batch) -> torch.Tensor:
        ids, mask = _prompt_response(mb, self.device)
        values: torch.Tensor = self.engine.module(ids, mask, mb["responses"].shape[1])
        return values  # 0 on padding (ValueHead)

    @register(Dispatch.DP, Collect.CONCAT)
    def compute_values(self, batch: Batch) -> Batch:
        with torch.no_grad():
            parts = [self._values(mb).cpu() for mb in batch.split(self.micro)]
        return Batch.from_dict(tensors={"values": torch.cat(parts)})

    @register(Dispatch.DP, Collect.MEAN)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """PPO value-function update; metrics averaged over optimizer steps, then over ranks."""
        gen = torch.Generator().manual_seed(int(batch.meta.get("step", 0)))
        per_step = []
        for _ in range(self.epochs):
            shuffled = batch.select(torch.randperm(len(batch), generator=gen))
            per_step += [self._critic_step(mb) for mb in shuffled.split(self.mini)]
        out = {k: sum(m[k] for m in per_step) / len(per_step) for k in per_step[0]}
        return out | self._data_metrics(batch)

    def _critic_step(self, mb: Batch) -> dict[str, float]:
        """One optimizer step over a mini-batch, gradients accumulated over micro-batches."""
        local = float(mb["response_mask"].sum())
        # Global counts make the micro-batch losses (averaged over ranks) the mini-batch loss.
        (tokens,) = global_sums(local)
        agg = {"num_tokens": max(tokens / self.world_size, 1.0)}
        micros = mb.split(self.micro)
        loss_sum = clipped = 0.0
        for i, micro in enumerate(micros):
            self.engine.module.set_requires_gradient_sync(i == len(micros) - 1)
            values = self._values(micro)
            mask = micro["response_mask"].to(values)
            loss, clipfrac = value_loss(
                values,
                micro["values"].to(values),
                micro["returns"].to(values),
                mask,
                self.c.cliprange_value,
                agg_kwargs=agg,
            )
            loss.backward()
            loss_sum += float(loss.detach())
            clipped += clipfrac * float(mask.sum())
        stats = self.engine.step()
        return {
            "critic/vf_loss": loss_sum,
            "critic/vf_clipfrac": clipped / max(local, 1.0),
            "critic/grad_norm": stats["grad_norm"],
            "critic/lr": stats["lr"],
        }

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
        )
        n = max(n, 1.0)
        var_r, var_d = sr2 / n - (sr / n) ** 2, sd2 / n - (sd / n) ** 2
        return {
            "critic/values_mean": sv / n,
            "critic/returns_mean": sr / n,
            # 1 - Var(R - V) / Var(R): 1 is a perfect critic, 0 no better than the mean
            "critic/vf_explained_var": 1.0 - var_d / var_r if var_r > 1e-12 else 0.0,
        }

    @register(Dispatch.ALL, Collect.RANK0)
    def save_checkpoint(self, path: str) -> None:
        """Value-model folder ``path/model`` (rank 0), optimizer gathered, RNG per rank."""
        self.engine.save_checkpoint(Path(path), self.rank, self.tokenizer)

    @register(Dispatch.ALL, Collect.RANK0)
    def load_checkpoint(self, path: str) -> None:
        """Optimizer and RNG; the weights were loaded at start from ``path/model``."""
        self.engine.load_checkpoint(Path(path), self.rank)


class RewardModelWorker(Worker):
    """A frozen reward model: the score of each prompt+response, read at its last valid token."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        *,
        config: Config,
        threads: int = 1,
    ) -> None:
        torch.set_num_threads(threads)
        super().__init__(rank, world_size, master_addr, master_port)
        self.cfg = config
        path = config.reward.model_path or ""
        self.engine = value_engine(config, path, "reward.model_path", self.device, False)

    @register(Dispatch.DP, Collect.CONCAT)
    def compute_rm_scores(self, batch: Batch) -> Batch:
        scores = []
        with torch.no_grad():
            for mb in batch.split(self.cfg.reward.micro_batch_size):
                ids, mask = _prompt_response(mb, self.device)
                scores.append(last_token_values(self.engine.module, ids, mask).cpu())
        return Batch.from_dict(tensors={"rm_scores": torch.cat(scores)})
