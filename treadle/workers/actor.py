"""The policy's worker: actor, rollout engine and reference, colocated in one process per rank.

:class:`ActorRolloutRefWorker` fuses three roles in one process, as verl's hybrid engine does:
the actor (FSDP2 training engine), its rollout engine (a private inference copy, refreshed
from the actor after every update) and the reference (frozen initial weights, FSDP2 too).
Each public method is declared with its dispatch mode and the batch fields it reads; only
those fields cross to the ranks. The driver calls the group, never a rank. The worker knows
how to compute a phase, not in which order phases run.

Every training method is one call of :meth:`ActorRolloutRefWorker.update` with its objective
(:mod:`treadle.workers.objectives`: PPO's family, SFT, DPO's family, KTO); every log-prob
method is one pass of an engine over the batch's sequences (prompt + response, a pair's two,
an unpaired example's completion and its mismatched one).

Batch fields each method reads and adds (see :mod:`treadle.protocol.fields` for the table):

==========================  =====================================  ===========================
method                      reads                                  adds / returns
==========================  =====================================  ===========================
compute_log_probs           SEQUENCES: prompts, prompt_mask,       old_log_probs, entropy
                            responses, response_mask               (+ sum_pi_squared, asked
                                                                   by ``sum_pi_squared=True``)
compute_ref_log_probs       SEQUENCES                              ref_log_probs
update_actor                SEQUENCES + advantages; old_log_probs, metrics actor/* (mean of
                            ref_log_probs, rollout_log_probs if    ranks)
                            present
train_sft                   input_ids, attention_mask, loss_mask   metrics sft/*
compute_pair_log_probs      PAIRS: prompts, prompt_mask, chosen,   chosen_logps,
                            chosen_mask, rejected, rejected_mask   rejected_logps [B]
compute_ref_pair_log_probs  PAIRS                                  ref_chosen_logps, ref_...
train_dpo                   PAIRS [+ ref_chosen_logps,             metrics dpo/*
                            ref_rejected_logps]
compute_unpaired_log_probs  UNPAIRED: prompts, prompt_mask,        logps, kl_logps [B]
                            completions, completion_mask,
                            kl_completions, kl_completion_mask
compute_ref_unpaired_...    UNPAIRED                               ref_logps, ref_kl_logps [B]
train_kto                   UNPAIRED + labels, ref_logps,          metrics kto/*
                            ref_kl_logps
==========================  =====================================  ===========================

The rollout side: ``rollout_generate`` and ``rollout_score``
(:class:`~treadle.serving.replica.ServesRollout`, the interface every process holding a replica
has) serve requests from this rank's colocated replica (``rollout.placement=colocated``), and
``sync_weights`` (:class:`~treadle.workers.sender.SendsWeights`) sends the actor's weights to
the rollout, in memory (colocated) or over the weight-sync group (split). A colocated teacher
(``treadle distill``, ``teacher.placement=colocated``,
:class:`~treadle.serving.replica.ServesTeacher`) is a second engine and server in the same
process: ``init_teacher`` loads it, ``teacher_generate`` and ``teacher_score`` serve it; a
colocated LLM judge (``reward.judge``, :class:`~treadle.serving.replica.ServesJudge`) likewise,
with ``init_judge``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from treadle.algorithms import UNPAIRED_LOSSES
from treadle.controller import Collect, Dispatch, register
from treadle.data.images import PIXELS
from treadle.engines.heads import LogProbRequest
from treadle.models.checkpoint import read_state
from treadle.models.loading import apply_lora
from treadle.protocol import Batch
from treadle.serving.replica import ServesJudge, ServesRollout, ServesTeacher, make_engine
from treadle.serving.server import RolloutServer
from treadle.workers.common import (
    ATTENTION,
    PAIRS,
    SEQUENCES,
    SFT_EXAMPLES,
    UNPAIRED,
    actor_optimizer,
    engine_options,
    micro_batches,
    pair_logps,
    per_pair,
    pixels,
    prompt_response,
    train_engine,
    unpaired_logps,
)
from treadle.workers.objectives import (
    REF_PAIRS,
    SFT,
    Distillation,
    Objective,
    PairPreference,
    Policy,
    PolicyGradient,
    Unpaired,
    update,
)
from treadle.workers.sender import SendsWeights

if TYPE_CHECKING:  # imported where an engine is built: the driver does not need FSDP
    from treadle.engines.fsdp import TrainEngine


class ActorRolloutRefWorker(ServesRollout, ServesTeacher, ServesJudge, SendsWeights):
    """Actor + rollout engine + reference (+ a colocated teacher), in one process per rank."""

    role = "actor"
    parallel_section = "actor"

    def setup(
        self, *, actor_path: str, with_ref: bool, version: int = 0, optimizer_steps: int = 0
    ) -> None:
        """``optimizer_steps``: the run's, where a decaying ``actor.lr_schedule`` ends (0: a
        group that does not train, an evaluation's)."""
        config, timer = self.cfg, self.startup
        self.tokenizer = self.load_tokenizer(actor_path)
        lm = self.load_lm(actor_path)
        lora = config.actor.lora
        if lora.rank:  # actor_path is the base model; a checkpoint's adapters come in resume
            lm = apply_lora(lm, lora, config.model.path, config.trainer.seed)
        options = engine_options(config) | {"meshes": self.meshes, "section": "actor"}
        self.engine = train_engine(lm, **options, **actor_optimizer(config, optimizer_steps))
        timer.done("actor_model")
        self.ref: TrainEngine | None = None
        if with_ref and lora.rank:  # the base model: the actor with its adapters disabled
            self.ref = self.engine.without_adapters()
        elif with_ref:
            self.ref = train_engine(self.load_lm(config.model.path), **options, trainable=False)
        timer.done("reference_model")
        # Colocated rollout: this rank's replica, served from this process (rollout_generate).
        self.server = (
            RolloutServer(
                make_engine(config, actor_path, self.device),
                f"rollout replica {self.rank} (actor rank {self.rank})",
                index=self.rank,
                sleep_when_idle=self.device.type == "cuda",
                version=version,
            )
            if config.rollout.placement == "colocated"
            else None
        )
        timer.done("rollout_engine")
        self._wait()

    @property
    def actor(self) -> TrainEngine:
        """The actor's training engine."""
        return self.engine

    def policy(self) -> Policy:
        """The engines an objective trains and reads, with the config as it is now."""
        dp_group = self.meshes.dp_group if self.meshes is not None else None
        return Policy(self.cfg, self.engine, self.ref, self.device, self.layout.dp, dp_group)

    # ------------------------------------------------------------------ log-probs

    @contextlib.contextmanager
    def _reference(self, why: str = "") -> Iterator[TrainEngine]:
        """The reference for one pass, after which it waits (:meth:`TrainEngine.offload`)."""
        ref = self.policy().reference(why)
        try:
            yield ref
        finally:
            ref.offload()

    @torch.no_grad()
    def _token_log_probs(
        self, engine: TrainEngine, batch: Batch, sum_pi_squared: bool = False
    ) -> list[torch.Tensor]:
        """``[log-probs, entropy]`` of the response tokens, ``+ [Σ_v π(v)²]`` if asked."""
        groups = micro_batches(batch, self.cfg.actor)
        parts: list[list[torch.Tensor]] = []
        with engine.evaluating():  # the policy itself, without dropout noise
            for idx in groups:
                mb = batch.select(idx)
                ids, mask = prompt_response(mb, self.device)
                t = self.cfg.rollout.temperature
                width = mb["responses"].shape[1]
                images = pixels(mb, self.device)
                request = LogProbRequest(
                    ids, mask, width, t, None, sum_pi_squared, pixel_values=images
                )
                out = engine.forward(request)
                columns = [out.log_probs, out.entropy]
                if out.sum_pi_squared is not None:
                    columns.append(out.sum_pi_squared)
                parts.append([x.float().cpu() for x in columns])
        order = torch.cat(groups).argsort()  # back to the batch's order
        return [torch.cat(column)[order] for column in zip(*parts, strict=True)]

    @register(
        Dispatch.DP,
        Collect.CONCAT,
        reads=SEQUENCES,
        # sum_pi_squared is not read: listed so the result may hold it (sum_pi_squared=True)
        optional=(*ATTENTION, "sum_pi_squared"),
        returns=("old_log_probs", "entropy"),
    )
    def compute_log_probs(self, batch: Batch, sum_pi_squared: bool = False) -> Batch:
        """The old policy's log-probs and entropy; with ``sum_pi_squared`` also
        ``sum_pi_squared`` (Σ_v π(v)² per response token, for the optimal token baseline)."""
        out = self._token_log_probs(self.engine, batch, sum_pi_squared)
        names = ("old_log_probs", "entropy", "sum_pi_squared")
        return Batch.from_dict(tensors=dict(zip(names, out, strict=False)))

    @register(
        Dispatch.DP, Collect.CONCAT, reads=SEQUENCES, optional=ATTENTION, returns=("ref_log_probs",)
    )
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        with self._reference(" (kl_coef=0)") as ref:
            logp, _ = self._token_log_probs(ref, batch)
        return Batch.from_dict(tensors={"ref_log_probs": logp})

    @torch.no_grad()
    def _pair_columns(self, engine: TrainEngine, batch: Batch, prefix: str) -> Batch:
        size = self.cfg.actor.micro_batch_size
        chosen, rejected = per_pair(batch, size, lambda mb: pair_logps(engine, mb, self.device))
        return Batch.from_dict(
            tensors={f"{prefix}chosen_logps": chosen, f"{prefix}rejected_logps": rejected}
        )

    @register(Dispatch.DP, Collect.CONCAT, reads=PAIRS, returns=("chosen_logps", "rejected_logps"))
    def compute_pair_log_probs(self, batch: Batch) -> Batch:
        """The policy's ``chosen_logps``, ``rejected_logps`` ``[B]`` of preference pairs."""
        return self._pair_columns(self.engine, batch, "")

    @register(Dispatch.DP, Collect.CONCAT, reads=PAIRS, returns=REF_PAIRS)
    def compute_ref_pair_log_probs(self, batch: Batch) -> Batch:
        """The reference's ``ref_chosen_logps``, ``ref_rejected_logps`` ``[B]``."""
        with self._reference() as ref:
            return self._pair_columns(ref, batch, "ref_")

    @torch.no_grad()
    def _unpaired_columns(self, engine: TrainEngine, batch: Batch, prefix: str) -> Batch:
        kl = bool(UNPAIRED_LOSSES.info(self.cfg.kto.loss_type).get("kl"))
        names = ("completions", "kl_completions") if kl else ("completions",)
        out: dict[str, list[torch.Tensor]] = {"logps": [], "kl_logps": []}
        for mb in batch.split(self.cfg.actor.micro_batch_size):
            seq = unpaired_logps(engine, mb, self.device, names).cpu()
            out["logps"].append(seq[: len(mb)])
            out["kl_logps"].append(seq[len(mb) :] if kl else torch.zeros(len(mb)))
        return Batch.from_dict(tensors={prefix + k: torch.cat(v) for k, v in out.items()})

    @register(Dispatch.DP, Collect.CONCAT, reads=UNPAIRED, returns=("logps", "kl_logps"))
    def compute_unpaired_log_probs(self, batch: Batch) -> Batch:
        """The policy's ``logps`` of the completions and ``kl_logps`` of the mismatched ones
        (zeros for a loss without KTO's reference point) ``[B]``."""
        return self._unpaired_columns(self.engine, batch, "")

    @register(Dispatch.DP, Collect.CONCAT, reads=UNPAIRED, returns=("ref_logps", "ref_kl_logps"))
    def compute_ref_unpaired_log_probs(self, batch: Batch) -> Batch:
        """The reference's ``ref_logps`` and ``ref_kl_logps`` ``[B]``."""
        with self._reference() as ref:
            return self._unpaired_columns(ref, batch, "ref_")

    # ------------------------------------------------------------------ training

    def update(self, batch: Batch, objective: Objective) -> dict[str, float]:
        """The one training path: ``objective``'s optimizer steps over ``batch`` on the actor
        (:func:`~treadle.workers.objectives.update`)."""
        return update(self.engine, objective, batch)

    @register(
        Dispatch.DP,
        Collect.MEAN,
        reads=(*SEQUENCES, "advantages"),
        # old: unless the update's own forward stands for it; ref: with kl_coef > 0;
        # rollout: without old log-probs (mismatch) or with algorithm.rollout_correction
        optional=(*ATTENTION, "old_log_probs", "ref_log_probs", "rollout_log_probs"),
    )
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over mini-batches, one optimizer step each (:class:`PolicyGradient`)."""
        return self.update(batch, PolicyGradient(self.policy()))

    @register(Dispatch.DP, Collect.MEAN, reads=SFT_EXAMPLES, optional=(PIXELS,))
    def train_sft(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of next-token loss on response tokens (:class:`SFT`)."""
        return self.update(batch, SFT(self.policy()))

    @register(
        Dispatch.DP,
        Collect.MEAN,
        reads=SEQUENCES,
        optional=(*ATTENTION, "teacher_topk_ids", "teacher_topk_log_probs"),
    )
    def train_distill(self, batch: Batch) -> dict[str, float]:
        """GKD (the teacher's top-k) or sequence-level KD (:class:`Distillation`)."""
        return self.update(batch, Distillation(self.policy()))

    @register(Dispatch.DP, Collect.MEAN, reads=PAIRS, optional=REF_PAIRS)
    def train_dpo(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of a preference loss over the batch's pairs, pair-mean, with
        their reference log-probs unless the loss is reference-free (:class:`PairPreference`)."""
        return self.update(batch, PairPreference(self.policy()))

    @register(Dispatch.DP, Collect.MEAN, reads=(*UNPAIRED, "labels", "ref_logps", "ref_kl_logps"))
    def train_kto(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of an unpaired loss over the batch (:class:`Unpaired`)."""
        return self.update(batch, Unpaired(self.policy()))

    # ------------------------------------------------------------------ checkpoints

    @register(Dispatch.ALL, Collect.RANK0)
    def load_weights(self, path: str) -> None:
        """The model weights of checkpoint ``path`` (LoRA: its adapters), without optimizer or
        RNG; :meth:`sync_weights` then gives them to the rollout (``treadle eval RUN_DIR``)."""
        from treadle.engines.checkpoint import load_weights  # (where an engine was built)

        load_weights(self.engine, Path(path))

    @register(Dispatch.ALL, Collect.RANK0)
    def load_checkpoint(self, path: str) -> None:
        """Optimizer and RNG (LoRA: and the adapters); the model weights were loaded at start
        from ``path/model``, so the colocated replica serves the checkpoint's weights: their
        version is its step. (LoRA: it was started from the base model, and the driver syncs
        the merged weights right after this.)"""
        super().load_checkpoint(path)
        if self.server is not None:
            self.server.version = int(read_state(Path(path))["step"])
