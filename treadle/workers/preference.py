"""Preference methods of the actor's worker: log-probs and updates for pairs (DPO family) and
for unpaired examples (KTO).

:class:`PreferenceMixin` is part of :class:`~treadle.workers.actor.ActorRolloutRefWorker`: it
trains the same actor engine against the same reference, so it shares their processes. A pair
is laid out as two sequences, the prompt with its chosen and with its rejected response
(:func:`~treadle.workers.common.pair_sequences`), scored in one forward. An unpaired example
is its prompt with its completion, and (KTO) the prompt with another example's completion
(``kl_completions``, :func:`~treadle.data.collate_unpaired`), scored in one forward.

===========================  ===================================  ===============================
method                       reads                                adds / returns
===========================  ===================================  ===============================
compute_pair_log_probs       PAIRS: prompts, prompt_mask, chosen, chosen_logps, rejected_logps [B]
                             chosen_mask, rejected, rejected_mask
compute_ref_pair_log_probs   PAIRS                                ref_chosen_logps, ref_rejected_...
train_dpo                    PAIRS [+ ref_chosen_logps,           metrics (dpo/*)
                             ref_rejected_logps]
compute_unpaired_log_probs   UNPAIRED: prompts, prompt_mask,      logps, kl_logps [B]
                             completions, completion_mask,
                             kl_completions, kl_completion_mask
compute_ref_unpaired_...     UNPAIRED                             ref_logps, ref_kl_logps [B]
train_kto                    UNPAIRED + labels, ref_logps,        metrics (kto/*)
                             ref_kl_logps
===========================  ===================================  ===============================

A reference-free pair loss (ORPO, SimPO: registered ``reference=False``) reads no reference
log-probs, and its implicit reward metric is ``β log π(y|x) / |y|``. KTO's reference point
z0 is estimated once per step from the mismatched pairs of the whole batch (all ranks), with
the policy's log-probs of them computed without gradients before the update (TRL estimates it
per device micro-batch: the same estimator on fewer pairs).
"""

from __future__ import annotations

import torch

from treadle.algorithms import (
    PREFERENCE_LOSSES,
    UNPAIRED_LOSSES,
    implicit_rewards,
    length_rewards,
    masked_sum,
    pair_stats,
)
from treadle.algorithms.inputs import PairInputs, UnpairedInputs
from treadle.config import Config
from treadle.controller import Collect, Dispatch, register
from treadle.engines.fsdp import TrainEngine
from treadle.protocol import Batch
from treadle.workers.common import PAIRS, global_sums, pair_sequences

UNPAIRED = (
    "prompts",
    "prompt_mask",
    "completions",
    "completion_mask",
    "kl_completions",
    "kl_completion_mask",
)
"""The fields of unpaired examples with their mismatched KL completions, for ``reads=``."""

REF_PAIRS = ("ref_chosen_logps", "ref_rejected_logps")


