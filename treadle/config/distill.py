"""``teacher`` and ``distill``: the frozen teacher of ``treadle distill`` and its losses."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from treadle.config.base import Section
from treadle.config.frozen import FrozenModelConfig


class TeacherConfig(FrozenModelConfig):
    """The frozen teacher of ``treadle distill``: replicas of an inference engine that score
    the student's samples (per-token log-probs of the sampled tokens, the top-k of each
    position) and, for sequence-level KD, generate. Any Hugging Face causal-LM folder whose
    vocabulary is the student's."""

    role: ClassVar[str] = "teacher"
    key: ClassVar[str] = "teacher"

    model_path: str | None = Field(
        None, description="The teacher model folder (required by treadle distill)."
    )


class DistillConfig(Section):
    """What the student learns from the teacher (``treadle distill``)."""

    loss: Literal["reverse_kl", "gkd", "seq_kd"] = Field(
        "reverse_kl",
        description="'reverse_kl': on-policy distillation, the per-token -(log pi_student - "
        "log pi_teacher) of the student's samples as the advantage of algorithm.policy_loss; "
        "'gkd': the generalized Jensen-Shannon divergence over the teacher's top-k "
        "(Agarwal et al. 2023, TRL's GKDTrainer); 'seq_kd': next-token loss on the teacher's "
        "own samples (sequence-level KD).",
    )
    coef: float = Field(
        1.0, gt=0, description="reverse_kl: weight of the teacher's per-token advantage."
    )
    task_reward: bool = Field(
        False,
        description="reverse_kl: add algorithm.adv_estimator's advantages of the task "
        "reward (reward.function) to the teacher's; false: the teacher's alone (the reward "
        "is still computed and logged).",
    )
    beta: float = Field(
        0.5,
        ge=0,
        le=1,
        description="gkd: the JSD's interpolation; 0 = forward KL(teacher || student), "
        "1 = reverse KL(student || teacher) (TRL's beta).",
    )
    lmbda: float = Field(
        0.5,
        ge=0,
        le=1,
        description="gkd: fraction of each batch's sequences the student generates; the "
        "rest are the dataset's responses (data.response_key) (TRL's lmbda).",
    )
    temperature: float = Field(
        1.0, gt=0, description="gkd: temperature of both distributions in the divergence."
    )
    top_k: int = Field(
        20,
        gt=0,
        description="gkd: the teacher's k most likely tokens at each position, over which "
        "the divergence is taken (both distributions renormalised over them); the "
        "vocabulary size gives TRL's full-vocabulary loss.",
    )
