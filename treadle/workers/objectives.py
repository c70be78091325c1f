"""What the policy is trained to do: one objective per training mode, one update loop for all.

The policy worker (:class:`~treadle.workers.actor.ActorRolloutRefWorker`) has one update,
:meth:`~treadle.workers.actor.ActorRolloutRefWorker.update`, which takes an :class:`Objective`
and runs it (:func:`update`): for each of the objective's optimizer steps
(:meth:`Objective.steps`: PPO's shuffled mini-batches over its epochs, one step over the batch
for the others), the step's micro-batches and the global counts its loss is scaled by
(:meth:`Objective.prepare`), one engine step with the objective's loss on every micro-batch
(:meth:`Objective.loss`), and the step's metrics (:meth:`Objective.step_metrics`); the metrics
are averaged over the steps.

==========================  =========  ==========================================================
objective                   metrics    loss
==========================  =========  ==========================================================
:class:`PolicyGradient`     actor/*    ``algorithm.policy_loss`` (PPO, GRPO, DAPO, ...) + KL to
                                       the reference + entropy bonus
:class:`SFT`                sft/*      next-token NLL of the response tokens (token-mean)
:class:`PairPreference`     dpo/*      ``dpo.loss_type`` on preference pairs (DPO family)
:class:`Unpaired`           kto/*      ``kto.loss_type`` on unpaired examples (KTO)
:class:`Distillation`       distill/*  ``distill.loss`` gkd (generalized JSD to the teacher over
                                       its top-k) or seq_kd (NLL of the teacher's samples)
==========================  =========  ==========================================================

A loss returns a :class:`MicroLoss`: the loss, its metrics (summed over micro-batches) and,
for the on-policy PPO update without an old-log-prob pass, the rollout mismatch of its tokens
(:func:`~treadle.algorithms.utils.mismatch_stats`), which the update combines over ranks.

A reference-free pair loss (ORPO, SimPO: registered ``reference=False``) reads no reference
log-probs, and its implicit reward metric is ``β log π(y|x) / |y|``. KTO's reference point
z0 is estimated once per step from the mismatched pairs of the whole batch (all ranks), with
the policy's log-probs of them computed without gradients before the update (TRL estimates it
per device micro-batch: the same estimator on fewer pairs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch
import torch.distributed as dist

from treadle.algorithms import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    UNPAIRED_LOSSES,
    agg_loss,
    implicit_rewards,
    kl_penalty,
    length_rewards,
    pair_stats,
)
from treadle.algorithms.correction import rollout_correction
from treadle.algorithms.distill import generalized_jsd
from treadle.algorithms.inputs import Aggregation, PairInputs, PolicyLossInputs, UnpairedInputs
from treadle.algorithms.utils import mismatch_metrics, mismatch_stats
from treadle.config import Config
from treadle.engines.heads import LogProbRequest, PairTerm
from treadle.protocol import Batch
from treadle.runtime.memory import release_heap
from treadle.workers.common import (
    global_sums,
    micro_batches,
    pair_logps,
    pixels,
    ppo_mini_batches,
    prompt_response,
    rows_with_gradient,
    unpaired_logps,
)

if TYPE_CHECKING:  # imported where an engine is built: the driver does not need FSDP
    from treadle.engines.fsdp import TrainEngine

S = TypeVar("S")  # what a step's loss is scaled by: the step's global counts

REF_PAIRS = ("ref_chosen_logps", "ref_rejected_logps")


@dataclass(frozen=True)
class Policy:
    """What an objective trains and reads: the run's config, the actor, its reference."""

    cfg: Config
    actor: TrainEngine
    ref: TrainEngine | None
    device: torch.device
    dp_size: int  # data-parallel ranks: the shards of a batch
    dp_group: Any = None  # where sums over the batch's samples run (None: every rank)

    def global_sums(self, *values: float) -> list[float]:
        """Each value summed over the data-parallel ranks (each sample counted once)."""
        return global_sums(*values, group=self.dp_group)

    def reference(self, why: str = "") -> TrainEngine:
        if self.ref is None:
            raise RuntimeError(f"this worker group was built without a reference{why}")
        return self.ref


@dataclass(frozen=True)
class MicroLoss:
    """A micro-batch's share of the step's loss, its metrics (summed over micro-batches) and,
    when the update measures it, its rollout mismatch (:func:`mismatch_stats`)."""

    loss: torch.Tensor
    metrics: dict[str, float]
    mismatch: torch.Tensor | None = None


