"""``teacher`` and ``distill``: the frozen teacher of ``treadle distill`` and its losses."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from treadle.config.base import Section


class TeacherConfig(Section):
    """The frozen teacher of ``treadle distill``: replicas of an inference engine that score
    the student's samples (per-token log-probs of the sampled tokens, the top-k of each
    position) and, for sequence-level KD, generate. Any Hugging Face causal-LM folder whose
    vocabulary is the student's."""

    model_path: str | None = Field(
        None, description="The teacher model folder (required by treadle distill)."
    )
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="Inference engine of the teacher replicas ('vllm' needs placement=split: "
        "one vLLM engine per process).",
    )
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="Weight dtype of the teacher engine (null: model.dtype)."
    )
    placement: Literal["colocated", "split"] = Field(
        "colocated",
        description="'colocated': a teacher engine in each actor rank's process, taking turns "
        "with training; 'split': teacher.replicas Ray actors in a resource pool of their own "
        "(on other nodes as rollout replicas are).",
    )
    replicas: int | None = Field(
        None,
        gt=0,
        description="split: teacher replicas (null: 1); colocated: one per actor rank.",
    )
    cpus_per_replica: float = Field(
        1.0, gt=0, description="split: CPUs reserved for each teacher replica."
    )
    gpus_per_replica: float = Field(
        0.0, ge=0, description="split: GPUs reserved for each teacher replica."
    )
    micro_batch_size: int = Field(
        32, gt=0, description="hf engine: sequences per scoring forward / generate call."
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="vllm engine on CPU: KV cache, GiB.")
    gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        le=1,
        description="On CUDA: fraction of GPU memory the vllm engine may take; for the hf "
        "engine, the fraction this process may hold while generating (a batch that needs "
        "more is generated in chunks). No effect on CPU.",
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
