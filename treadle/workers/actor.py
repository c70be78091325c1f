"""The actor's worker: actor, rollout engine and reference, colocated in one process per rank.

:class:`ActorRolloutRefWorker` fuses three roles in one process, as verl's hybrid engine does:
the actor (FSDP2 training engine), its rollout engine (a private inference copy, refreshed
from the actor after every update) and the reference (frozen initial weights, FSDP2 too).
Each public method is declared with its dispatch mode and the batch fields it reads; only
those fields cross to the ranks. The driver calls the group, never a rank. The worker knows
how to compute a phase, not in which order phases run. SFT and preference-pair (DPO) training
use the same engines and live beside it (:mod:`treadle.workers.preference`).

Batch fields each method reads and adds (see :mod:`treadle.protocol` for the table):

=====================  ======================================  ==================================
method                 reads                                   adds / returns
=====================  ======================================  ==================================
generate               prompts, prompt_mask; uid,              the input fields, n rows per
                       prompt_text, ground_truth if present    prompt, + responses,
                                                               response_mask, rollout_log_probs,
                                                               response_text, stop_reason
compute_log_probs      prompts, prompt_mask, responses,        old_log_probs, entropy
                       response_mask                           (+ sum_pi_squared: meta asks)
compute_ref_log_probs  (same)                                  ref_log_probs
update_actor           (same) + advantages; old_log_probs,     metrics actor/* (mean of ranks)
                       ref_log_probs, rollout_log_probs if
                       present
train_sft              input_ids, attention_mask, loss_mask    metrics sft/*
=====================  ======================================  ==================================
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from treadle.algorithms import KL_ESTIMATORS, POLICY_LOSSES, agg_loss, kl_penalty
from treadle.algorithms.correction import rollout_correction
from treadle.algorithms.inputs import Aggregation, PolicyLossInputs
from treadle.algorithms.utils import mismatch_metrics, mismatch_stats
from treadle.checkpoint import read_state
from treadle.config import Config
from treadle.controller import Collect, Dispatch, Worker, free_port, register
from treadle.engines.fsdp import DTYPES, TrainEngine
from treadle.engines.weights import weight_buckets
from treadle.models import apply_lora, load_causal_lm, load_tokenizer
from treadle.protocol import Batch
from treadle.rollout.replica import ServesRollout, make_engine
from treadle.rollout.server import RolloutServer
from treadle.rollout.weight_sync import WeightSyncGroup
from treadle.startup import PartTimer
from treadle.workers.common import (
    ATTENTION,
    SEQUENCES,
    actor_optimizer,
    engine_options,
    global_sums,
    mean_over_steps,
    micro_batches,
    ppo_mini_batches,
    prompt_response,
)
from treadle.workers.preference import PreferenceMixin


class ActorRolloutRefWorker(ServesRollout, PreferenceMixin, Worker):
    """Actor + rollout engine + reference, colocated in one process per rank."""

    role = "actor"

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
        version: int = 0,
        threads: int = 1,
    ) -> None:
        torch.set_num_threads(threads)
        timer = PartTimer()
        super().__init__(rank, world_size, master_addr, master_port)
        self.cfg = config
        dtype = DTYPES[config.model.dtype]
        self.tokenizer = load_tokenizer(
            config.model.tokenizer_path or actor_path, allow_download=config.model.allow_download
        )
        timer.done("process_group")
        lm = self._load(actor_path, dtype)
        lora = config.actor.lora
        if lora.rank:  # actor_path is the base model; a checkpoint's adapters come in resume
            lm = apply_lora(lm, lora, config.model.path, config.trainer.seed)
        self.actor = TrainEngine(lm, **engine_options(config), **actor_optimizer(config))
        timer.done("actor_model")
        self.ref: TrainEngine | None = None
        if with_ref and lora.rank:  # the base model: the actor with its adapters disabled
            self.ref = self.actor.without_adapters()
        elif with_ref:
            self.ref = TrainEngine(
                self._load(config.model.path, dtype), **engine_options(config), trainable=False
            )
        timer.done("reference_model")
        # Colocated rollout: this rank's replica, served from this process (rollout_generate).
        self.server = (
            RolloutServer(
                make_engine(config, actor_path, self.device),
                f"rollout replica {rank} (actor rank {rank})",
                index=rank,
                sleep_when_idle=self.device.type == "cuda",
                version=version,
            )
            if config.rollout.placement == "colocated"
            else None
        )
        timer.done("rollout_engine")
        self._startup_parts = timer.parts
        self.weight_sync: WeightSyncGroup | None = None  # split: rank 0 -> the replicas

    def _load(self, path: str, dtype: torch.dtype) -> nn.Module:
        model: nn.Module = load_causal_lm(path, dtype, allow_download=self.cfg.model.allow_download)
        return model.to(self.device)

    # ------------------------------------------------------------------ rollout
    #
    # The rollout side of this worker: serving requests from the colocated replica
    # (``rollout_generate``, from ServesRollout) and sending the actor's weights to the
    # replicas, in memory (colocated) or over the weight-sync group (split).

    @register(Dispatch.ALL, Collect.RANK0)
    def sync_weights(self, version: int) -> int:
        """The actor's full weights to the rollout as ``version``; returns the bytes moved.

        Every rank walks the full tensors (gathering one is a collective). Colocated: each
        rank loads them into its own replica. Split: rank 0 broadcasts them in buckets."""
        r = self.cfg.rollout
        dtype = DTYPES[r.dtype or self.cfg.model.dtype]
        tied = bool(getattr(self.actor.module.lm.config, "tie_word_embeddings", False))
        skip = frozenset({"lm_head.weight"} if tied else ())
        bucket = max(1, int(r.weight_sync_bucket_mb * (1 << 20)))
        buckets = weight_buckets(self.actor.full_state(), bucket, dtype, skip)
        if self.server is not None:
            sent = 0

            def counted() -> Iterator[bytes]:
                nonlocal sent
                for payload in buckets:
                    sent += len(payload)
                    yield payload

            self.server.update_weights(lambda engine: engine.load_payloads(counted()), version)
            return sent
        if self.weight_sync is not None:
            return self.weight_sync.send(buckets)
        for _ in self.actor.full_state():  # ranks > 0 of split: join the gathers only
            pass
        return 0

    @register(Dispatch.ALL, Collect.RANK0)
    def weight_sync_address(self) -> tuple[str, int]:
        """Where rank 0 will listen for the weight-sync group: its node's address, a free port."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    @register(Dispatch.ALL, Collect.RANK0)
    def init_weight_sync(self, addr: str, port: int, world_size: int) -> None:
        """Rank 0 joins the weight-sync group as its rank 0 (the replicas join as 1..R)."""
        if self.rank == 0:
            self.weight_sync = WeightSyncGroup(addr, port, 0, world_size)

    # ------------------------------------------------------------------ log-probs

    def _sequences(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor, int]:
        return *prompt_response(mb, self.device), mb["responses"].shape[1]

    @torch.no_grad()
    def _log_probs(
        self, engine: TrainEngine, batch: Batch, sum_pi_squared: bool = False
    ) -> list[torch.Tensor]:
        """``[log-probs, entropy]`` of the response tokens, ``+ [Σ_v π(v)²]`` if asked."""
        groups = micro_batches(batch, self.cfg.actor)
        parts: list[list[torch.Tensor]] = []
        with engine.evaluating():  # the policy itself, without dropout noise
            for idx in groups:
                ids, mask, r = self._sequences(batch.select(idx))
                t = self.cfg.rollout.temperature
                out = (
                    engine.token_stats(ids, mask, r, t)
                    if sum_pi_squared
                    else engine.log_probs(ids, mask, r, t)
                )
                parts.append([x.float().cpu() for x in out])
        order = torch.cat(groups).argsort()  # back to the batch's order
        return [torch.cat(column)[order] for column in zip(*parts, strict=True)]

    @register(
        Dispatch.DP,
        Collect.CONCAT,
        reads=SEQUENCES,
        optional=(*ATTENTION, "sum_pi_squared"),  # returned when meta asks for it
        returns=("old_log_probs", "entropy"),
    )
    def compute_log_probs(self, batch: Batch) -> Batch:
        """The old policy's log-probs and entropy; with ``meta["sum_pi_squared"]`` also
        ``sum_pi_squared`` (Σ_v π(v)² per response token, for the optimal token baseline)."""
        out = self._log_probs(self.actor, batch, bool(batch.meta.get("sum_pi_squared")))
        names = ("old_log_probs", "entropy", "sum_pi_squared")
        return Batch.from_dict(tensors=dict(zip(names, out, strict=False)))

    @register(
        Dispatch.DP, Collect.CONCAT, reads=SEQUENCES, optional=ATTENTION, returns=("ref_log_probs",)
    )
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        if self.ref is None:
            raise RuntimeError("this worker group was built without a reference (kl_coef=0)")
        logp, _ = self._log_probs(self.ref, batch)
        return Batch.from_dict(tensors={"ref_log_probs": logp})

    # ------------------------------------------------------------------ training

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, r: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The actor's log-probs and entropy, and with the ``full`` KL estimator the exact
        per-token KL to the reference (its whole distribution computed here, no gradient)."""
        alg, t = self.cfg.algorithm, self.cfg.rollout.temperature
        if not (alg.kl_coef > 0 and KL_ESTIMATORS.info(alg.kl_estimator).get("full_vocab")):
            return *self.actor.log_probs(ids, mask, r, t), None
        assert self.ref is not None
        with self.ref.evaluating():
            ref_full = self.ref.full_log_softmax(ids, mask, r, t)
        return self.actor.log_probs_with(
            ids, mask, r, t, ref_full, KL_ESTIMATORS.get(alg.kl_estimator)
        )

    def _old_policy(self, mb: Batch, logp: torch.Tensor) -> torch.Tensor:
        """PPO's old log-probs: the pass before the update, or the rollout's (a loss that
        says so: bypass_mode), or this forward detached (on-policy, one optimizer step)."""
        if POLICY_LOSSES.info(self.cfg.algorithm.policy_loss).get("old") == "rollout_log_probs":
            if "old_log_probs" not in mb:  # the mismatch metrics still compare to this forward
                self._mismatch.append(
                    mismatch_stats(
                        logp.detach().cpu(), mb["rollout_log_probs"], mb["response_mask"]
                    )
                )
            return mb["rollout_log_probs"].to(logp)
        if "old_log_probs" in mb:
            return mb["old_log_probs"]
        # on-policy, one optimizer step: this forward is the old policy (see update_actor)
        old = logp.detach()
        self._mismatch.append(
            mismatch_stats(old.cpu(), mb["rollout_log_probs"], mb["response_mask"])
        )
        return old

    def _loss_options(self) -> Any:
        """The policy loss's settings: the ``algorithm`` knobs it registered, and no others."""
        alg = self.cfg.algorithm
        return POLICY_LOSSES.settings_from(alg.policy_loss, alg)

    def _actor_loss(self, mb: Batch, agg: dict[str, Any]) -> tuple[torch.Tensor, dict]:
        alg = self.cfg.algorithm
        ids, mask, r = self._sequences(mb)
        logp, ent, full_kl = self._forward(ids, mask, r)
        rmask = mb["response_mask"].to(logp.dtype)
        old = self._old_policy(mb, logp)
        loss_fn = POLICY_LOSSES.get(alg.policy_loss)
        # pi_old / pi_rollout: the engine's numerics, and stale weights in the async modes
        is_weights, pg_mask, over_cap = None, rmask, 0.0
        if alg.rollout_correction != "none":
            is_weights, pg_mask, over_cap = rollout_correction(
                old,
                mb["rollout_log_probs"].to(old.device),
                rmask,
                alg.rollout_correction,
                alg.rollout_correction_cap,
            )
        inputs = PolicyLossInputs(
            logp,
            old,
            mb["advantages"],
            pg_mask,
            Aggregation(alg.loss_agg_mode, **agg),
            rollout_is_weights=None if is_weights is None else is_weights.to(logp.dtype),
        )
        pg_loss, stats = loss_fn(inputs, self._loss_options())
        loss = pg_loss
        metrics = {
            "actor/pg_loss": float(pg_loss.detach()),
            "actor/clip_frac": stats["pg_clipfrac"],
        }
        if is_weights is not None:
            metrics["actor/rollout_corr_over_cap_frac"] = over_cap
        if alg.kl_coef > 0:
            per_token = (
                full_kl
                if full_kl is not None
                else kl_penalty(logp, mb["ref_log_probs"], alg.kl_estimator)
            )
            kl = agg_loss(per_token, rmask, alg.loss_agg_mode, **agg)
            loss = loss + alg.kl_coef * kl
            metrics["actor/kl"] = float(kl.detach())
        entropy = agg_loss(ent, rmask, alg.loss_agg_mode, **agg)
        if alg.entropy_coef:
            loss = loss - alg.entropy_coef * entropy
        metrics["actor/entropy"] = float(entropy.detach())
        return loss, metrics

    @register(
        Dispatch.DP,
        Collect.MEAN,
        reads=(*SEQUENCES, "advantages"),
        # old: unless the update's own forward stands for it; ref: with kl_coef > 0;
        # rollout: without old log-probs (mismatch) or with algorithm.rollout_correction
        optional=(*ATTENTION, "old_log_probs", "ref_log_probs", "rollout_log_probs"),
    )
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over mini-batches, one optimizer step each; metrics averaged.

        Without ``old_log_probs`` in the batch (the driver skipped that pass: on-policy, one
        optimizer step) each micro-batch's own forward is the old policy, and the rollout
        mismatch is measured here, over every rank's tokens.
        """
        a = self.cfg.actor
        self._mismatch: list[torch.Tensor] = []
        minis = ppo_mini_batches(batch, a.ppo_epochs, a.ppo_mini_batch_size // self.world_size)
        metrics = mean_over_steps(self._actor_step, minis)
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
        agg = {
            "num_tokens": max(tokens, 1.0),
            "num_seqs": float(len(mb)),
            "dp_size": self.world_size,
            "norm_constant": self.cfg.algorithm.loss_scale_factor,
        }
        micros = [mb.select(idx) for idx in micro_batches(mb, self.cfg.actor)]
        out = self.actor.train_step(micros, lambda m: self._actor_loss(m, agg), prefix="actor/")
        out["actor/clip_frac"] /= len(micros)
        if "actor/rollout_corr_over_cap_frac" in out:
            out["actor/rollout_corr_over_cap_frac"] /= len(micros)
        return out

    @register(Dispatch.DP, Collect.MEAN, reads=("input_ids", "attention_mask", "loss_mask"))
    def train_sft(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of next-token loss on response tokens (token-mean over ranks)."""
        tokens = global_sums(float(batch["loss_mask"][:, 1:].sum()))[0] / self.world_size
        groups = micro_batches(batch, self.cfg.actor, batch["attention_mask"].sum(1))
        micros = [batch.select(idx) for idx in groups]
        return self.actor.train_step(micros, lambda mb: self._sft_loss(mb, tokens), prefix="sft/")

    def _sft_loss(self, mb: Batch, tokens: float) -> tuple[torch.Tensor, dict[str, float]]:
        ids = mb["input_ids"].to(self.device)
        mask = mb["attention_mask"].to(self.device)
        lmask = mb["loss_mask"][:, 1:].to(self.device)
        # Log-probs of loss positions only: no LM-head compute on the prompts.
        logp, _ = self.actor.log_probs(ids, mask, ids.shape[1] - 1, label_mask=lmask)
        loss = agg_loss(-logp, lmask.to(logp.dtype), "token-mean", num_tokens=max(tokens, 1.0))
        return loss, {"sft/loss": float(loss.detach())}

    # ------------------------------------------------------------------ checkpoints

    @register(Dispatch.ALL, Collect.RANK0)
    def save_checkpoint(self, path: str, with_optimizer: bool = True) -> None:
        """Model as an HF safetensors folder (LoRA: the adapters only) by rank 0, optimizer
        gathered (unless trainer.save_optimizer=false), RNG per rank."""
        with_optimizer = with_optimizer and self.cfg.trainer.save_optimizer
        self.actor.save_checkpoint(Path(path), self.rank, self.tokenizer, with_optimizer)

    @register(Dispatch.ALL, Collect.RANK0)
    def load_checkpoint(self, path: str) -> None:
        """Optimizer and RNG (LoRA: and the adapters); the model weights were loaded at start
        from ``path/model``, so the colocated replica serves the checkpoint's weights: their
        version is its step. (LoRA: it was started from the base model, and the driver syncs
        the merged weights right after this.)"""
        self.actor.load_checkpoint(Path(path), self.rank)
        if self.server is not None:
            self.server.version = int(read_state(Path(path))["step"])