class Objective(ABC, Generic[S]):
    """One training mode of the policy; ``prefix`` names its metrics (``actor/``, ``sft/``...)."""

    prefix: ClassVar[str]

    def __init__(self, policy: Policy) -> None:
        self.policy, self.cfg = policy, policy.cfg

    def steps(self, batch: Batch) -> Iterable[Batch]:
        """The batches of the update's optimizer steps (default: one step over ``batch``)."""
        return (batch,)

    @abstractmethod
    def prepare(self, step: Batch) -> tuple[list[Batch], S]:
        """The step's micro-batches and its global counts (collectives: every rank calls it)."""

    @abstractmethod
    def loss(self, micro: Batch, counts: S) -> MicroLoss:
        """A micro-batch's share of the step's loss."""

    def step_metrics(self, metrics: dict[str, float], micros: int, counts: S) -> dict[str, float]:
        """The step's metrics from the engine's (summed over its ``micros`` micro-batches)."""
        return metrics


def update(engine: TrainEngine, objective: Objective, batch: Batch) -> dict[str, float]:
    """``objective``'s optimizer steps over ``batch`` on ``engine``; metrics averaged over the
    steps, and the rollout mismatch its losses measured, combined over every rank's tokens."""
    per_step: list[dict[str, float]] = []
    mismatch: list[torch.Tensor] = []
    for step in objective.steps(batch):
        metrics, measured = optimizer_step(engine, objective, step)
        per_step.append(metrics)
        mismatch += measured
    metrics = {k: sum(m[k] for m in per_step) / len(per_step) for k in per_step[0]}
    if mismatch:  # every rank measured it (the batch has no old_log_probs on any)
        stats = torch.stack(mismatch)
        sums, top = stats[:, :3].sum(0), stats[:, 3].max().reshape(1)
        group = objective.policy.dp_group
        dist.all_reduce(sums, group=group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        metrics.update(mismatch_metrics(torch.cat([sums, top])))
    release_heap()  # what the update freed goes back to the system, when much (runtime.memory)
    return metrics


def optimizer_step(
    engine: TrainEngine, objective: Objective, step: Batch
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One optimizer step of ``objective`` over ``step``, in micro-batches with accumulated
    gradients: its metrics, and the mismatch stats its losses returned."""
    micros, counts = objective.prepare(step)
    mismatch: list[torch.Tensor] = []

    def micro_loss(micro: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        out = objective.loss(micro, counts)
        if out.mismatch is not None:
            mismatch.append(out.mismatch)
        return out.loss, out.metrics

    out = engine.train_step(micros, micro_loss, prefix=objective.prefix)
    return objective.step_metrics(out, len(micros), counts), mismatch


# ----------------------------------------------------------------------------- PPO family


def loss_options(cfg: Config) -> Any:
    """The policy loss's settings: the ``algorithm`` knobs it registered, and no others."""
    alg = cfg.algorithm
    return POLICY_LOSSES.settings_from(alg.policy_loss, alg)


class PolicyGradient(Objective[dict[str, Any]]):
    """PPO's update (GRPO, DAPO, ... by ``algorithm.policy_loss``): epochs of shuffled
    mini-batches, one optimizer step each; the policy loss, the KL to the reference
    (``kl_coef``) and the entropy bonus (``entropy_coef``), aggregated by ``loss_agg_mode``.

    Without ``old_log_probs`` in the batch (the driver skipped that pass: on-policy, one
    optimizer step) each micro-batch's own forward is the old policy, and the rollout
    mismatch is measured here.

    Rows whose advantages are all zero are left out of the forward and backward passes where
    they add exactly nothing (:func:`skips_zero_advantage`); the loss keeps the whole
    step's counts, so its value and gradient are those of the whole step.
    """

    prefix = "actor/"

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.skip_zero_advantage = skips_zero_advantage(self.cfg)

    def steps(self, batch: Batch) -> Iterable[Batch]:
        a = self.cfg.actor
        return ppo_mini_batches(batch, a.ppo_epochs, a.ppo_mini_batch_size // self.policy.dp_size)

    def prepare(self, step: Batch) -> tuple[list[Batch], dict[str, Any]]:
        # Global counts make the micro-batch losses (summed over ranks) the mini-batch loss:
        # the whole step's, also when the rows without a gradient are left out.
        world = self.policy.dp_size
        rows = step.select(rows_with_gradient(step)) if self.skip_zero_advantage else step
        tokens, computed, computed_rows = self.policy.global_sums(
            float(step["response_mask"].sum()), float(rows["response_mask"].sum()), len(rows)
        )
        agg = {
            "num_tokens": max(tokens / world, 1.0),
            "num_seqs": float(len(step)),
            "dp_size": world,
            "norm_constant": self.cfg.algorithm.loss_scale_factor,
        }
        # the metrics' own: the rows computed (the same as agg when none is left out)
        measured = {**agg, "num_tokens": max(computed / world, 1.0), "num_seqs": float(len(rows))}
        counts = {
            "agg": agg,
            "measured": measured,
            "skipped": 1.0 - computed_rows / (len(step) * world),
        }
        return [rows.select(idx) for idx in micro_batches(rows, self.cfg.actor)], counts

    def step_metrics(
        self, metrics: dict[str, float], micros: int, counts: dict[str, Any]
    ) -> dict[str, float]:
        metrics["actor/rows_skipped"] = counts["skipped"]
        metrics["actor/clip_frac"] /= micros
        metrics["actor/ppo_kl"] /= micros
        if "actor/rollout_corr_over_cap_frac" in metrics:
            metrics["actor/rollout_corr_over_cap_frac"] /= micros
        return metrics

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, r: int, images: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The actor's log-probs and entropy, and with the ``full`` KL estimator the exact
        per-token KL to the reference (its whole distribution computed here, no gradient)."""
        alg, t = self.cfg.algorithm, self.cfg.rollout.temperature
        actor = self.policy.actor
        if not (alg.kl_coef > 0 and KL_ESTIMATORS.info(alg.kl_estimator).get("full_vocab")):
            return *actor.log_probs(ids, mask, r, t, pixel_values=images), None
        ref = self.policy.reference()
        with ref.evaluating():
            request = LogProbRequest(ids, mask, r, t, full_vocab=True, pixel_values=images)
            ref_full = ref.forward(request)
        assert ref_full.full_log_softmax is not None
        pair = PairTerm(ref_full.full_log_softmax, KL_ESTIMATORS.get(alg.kl_estimator))
        out = actor.forward(LogProbRequest(ids, mask, r, t, pair=pair, pixel_values=images))
        return out.log_probs, out.entropy, out.pair_term

    def _old_policy(
        self, mb: Batch, logp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """PPO's old log-probs: the pass before the update, or the rollout's (a loss that
        says so: bypass_mode), or this forward detached (on-policy, one optimizer step); and
        the rollout mismatch of this forward when no old-log-prob pass measured it."""
        if POLICY_LOSSES.info(self.cfg.algorithm.policy_loss).get("old") == "rollout_log_probs":
            mismatch = None
            if "old_log_probs" not in mb:  # the mismatch metrics still compare to this forward
                mismatch = mismatch_stats(
                    logp.detach(), mb["rollout_log_probs"], mb["response_mask"]
                ).cpu()
            return mb["rollout_log_probs"].to(logp), mismatch
        if "old_log_probs" in mb:
            return mb["old_log_probs"], None
        # on-policy, one optimizer step: this forward is the old policy (see update_actor)
        old = logp.detach()
        return old, mismatch_stats(old, mb["rollout_log_probs"], mb["response_mask"]).cpu()

    def loss(self, mb: Batch, counts: dict[str, Any]) -> MicroLoss:
        alg = self.cfg.algorithm
        agg = counts["agg"]
        device = self.policy.device
        ids, mask = prompt_response(mb, device)
        logp, ent, full_kl = self._forward(ids, mask, mb["responses"].shape[1], pixels(mb, device))
        rmask = mb["response_mask"].to(logp.dtype)
        old, mismatch = self._old_policy(mb, logp)
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
        pg_loss, stats = loss_fn(inputs, loss_options(self.cfg))
        loss = pg_loss
        metrics = {
            "actor/pg_loss": float(pg_loss.detach()),
            "actor/clip_frac": stats["pg_clipfrac"],
            "actor/ppo_kl": stats["ppo_kl"],  # to the old policy: verl's name
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
        # over the rows computed: agg's counts, unless rows were left out (then no bonus)
        entropy = agg_loss(ent, rmask, alg.loss_agg_mode, **counts["measured"])
        if alg.entropy_coef:
            loss = loss - alg.entropy_coef * entropy
        metrics["actor/entropy"] = float(entropy.detach())
        return MicroLoss(loss, metrics, mismatch)


def skips_zero_advantage(cfg: Config) -> bool:
    """Whether the actor's update leaves out the rows whose advantages are all zero
    (``actor.skip_zero_advantage``): only where they add exactly nothing, an advantage-scaled
    policy loss (its registration fact) with no KL loss and no entropy bonus."""
    alg = cfg.algorithm
    return (
        cfg.actor.skip_zero_advantage
        and bool(POLICY_LOSSES.info(alg.policy_loss).get("advantage_scaled"))
        and alg.kl_coef == 0
        and not alg.entropy_coef
    )


# ----------------------------------------------------------------------------- SFT


class SFT(Objective[float]):
    """One optimizer step of next-token loss on response tokens (token-mean over ranks)."""

    prefix = "sft/"

    def prepare(self, step: Batch) -> tuple[list[Batch], float]:
        tokens = (
            self.policy.global_sums(float(step["loss_mask"][:, 1:].sum()))[0] / self.policy.dp_size
        )
        groups = micro_batches(step, self.cfg.actor, step["attention_mask"].sum(1))
        return [step.select(idx) for idx in groups], tokens

    def loss(self, mb: Batch, tokens: float) -> MicroLoss:
        device = self.policy.device
        ids = mb["input_ids"].to(device)
        mask = mb["attention_mask"].to(device)
        lmask = mb["loss_mask"][:, 1:].to(device)
        # Log-probs of loss positions only: no LM-head compute on the prompts.
        images = pixels(mb, device)
        logp, _ = self.policy.actor.log_probs(
            ids, mask, ids.shape[1] - 1, label_mask=lmask, pixel_values=images
        )
        loss = agg_loss(-logp, lmask.to(logp.dtype), "token-mean", num_tokens=max(tokens, 1.0))
        return MicroLoss(loss, {"sft/loss": float(loss.detach())})


class Distillation(Objective[float]):
    """GKD and sequence-level KD (``distill.loss``): PPO's mini-batches over its epochs, each
    one optimizer step of a token-mean loss over the response tokens of every rank.

    - ``gkd``: the generalized Jensen-Shannon divergence (``distill.beta``,
      ``distill.temperature``) between the student and the teacher over the teacher's top-k
      ids of each position (``teacher_topk_ids``, ``teacher_topk_log_probs``): the student's
      logits at those ids come from the head (no ``[N, V]`` kept for backward) and both are
      renormalised over them (:func:`~treadle.algorithms.distill.generalized_jsd`);
    - ``seq_kd``: next-token NLL of the responses (the teacher's samples).
    """

    prefix = "distill/"

    def steps(self, batch: Batch) -> Iterable[Batch]:
        a = self.cfg.actor
        return ppo_mini_batches(batch, a.ppo_epochs, a.ppo_mini_batch_size // self.policy.dp_size)

    def prepare(self, step: Batch) -> tuple[list[Batch], float]:
        tokens = (
            self.policy.global_sums(float(step["response_mask"].sum()))[0] / self.policy.dp_size
        )
        return [step.select(idx) for idx in micro_batches(step, self.cfg.actor)], tokens

    def loss(self, mb: Batch, tokens: float) -> MicroLoss:
        d = self.cfg.distill
        ids, mask = prompt_response(mb, self.policy.device)
        rmask = mb["response_mask"].to(self.policy.device)
        r = rmask.shape[1]
        if d.loss == "seq_kd":
            logp, _ = self.policy.actor.log_probs(ids, mask, r, label_mask=rmask)
            per_token = -logp[rmask.bool()]
            name = "distill/nll"
        else:
            topk = mb["teacher_topk_ids"].to(self.policy.device)
            out = self.policy.actor.forward(
                LogProbRequest(ids, mask, r, label_mask=rmask, topk_ids=topk)
            )
            assert out.topk_logits is not None
            teacher = mb["teacher_topk_log_probs"].to(out.topk_logits)[rmask.bool()]
            per_token = generalized_jsd(out.topk_logits, teacher, d.beta, d.temperature)
            name = "distill/jsd"
        loss = per_token.sum() / max(tokens, 1.0)  # token-mean over every rank's tokens
        return MicroLoss(loss, {name: float(loss.detach())})


# ----------------------------------------------------------------------------- pairs (DPO)


class PairPreference(Objective[tuple[float, float]]):
    """One optimizer step of a preference loss (``dpo.loss_type``) over the batch's pairs.

    ``actor.micro_batch_size`` pairs (twice as many sequences) per forward. Losses and
    metrics are divided by the pairs (chosen tokens, for the NLL term) of all ranks, so the
    sum over micro-batches and the mean over ranks are the batch means. ``dpo/loss`` is the
    preference loss alone (the NLL term is ``dpo/nll``).
    """

    prefix = "dpo/"

    def prepare(self, step: Batch) -> tuple[list[Batch], tuple[float, float]]:
        if PREFERENCE_LOSSES.info(self.cfg.dpo.loss_type).get("reference", True):
            missing = [k for k in REF_PAIRS if k not in step]
            if missing:
                raise KeyError(f"train_dpo: dpo.loss_type needs the reference's {missing}")
        world = self.policy.dp_size
        pairs, tokens = (
            x / world for x in self.policy.global_sums(len(step), float(step["chosen_mask"].sum()))
        )
        return step.split(self.cfg.actor.micro_batch_size), (pairs, max(tokens, 1.0))

    def loss(self, mb: Batch, counts: tuple[float, float]) -> MicroLoss:
        """A micro-batch's share of the batch loss, and its metrics (to be summed)."""
        d, (pairs, tokens) = self.cfg.dpo, counts
        info = PREFERENCE_LOSSES.info(d.loss_type)
        chosen, rejected = pair_logps(self.policy.actor, mb, self.policy.device)
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
        return MicroLoss(loss, stats)


# ----------------------------------------------------------------------------- unpaired (KTO)


@dataclass(frozen=True)
class UnpairedCounts:
    """A KTO step's reference point z0 and its counts: examples, desirable ones, undesirable
    ones and desirable tokens, per rank on average."""

    kl: float
    counts: list[float]


class Unpaired(Objective[UnpairedCounts]):
    """One optimizer step of an unpaired loss (``kto.loss_type``) over the batch (mean over
    examples). The reference point z0 (``kto/kl``) comes first, from the whole batch; the
    reward and log-prob metrics are means over the desirable (``chosen``) and the
    undesirable (``rejected``) examples of all ranks (0 for a class the batch lacks);
    ``kto.nll_coef`` adds the desirable completions' token-mean NLL (``kto/nll``)."""

    prefix = "kto/"

    def prepare(self, step: Batch) -> tuple[list[Batch], UnpairedCounts]:
        uses_kl = UNPAIRED_LOSSES.info(self.cfg.kto.loss_type).get("kl")
        kl = self._reference_point(step) if uses_kl else 0.0
        good = float(step["labels"].sum())
        good_tokens = float(step["completion_mask"][step["labels"].bool()].sum())
        counts = [
            x / self.policy.dp_size
            for x in self.policy.global_sums(len(step), good, len(step) - good, good_tokens)
        ]
        return step.split(self.cfg.actor.micro_batch_size), UnpairedCounts(kl, counts)

    def _reference_point(self, batch: Batch) -> float:
        """z0 = max(0, mean of log π - log π_ref over the mismatched pairs of all ranks)."""
        device = self.policy.device
        with torch.no_grad():
            diffs = [
                unpaired_logps(self.policy.actor, mb, device, ("kl_completions",))
                - mb["ref_kl_logps"].to(device)
                for mb in batch.split(self.cfg.actor.micro_batch_size)
            ]
        total, count = self.policy.global_sums(float(torch.cat(diffs).sum()), len(batch))
        return max(total / max(count, 1.0), 0.0)

    def loss(self, mb: Batch, step: UnpairedCounts) -> MicroLoss:
        """A micro-batch's share of the batch loss, and its metrics (to be summed)."""
        k = self.cfg.kto
        logps = unpaired_logps(self.policy.actor, mb, self.policy.device)
        ref = mb["ref_logps"].to(logps.device)
        labels = mb["labels"].to(logps.device).bool()
        settings = UNPAIRED_LOSSES.settings_from(k.loss_type, k)  # beta and its knobs
        inputs = UnpairedInputs(logps, ref, labels, step.kl)
        losses = UNPAIRED_LOSSES.get(k.loss_type)(inputs, settings)
        n, n_good, n_bad, good_tokens = step.counts
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
        return MicroLoss(losses.sum() / n + (k.nll_coef * nll if k.nll_coef else 0.0), stats)

    def step_metrics(
        self, metrics: dict[str, float], micros: int, counts: UnpairedCounts
    ) -> dict[str, float]:
        return {**metrics, "kto/kl": counts.kl}
