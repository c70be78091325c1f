"""The base of every config section, and the field types several sections share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated, and
    no number may be nan or infinite (pydantic's floats accept them by default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic takes true as 1 for an int or float field; `rollout.n: true` is a mistake
        if isinstance(value, bool) and info.field_name is not None:
            kinds = _kinds(cls.model_fields[info.field_name].annotation)
            if bool not in kinds and kinds & {int, float}:
                raise ValueError(f"expected a number, not {str(value).lower()}")
        return value


def _kinds(annotation: Any) -> set[Any]:
    """The types an annotation admits at its top level (``int | None`` -> {int, NoneType})."""
    return set(get_args(annotation)) | {annotation} if get_args(annotation) else {annotation}


Key = Annotated[str, Field(min_length=1)]  # a column name, a path: never empty
Beta = Annotated[float, Field(ge=0, lt=1)]
Placement = Literal["colocated", "split"]  # a role beside the actor's ranks, or apart


def gpu_memory_field(default: float) -> Any:
    """An inference engine's ``gpu_memory_utilization`` (the rollout's, a frozen model's)."""
    return Field(
        default,
        gt=0,
        le=1,
        description="On CUDA: fraction of GPU memory the vllm engine may take; for the hf "
        "engine, the fraction this process may hold while generating (a batch that needs "
        "more is generated in chunks). No effect on CPU.",
    )


def kv_cache_field() -> Any:
    """An inference engine's ``kv_cache_gib`` (the rollout's, a frozen model's)."""
    return Field(1.0, gt=0, description="vllm engine on CPU: KV cache size, GiB.")


def own_pool_placement_field() -> Any:
    """The ``placement`` of a model trained beside the actor (the critic, PRIME's PRM)."""
    return Field(
        "colocated",
        description="'colocated': on the actor's bundles, taking turns; 'split': its own pool.",
    )


def eval_task_field() -> Any:
    """A preference trainer's ``eval_task`` (dpo's, kto's)."""
    return Field(
        False,
        description="Also evaluate the validation sets (data.val_files as the set val, "
        "data.val_sets; the eval section's sampling, each set's reward; the rows need "
        "data.answer_key): eval/<set>/accuracy, ...",
    )


S = TypeVar("S", bound=Section)


def defaults(section: type[S]) -> Callable[[], S]:
    """The ``default_factory`` of a sub-section: the section with its defaults. (Passing the
    class itself leaves mypy unable to pick from pydantic's two factory signatures.)"""

    def make() -> S:
        return section()

    return make