class PreferenceMixin:
    """DPO and KTO on the actor's engines; the worker class provides the attributes below."""

    cfg: Config
    device: torch.device
    world_size: int
    actor: TrainEngine
    ref: TrainEngine | None

    # ------------------------------------------------------------------------- pairs

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

    def _reference(self) -> TrainEngine:
        if self.ref is None:
            raise RuntimeError("this worker group was built without a reference")
        return self.ref

    @register(Dispatch.DP, Collect.CONCAT, reads=PAIRS, returns=("chosen_logps", "rejected_logps"))
    def compute_pair_log_probs(self, batch: Batch) -> Batch:
        """The policy's ``chosen_logps``, ``rejected_logps`` ``[B]`` of preference pairs."""
        return self._pair_logps_all(self.actor, batch, "")

    @register(Dispatch.DP, Collect.CONCAT, reads=PAIRS, returns=REF_PAIRS)
    def compute_ref_pair_log_probs(self, batch: Batch) -> Batch:
        """The reference's ``ref_chosen_logps``, ``ref_rejected_logps`` ``[B]``."""
        return self._pair_logps_all(self._reference(), batch, "ref_")

    def _dpo_loss(self, mb: Batch, pairs: float, tokens: float) -> tuple[torch.Tensor, dict]:
        """A micro-batch's share of the batch loss, and its metrics (to be summed)."""
        d = self.cfg.dpo
        info = PREFERENCE_LOSSES.info(d.loss_type)
        chosen, rejected = self._pair_logps(self.actor, mb)
        lengths = [mb[f"{k}_mask"].sum(1).to(chosen) for k in ("chosen", "rejected")]
        ref_c = ref_r = None
        if info.get("reference", True):
            ref_c, ref_r = (mb[k].to(chosen.device) for k in REF_PAIRS)
        inputs = PairInputs(chosen, rejected, ref_c, ref_r, lengths[0], lengths[1])
        settings = PREFERENCE_LOSSES.settings_from(d.loss_type, d)  # beta and its knobs
        losses = PREFERENCE_LOSSES.get(d.loss_type)(inputs, settings)
        nll = -chosen.sum() / tokens  # the chosen responses' token-mean NLL (RPO's SFT term)
        nll_coef = info.get("nll", 0.0) + d.nll_coef
        loss = losses.sum() / pairs + (nll_coef * nll if nll_coef else 0.0)
        if ref_c is None or ref_r is None:  # reference-free: the average token log-prob
            reward_c = length_rewards(chosen.detach(), lengths[0], d.beta)
            reward_r = length_rewards(rejected.detach(), lengths[1], d.beta)
        else:
            reward_c = implicit_rewards(chosen.detach(), ref_c, d.beta)
            reward_r = implicit_rewards(rejected.detach(), ref_r, d.beta)
        rewards = pair_stats(reward_c, reward_r)
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

    @register(Dispatch.DP, Collect.MEAN, reads=PAIRS, optional=REF_PAIRS)
    def train_dpo(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of a preference loss over the batch's pairs (pair-mean).

        Reads the pairs and, unless the loss is reference-free, their reference log-probs;
        ``actor.micro_batch_size`` pairs (twice as many sequences) per forward. Losses and
        metrics are divided by the pairs (chosen tokens, for the NLL term) of all ranks, so
        the sum over micro-batches and the mean over ranks are the batch means.
        ``dpo/loss`` is the preference loss alone (the NLL term is ``dpo/nll``).
        """
        if PREFERENCE_LOSSES.info(self.cfg.dpo.loss_type).get("reference", True):
            missing = [k for k in REF_PAIRS if k not in batch]
            if missing:
                raise KeyError(f"train_dpo: dpo.loss_type needs the reference's {missing}")
        pairs, tokens = (
            x / self.world_size for x in global_sums(len(batch), float(batch["chosen_mask"].sum()))
        )
        micros = batch.split(self.cfg.actor.micro_batch_size)
        tokens = max(tokens, 1.0)
        return self.actor.train_step(
            micros, lambda mb: self._dpo_loss(mb, pairs, tokens), prefix="dpo/"
        )

    # ------------------------------------------------------------------------- unpaired (KTO)

    def _unpaired_logps(
        self, engine: TrainEngine, mb: Batch, names: tuple[str, ...] = ("completions",)
    ) -> torch.Tensor:
        """Sequence log-probs of each prompt with the completions of ``names``
        (``kl_completions``: the mismatched ones), one column after the other."""
        prompts = torch.cat([mb["prompts"]] * len(names))
        pmask = torch.cat([mb["prompt_mask"]] * len(names))
        responses = torch.cat([mb[n] for n in names])
        rmask = torch.cat([mb[n.removesuffix("s") + "_mask"] for n in names])
        ids = torch.cat([prompts, responses], 1).to(self.device)
        mask = torch.cat([pmask, rmask], 1).to(self.device)
        logp, _ = engine.log_probs(ids, mask, responses.shape[1])
        return masked_sum(logp, rmask.to(logp.device), dim=-1).float()

    @torch.no_grad()
    def _unpaired_logps_all(self, engine: TrainEngine, batch: Batch, prefix: str) -> Batch:
        kl = bool(UNPAIRED_LOSSES.info(self.cfg.kto.loss_type).get("kl"))
        names = ("completions", "kl_completions") if kl else ("completions",)
        out: dict[str, list[torch.Tensor]] = {"logps": [], "kl_logps": []}
        for mb in batch.split(self.cfg.actor.micro_batch_size):
            seq = self._unpaired_logps(engine, mb, names).cpu()
            out["logps"].append(seq[: len(mb)])
            out["kl_logps"].append(seq[len(mb) :] if kl else torch.zeros(len(mb)))
        return Batch.from_dict(tensors={prefix + k: torch.cat(v) for k, v in out.items()})

    @register(Dispatch.DP, Collect.CONCAT, reads=UNPAIRED, returns=("logps", "kl_logps"))
    def compute_unpaired_log_probs(self, batch: Batch) -> Batch:
        """The policy's ``logps`` of the completions and ``kl_logps`` of the mismatched ones
        (zeros for a loss without KTO's reference point) ``[B]``."""
        return self._unpaired_logps_all(self.actor, batch, "")

    @register(Dispatch.DP, Collect.CONCAT, reads=UNPAIRED, returns=("ref_logps", "ref_kl_logps"))
    def compute_ref_unpaired_log_probs(self, batch: Batch) -> Batch:
        """The reference's ``ref_logps`` and ``ref_kl_logps`` ``[B]``."""
        return self._unpaired_logps_all(self._reference(), batch, "ref_")

    def _kto_reference_point(self, batch: Batch) -> float:
        """z0 = max(0, mean of log π - log π_ref over the mismatched pairs of all ranks)."""
        with torch.no_grad():
            diffs = [
                self._unpaired_logps(self.actor, mb, ("kl_completions",))
                - mb["ref_kl_logps"].to(self.device)
                for mb in batch.split(self.cfg.actor.micro_batch_size)
            ]
        total, count = global_sums(float(torch.cat(diffs).sum()), len(batch))
        return max(total / max(count, 1.0), 0.0)

    def _kto_loss(self, mb: Batch, kl: float, counts: list[float]) -> tuple[torch.Tensor, dict]:
        """A micro-batch's share of the batch loss, and its metrics (to be summed); ``counts``:
        examples, desirable ones, undesirable ones and desirable tokens, per rank on average."""
        k = self.cfg.kto
        logps = self._unpaired_logps(self.actor, mb)
        ref = mb["ref_logps"].to(logps.device)
        labels = mb["labels"].to(logps.device).bool()
        settings = UNPAIRED_LOSSES.settings_from(k.loss_type, k)  # beta and its knobs
        losses = UNPAIRED_LOSSES.get(k.loss_type)(UnpairedInputs(logps, ref, labels, kl), settings)
        n, n_good, n_bad, good_tokens = counts
        nll = -logps[labels].sum() / max(good_tokens, 1.0)  # the desirable token-mean NLL
        rewards = implicit_rewards(logps.detach(), ref, k.beta)
        stats = {
            "kto/loss": float(losses.detach().sum()) / n,
            "kto/chosen_reward": float(rewards[labels].sum()) / max(n_good, 1e-9),
            "kto/rejected_reward": float(rewards[~labels].sum()) / max(n_bad, 1e-9),
            "kto/chosen_logp": float(logps.detach()[labels].sum()) / max(n_good, 1e-9),
            "kto/rejected_logp": float(logps.detach()[~labels].sum()) / max(n_bad, 1e-9),
            "kto/nll": float(nll.detach()),
        }
        return losses.sum() / n + (k.nll_coef * nll if k.nll_coef else 0.0), stats

    @register(
        Dispatch.DP,
        Collect.MEAN,
        reads=(*UNPAIRED, "labels", "ref_logps", "ref_kl_logps"),
    )
    def train_kto(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of an unpaired loss (``kto.loss_type``) over the batch (mean over
        examples). The reference point z0 (``kto/kl``) comes first, from the whole batch; the
        reward and log-prob metrics are means over the desirable (``chosen``) and the
        undesirable (``rejected``) examples of all ranks (0 for a class the batch lacks);
        ``kto.nll_coef`` adds the desirable completions' token-mean NLL (``kto/nll``)."""
        uses_kl = UNPAIRED_LOSSES.info(self.cfg.kto.loss_type).get("kl")
        kl = self._kto_reference_point(batch) if uses_kl else 0.0
        good = float(batch["labels"].sum())
        good_tokens = float(batch["completion_mask"][batch["labels"].bool()].sum())
        counts = [
            x / self.world_size
            for x in global_sums(len(batch), good, len(batch) - good, good_tokens)
        ]
        micros = batch.split(self.cfg.actor.micro_batch_size)
        metrics = self.actor.train_step(
            micros, lambda mb: self._kto_loss(mb, kl, counts), prefix="kto/"
        )
        return {**metrics, "kto/kl": kl}
