"""The distillation driver: a frozen teacher, a student that learns from each of its tokens.

::

    prompts ─► student samples (reverse_kl; a λ share of gkd's) ┐
               dataset responses (the rest of gkd's)            ├─► teacher scores ─► update ─► sync
               teacher samples (seq_kd)                         ┘   (log-probs, top-k)

The teacher (:mod:`treadle.rollout.teacher`) is replicas of an inference engine holding a
frozen model, colocated in the actor's processes or split into a pool of their own; it scores
the batch's response tokens (the log-prob of each, and the top-k of each position for GKD) and,
for sequence-level KD, generates. What the student learns (``distill.loss``):

- ``reverse_kl``, on-policy distillation (Agarwal et al. 2023; Thinking Machines 2025): the
  student samples, and the per-token reverse KL ``-(log π_student - log π_teacher)`` of each
  sampled token is its advantage (times ``distill.coef``) in ``algorithm.policy_loss``'s
  clipped update; with ``distill.task_reward`` the estimator's advantages of the reward are
  added. It is the RL step with the teacher's pass for the reward's, so every RL option
  (modes, KL to a reference, rollout correction) holds.
- ``gkd`` (Agarwal et al. 2023, TRL's ``GKDTrainer``): the first ``round(λ B)`` prompts of a
  batch are answered by the student (``rollout.n`` samples each), the others by their dataset
  response (``data.response_key``, once each); the loss is the generalized Jensen-Shannon
  divergence (``distill.beta``) over the teacher's top-k ids of every response position.
- ``seq_kd``, sequence-level KD (Kim & Rush 2016): the teacher samples, the student learns
  them by next-token loss.

Everything else (checkpoints, resume, evaluation, trackers, the report) is the RL driver's:
the data position is the sampler's, the student's replicas get the weights after each update.
"""

from __future__ import annotations

import torch

from treadle.agents.trajectory import Trajectory
from treadle.algorithms.distill import reverse_kl_advantages
from treadle.config import Config
from treadle.data import prompt_batch
from treadle.data.prompts import pad_prompts
from treadle.data.readers import as_text
from treadle.data.templating import response_ids
from treadle.engines.packing import balance_ranks
from treadle.protocol import Batch
from treadle.rollout.sources import SyncSource, sampling_params
from treadle.rollout.teacher import Teacher, start_teacher
from treadle.runtime.errors import DataError
from treadle.tracking.tracker import timed
from treadle.trainers.datasets import text_options
from treadle.trainers.prompts import tokenizer
from treadle.trainers.rl import RLTrainer, rollout_metrics, sample_rows


