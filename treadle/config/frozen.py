"""The settings a frozen model served by replicas beside the actors shares, whichever it is:
the ``teacher`` of ``treadle distill`` and the LLM judge of ``reward.judge``
(:mod:`treadle.rollout.frozen` serves both)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from treadle.config.base import Placement, Section, gpu_memory_field, kv_cache_field


class FrozenModelConfig(Section):
    """The replicas serving a frozen model, the teacher or the judge alike: their engine,
    placement and memory."""

    # a section names itself in its descriptions: "{role}" and "{key}" stand for these
    role: ClassVar[str] = "frozen model"
    key: ClassVar[str] = "frozen"

    model_path: str | None = Field(None, description="The {role}'s model folder.")
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="Inference engine of the {role} replicas ('vllm' needs placement=split: "
        "one vLLM engine per process).",
    )
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="Weight dtype of the {role} engine (null: model.dtype)."
    )
    placement: Placement = Field(
        "colocated",
        description="'colocated': a {role} engine in each actor rank's process, taking turns "
        "with training; 'split': {key}.replicas Ray actors in a resource pool of their own "
        "(on other nodes as rollout replicas are).",
    )
    replicas: int | None = Field(
        None,
        gt=0,
        description="split: {role} replicas (null: 1); colocated: one per actor rank.",
    )
    cpus_per_replica: float = Field(
        1.0, gt=0, description="split: CPUs reserved for each {role} replica."
    )
    gpus_per_replica: float = Field(
        0.0, ge=0, description="split: GPUs reserved for each {role} replica."
    )
    micro_batch_size: int = Field(
        32, gt=0, description="hf engine: sequences per scoring forward / generate call."
    )
    kv_cache_gib: float = kv_cache_field()
    gpu_memory_utilization: float = gpu_memory_field(0.3)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for name, field in cls.model_fields.items():
            if name in FrozenModelConfig.model_fields and field.description:
                field.description = field.description.replace("{role}", cls.role).replace(
                    "{key}", cls.key
                )
        cls.model_rebuild(force=True)  # the JSON schema reads the descriptions as rebuilt
