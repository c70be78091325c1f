"""A LoRA engine's weights: adapters merged into full tensors, and adapters loaded back.

A LoRA actor (a peft model, :func:`treadle.models.loading.apply_lora`) trains its adapters only. The
rollout engines and exported models want plain weights under the base model's names:
:func:`merged_lora` turns the sharded peft model's full tensors into ``W + scaling * B @ A``,
one layer at a time. A checkpoint holds the adapters alone (a peft folder); on resume
:func:`load_adapters` puts them back into the sharded model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from treadle.models.checkpoint import CheckpointError

PEFT_PREFIX = "base_model.model."  # what peft puts before the wrapped model's names


def is_lora(lm: Any) -> bool:
    """Whether ``lm`` is a peft model (LoRA adapters on a base model)."""
    return hasattr(lm, "peft_config") and hasattr(lm, "disable_adapter")


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (``lora_A`` or ``lora_B``)."""
    return ".lora_A." in name or ".lora_B." in name


def lora_scalings(lm: Any) -> dict[str, float]:
    """Each LoRA layer's ``scaling`` (alpha / rank), by its module name without peft's prefix."""
    return {
        name.removeprefix(PEFT_PREFIX): float(m.scaling["default"])
        for name, m in lm.named_modules()
        if isinstance(getattr(m, "scaling", None), dict) and "default" in m.scaling
    }


def merged_lora(
    state: Iterator[tuple[str, torch.Tensor]], scalings: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft model's full tensors as the base model's: ``W + scaling * B @ A`` under ``W``'s
    name (``...q_proj.weight``), other tensors renamed only. Holds one layer's W, A, B at most."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for peft_name, tensor in state:
        name = peft_name.removeprefix(PEFT_PREFIX)
        module, _, part = name.rpartition(".")
        if module.endswith((".lora_A.default", ".lora_B.default")):
            layer, which = module[: -len(".lora_A.default")], module[-len("A.default")]
        elif module.endswith(".base_layer") and part == "weight":
            layer, which = module.removesuffix(".base_layer"), "W"
        else:  # a base layer's bias, or a layer without adapters
            yield name.replace(".base_layer.", "."), tensor
            continue
        got = pending.setdefault(layer, {})
        got[which] = tensor
        if len(got) == 3:
            del pending[layer]
            w, a, b = got["W"], got["A"], got["B"]
            delta = (b.float() @ a.float()) * scalings[layer]
            yield f"{layer}.weight", (w.float() + delta).to(w.dtype)
    if pending:  # (apply_lora refuses an adapter on the output head: tied, its W is the embedding)
        raise RuntimeError(f"LoRA adapters without their base weight: {sorted(pending)}")


def load_adapters(module: Any, folder: Path) -> None:
    """The adapter weights of a peft folder (:func:`~treadle.models.loading.save_adapter`) into the
    sharded LoRA model ``module`` (an FSDP2 root holding it as ``.lm``); every rank reads the
    file."""
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise CheckpointError(
            f"{weights} is missing: the checkpoint was written without LoRA; resume it "
            "with actor.lora.rank=0, or set trainer.resume=false"
        )
    saved = load_file(str(weights))
    state_dict: dict[str, Any] = {
        "lm." + re.sub(r"\.(lora_[AB])\.", r".\1.default.", k): v for k, v in saved.items()
    }
    shapes = module.state_dict()
    if set(state_dict) != {name for name in shapes if is_adapter(name)}:
        raise CheckpointError(
            f"{weights} holds other adapters than actor.lora makes (rank or "
            "target_modules changed?): resume with the run's actor.lora, or set "
            "trainer.resume=false"
        )
    for name, value in state_dict.items():
        if tuple(shapes[name].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{weights}: {name} has shape {tuple(value.shape)}, actor.lora makes "
                f"{tuple(shapes[name].shape)}: resume with the run's actor.lora.rank"
            )
    set_model_state_dict(
        module, state_dict, options=StateDictOptions(full_state_dict=True, strict=False)
    )