class DistillTrainer(RLTrainer):
    """The RL driver's loop with a teacher in place of the reward's advantages."""

    kind = "distill"

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)  # the checks, the student's actors and replicas, the source
        try:
            self.teacher: Teacher = start_teacher(cfg, self.group, tokenizer(cfg))
            self.answers = self.dataset_answers() if self.uses_dataset() else {}
        except BaseException:
            self.close()
            raise
        # sequence-level KD: the teacher's replicas generate the step's samples
        self.teacher_source = SyncSource(
            cfg, self.teacher.rollout, self.train_ds, self.sampler, self.score
        )

    @property
    def headline(self) -> str:  # type: ignore[override]
        names = {"reverse_kl": "distill/reverse_kl", "gkd": "distill/jsd", "seq_kd": "distill/nll"}
        return names[self.cfg.distill.loss]

    @property
    def algorithm(self) -> str:  # type: ignore[override]
        d, t = self.cfg.distill, self.cfg.teacher
        return (
            f"distillation ({d.loss}) from {t.model_path} ({t.engine} {t.placement}), "
            f"trainer.mode={self.cfg.trainer.mode}"
        )

    def close(self) -> None:
        try:
            if hasattr(self, "teacher"):
                self.teacher.close()
        finally:
            super().close()

    def uses_dataset(self) -> bool:
        d = self.cfg.distill
        prompts = self.cfg.data.batch_size
        return d.loss == "gkd" and round(d.lmbda * prompts) < prompts

    def step(self, step: int) -> dict[str, float]:
        d, m = self.cfg.distill, dict[str, float]()
        batch = self.distill_batch(step, m)
        a = self.cfg.actor
        batch = balance_ranks(batch, a.dp_size(), a.shares_prompts())
        if d.loss != "seq_kd":  # the teacher's log-probs of its own samples are their rollout's
            with timed(m, "teacher"):
                batch = batch.union(self.teacher.score(batch, d.top_k if d.loss == "gkd" else 0))
            m.update(teacher_metrics(batch))
        if d.loss == "reverse_kl":  # the old policy's (and reference's) passes, when needed
            batch = self.log_prob_passes(batch, m)
        # the rollout's metrics are the student's samples' (seq_kd: the teacher's)
        student = batch.select(torch.tensor(batch["origin"] == "student").nonzero()[:, 0])
        shown = student if len(student) else batch
        m.update(rollout_metrics(shown))
        if self.samples_due(step):
            self.samples = sample_rows(shown, self.cfg.trainer.log_samples)
        batch.meta["step"] = step
        if d.loss == "reverse_kl":
            batch["token_level_rewards"] = self.kl_shaped_rewards(batch, m)
            with timed(m, "advantages"):
                batch["advantages"] = self.advantages(batch)
            with timed(m, "update_actor"):
                m.update(self.group.update_actor(batch))
        else:
            with timed(m, "update_actor"):
                m.update(self.group.train_distill(batch))
        with timed(m, "sync_weights"):
            m.update(self.source.after_update(step))
        return m

    def distill_batch(self, step: int, m: dict[str, float]) -> Batch:
        """The step's sequences: the student's (reverse_kl, and gkd's λ share), the dataset's
        responses (the rest of gkd's), or the teacher's (seq_kd); ``origin`` says which."""
        d = self.cfg.distill
        if d.loss == "reverse_kl":
            return _origin(self.source.sample(step, m), "student")
        if d.loss == "seq_kd":
            return _origin(self.teacher_source.sample(step, m), "teacher")
        ds = self.train_ds
        prompts = prompt_batch(ds, self.sampler.next_indices(), ds.pad_id)
        cut = round(d.lmbda * len(prompts))
        parts = []
        if cut:
            with timed(m, "generate"):
                out = self.rollout.generate(prompts.slice(0, cut), sampling_params(self.cfg, step))
            parts.append(_origin(out, "student"))
        if cut < len(prompts):
            parts.append(self.answer_batch(prompts.slice(cut, len(prompts)), step))
        batch = pad_prompts(parts)
        with timed(m, "reward"):
            batch["token_level_scores"] = self.score(batch, m)
        return batch

    def dataset_answers(self) -> dict[str, list[int]]:
        """Every training prompt's dataset response as token ids (then EOS), by uid; a row
        without one, or one longer than ``rollout.max_new_tokens``, is an error naming it."""
        cfg, tok = self.cfg, tokenizer(self.cfg)
        key = cfg.data.response_key
        options = text_options(cfg, "data.train_files")
        answers = {}
        for i in range(len(self.train_ds)):
            row = self.train_ds[i]
            if key not in row["row"]:
                raise DataError(
                    f"{row['uid']}: no {key!r} column; distill.loss=gkd with distill.lmbda < 1 "
                    f"trains on the dataset's responses (data.response_key): add them, or set "
                    "distill.lmbda=1"
                )
            ids = response_ids(tok, as_text(row["row"][key]), options)
            if len(ids) > cfg.rollout.max_new_tokens:
                raise DataError(
                    f"{row['uid']}: the {key!r} response is {len(ids)} tokens, more than "
                    f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}: raise it"
                )
            answers[row["uid"]] = ids
        return answers

    def answer_batch(self, prompts: Batch, step: int) -> Batch:
        """``prompts`` answered by their dataset responses, laid out as the student's samples
        (trained on, log-probs 0, the version of the weights now)."""
        version = step - 1
        trajectories = []
        for uid, ids, mask in zip(
            prompts["uid"], prompts["prompts"], prompts["prompt_mask"], strict=True
        ):
            answer = self.answers[uid]
            trajectories.append(
                Trajectory(
                    prompt_ids=ids[mask.bool()].tolist(),
                    token_ids=list(answer),
                    loss_mask=[1] * len(answer),
                    log_probs=[0.0] * len(answer),
                    turns=1,
                    weight_versions=[version],
                    token_versions=[version] * len(answer),
                )
            )
        width = self.rollout.agents.width(sampling_params(self.cfg, step))
        batch = self.rollout.trajectory_batch(
            prompts.select(list(range(len(prompts)))), trajectories, width
        )
        batch["sample_index"] = torch.arange(len(batch))
        return _origin(batch, "dataset")

    def advantages(self, batch: Batch) -> torch.Tensor:
        """reverse_kl: ``distill.coef x -(log π_student - log π_teacher)`` per sampled token
        (the student's: the old policy's when that pass ran, else the rollout's), plus the
        estimator's advantages of the task reward with ``distill.task_reward``."""
        d = self.cfg.distill
        student = batch.tensors.get("old_log_probs", batch["rollout_log_probs"])
        mask = batch["response_mask"].float()
        adv = reverse_kl_advantages(student, batch["teacher_log_probs"], mask, d.coef)
        if d.task_reward:
            task, _ = self.estimator(self.estimator_inputs(batch), self.estimator_settings())
            adv = adv + task
        return adv


def _origin(batch: Batch, origin: str) -> Batch:
    batch["origin"] = [origin] * len(batch)
    return batch


def teacher_metrics(batch: Batch) -> dict[str, float]:
    """On the student's samples: the mean per-token reverse KL to the teacher
    (``log π_student - log π_teacher`` of each sampled token, the rollout's log-probs) and the
    teacher's mean log-prob of them."""
    rows = torch.tensor(batch["origin"] == "student")
    if not rows.any():
        return {}
    mask = batch["response_mask"][rows].float()
    tokens = mask.sum().clamp(min=1)
    teacher = batch["teacher_log_probs"][rows]
    gap = (batch["rollout_log_probs"][rows] - teacher) * mask
    return {
        "distill/reverse_kl": float(gap.sum() / tokens),
        "distill/teacher_log_prob": float((teacher * mask).sum() / tokens),
    }


def distill(cfg: Config) -> dict[str, float]:
    """Run ``treadle distill`` with ``cfg``; returns the last step's metrics."""
    return DistillTrainer(cfg).fit()
