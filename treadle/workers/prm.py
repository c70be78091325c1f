"""PRIME's implicit process reward model: a causal LM trained on outcome labels, and its frozen
reference, in a worker group of their own.

The PRM (``prime.model_path``, default the actor's ``model.path``) is an FSDP2
:class:`~treadle.engines.fsdp.TrainEngine` with its own AdamW; the reference is its frozen
initial weights (``prime.ref_path``), another engine. Both compute the log-prob of the response
tokens (temperature 1, as verl's PRM: the implicit reward is a property of the PRM, not of the
sampling), and the worker returns their difference ``q_t`` (0 where the mask is 0); the
token rewards, the normalisation and the accuracies are computed on the driver from it
(:mod:`treadle.algorithms.prime`, :mod:`treadle.trainers.prime`), so they see the whole batch.

==================  ========================================  ================================
method              reads                                     adds / returns
==================  ========================================  ================================
compute_log_ratio   prompts, prompt_mask, responses,          prm_log_ratio, prm_ref_log_probs
                    response_mask; prm_ref_log_probs if
                    present
update_prm          (same) + prm_labels; prm_opponents        prm_log_ratio, prm_ref_log_probs,
                    (loss=dpo)                                prm_loss (the update's forward,
                                                              before each step); meta:
                                                              prime/grad_norm, prime/lr
==================  ========================================  ================================

The reference is frozen, so its log-probs are computed once a step: the first call returns
them (``prm_ref_log_probs``) and the driver hands them to the next.

The update is one pass over the batch in order, ``prime.mini_batch_size`` samples (all ranks)
per optimizer step, the loss the mean over the mini-batch's samples (verl's recipe).
"""

from __future__ import annotations

import torch

from treadle.algorithms.prime import prime_ce_loss, prime_dpo_loss
from treadle.controller import Collect, Dispatch, register
from treadle.protocol import Batch
from treadle.workers.base import TrainingWorker
from treadle.workers.common import (
    ATTENTION,
    SEQUENCES,
    engine_options,
    global_sums,
    prompt_response,
    train_engine,
)


class ImplicitPRMWorker(TrainingWorker):
    """PRIME's PRM and its frozen reference, one process per rank."""

    role = "prm"

    def setup(self, *, prm_path: str) -> None:
        config, world_size = self.cfg, self.world_size
        p, a = config.prime, config.actor
        self.p = p
        self.mini = (p.mini_batch_size or a.ppo_mini_batch_size) // world_size
        self.micro = p.micro_batch_size or a.micro_batch_size
        self.tokenizer = self.load_tokenizer()
        options = engine_options(config)
        self.engine = train_engine(
            self.load_lm(prm_path, "prime.model_path"),
            **options,
            lr=p.lr,
            betas=a.betas,
            weight_decay=p.weight_decay,
            grad_clip=p.grad_clip,
            gradient_checkpointing=a.gradient_checkpointing,
        )
        # the frozen start, and the key that named it (for a load error)
        ref_key, ref = next(
            (key, path)
            for key, path in (
                ("prime.ref_path", p.ref_path),
                ("prime.model_path", p.model_path),
                ("model.path", config.model.path),
            )
            if path
        )
        self.ref = train_engine(self.load_lm(ref, ref_key), **options, trainable=False)
        self._wait()

    def _log_ratio(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``log π_prm - log π_ref`` of each response token (gradient through the PRM), and
        ``log π_ref`` (taken from ``prm_ref_log_probs`` when the batch has them)."""
        ids, mask = prompt_response(mb, self.device)
        width = mb["responses"].shape[1]
        logp, _ = self.engine.log_probs(ids, mask, width)
        if "prm_ref_log_probs" in mb:  # the reference is frozen: a second pass gives the same
            ref = mb["prm_ref_log_probs"].to(logp)
        else:
            with torch.no_grad():
                ref, _ = self.ref.log_probs(ids, mask, width)
        valid = mb["response_mask"].to(logp.device).bool()
        return torch.where(valid, logp - ref, 0.0), ref.detach()

    @register(
        Dispatch.DP,
        Collect.CONCAT,
        reads=SEQUENCES,
        optional=(*ATTENTION, "prm_ref_log_probs"),
        returns=("prm_log_ratio", "prm_ref_log_probs"),
    )
    def compute_log_ratio(self, batch: Batch) -> Batch:
        ratios, refs = [], []
        with torch.no_grad(), self.engine.evaluating():
            for mb in batch.split(self.micro):
                q, ref = self._log_ratio(mb)
                ratios.append(q.float().cpu())
                refs.append(ref.float().cpu())
        self._wait()
        return Batch.from_dict(
            tensors={"prm_log_ratio": torch.cat(ratios), "prm_ref_log_probs": torch.cat(refs)}
        )

    @register(
        Dispatch.DP,
        Collect.CONCAT,
        reads=(*SEQUENCES, "prm_labels"),
        optional=(*ATTENTION, "prm_opponents", "prm_ref_log_probs"),
        returns=("prm_log_ratio", "prm_ref_log_probs", "prm_loss"),
    )
    def update_prm(self, batch: Batch) -> Batch:
        """One pass over ``batch`` in mini-batches (an optimizer step each), in order."""
        ratios: list[torch.Tensor] = []
        refs: list[torch.Tensor] = []
        losses: list[torch.Tensor] = []
        norms, lr = [], 0.0
        for mb in batch.split(self.mini):
            (count,) = global_sums(float(len(mb)))
            # gradients are averaged over ranks: this makes them the mini-batch's sample mean
            scale = self.world_size / count

            def loss_fn(micro: Batch, scale: float = scale) -> tuple[torch.Tensor, dict]:
                q, ref = self._log_ratio(micro)
                per_sample = self._loss(q, micro)
                ratios.append(q.detach().float().cpu())
                refs.append(ref.float().cpu())
                losses.append(per_sample.detach().float().cpu())
                return per_sample.sum() * scale, {}

            out = self.engine.train_step(mb.split(self.micro), loss_fn)
            norms.append(out["grad_norm"])
            lr = out["lr"]
        self._wait()
        return Batch.from_dict(
            tensors={
                "prm_log_ratio": torch.cat(ratios),
                "prm_ref_log_probs": torch.cat(refs),
                "prm_loss": torch.cat(losses),
            },
            meta={"prime/grad_norm": sum(norms) / len(norms), "prime/lr": lr},
        )

    def _wait(self) -> None:
        """PRM and reference between passes: in host memory with ``actor.offload_params``."""
        self.engine.offload()
        self.ref.offload()

    def _loss(self, q: torch.Tensor, micro: Batch) -> torch.Tensor:
        labels = micro["prm_labels"].to(q)
        mask = micro["response_mask"].to(q.device)
        if self.p.loss == "ce":
            return prime_ce_loss(q, mask, labels, self.p.beta)
        return prime_dpo_loss(q, mask, labels, micro["prm_opponents"].to(q), self.p.beta)
