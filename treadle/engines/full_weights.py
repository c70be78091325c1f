"""A sharded model's full weights, out and in: one tensor at a time, never the whole model twice.

:func:`full_tensors` gathers each parameter and buffer of an FSDP2 (or tensor-parallel) module
to its full tensor, one at a time, every rank taking part; :func:`model_tensors` names them as
the Hugging Face model does (LoRA merged in; floats cast as they go; laid out as its files are,
for vLLM): what a weight sync sends (:mod:`treadle.engines.weights`) and a checkpoint writes
(:mod:`treadle.engines.checkpoint`). :func:`load_full_weights` reads an HF folder back into the
sharded module, rank 0 reading the files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from treadle.engines.lora import lora_scalings, merged_lora
from treadle.engines.state import rank0_reads
from treadle.engines.weights import CastTensors
from treadle.models.checkpoint import CheckpointError
from treadle.models.loading import checkpoint_format, has_weight_conversions, load_causal_lm
from treadle.runtime.errors import ConfigError


def full_tensors(
    module: nn.Module, prefix: str = "lm.", only: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) one parameter/buffer at a time; all ranks must iterate.

    ``only``: the names (before removing ``prefix``) to yield; the others are not gathered. A
    tensor under two names (a tied output embedding: ``lm_head.weight`` is the embedding's
    parameter) is gathered and yielded once, under its first name: the state dict lists it
    twice, and a weight sync or a save gathered the embedding twice."""
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen or (only is not None and not only(name)):
            continue
        seen.add(id(tensor))
        local = tensor.detach()
        yield (
            name.removeprefix(prefix),
            local.full_tensor() if isinstance(local, DTensor) else local,
        )


Named = tuple[str, torch.Tensor]


def model_tensors(
    module: nn.Module, lora: bool, dtype: torch.dtype | None = None, as_saved: bool = False
) -> Iterator[Named]:
    """The full tensors of the model ``module`` holds as ``.lm``, under its HF names (``lora``:
    merged into the base weights); ``dtype``: floats cast to it as each is gathered;
    ``as_saved``: then named and laid out as ``save_pretrained`` writes them, which is what
    vLLM loads (`checkpoint_format`: a mixture of experts' fused experts, one per expert, a
    layer held at a time)."""
    lm: Any = module.lm
    state: Iterator[Named] = full_tensors(module)
    if lora:
        state, lm = merged_lora(state, lora_scalings(lm)), lm.get_base_model()
    if dtype is not None:
        state = iter(CastTensors(state, dtype))
    return checkpoint_format(lm, state) if as_saved else state


def load_full_weights(module: nn.Module, folder: Path, prefix: str = "lm.") -> None:
    """The weights of the HF folder ``folder`` (its ``*.safetensors``) into the sharded
    ``module``. Rank 0 alone reads the files and sends them a tensor at a time, each rank
    keeping its shard (every rank reading them held the whole model in host memory at once);
    a model whose files differ from its parameters (a mixture of experts' fused experts, see
    `checkpoint_format`) is read through transformers, which converts them.
    A tensor the module lacks, or a parameter the folder lacks (but a tied output embedding,
    stored once), is a CheckpointError, on every rank."""

    lm = getattr(module, prefix.rstrip("."), None)

    def read() -> dict[str, Any]:  # (set_model_state_dict's value type)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder} holds no *.safetensors weights")
        state: dict[str, Any] = {}
        if lm is not None and has_weight_conversions(lm):  # the files are not as the model
            dtype = next(iter(module.parameters())).dtype
            try:
                loaded = load_causal_lm(folder, dtype, key=str(folder))
            except ConfigError as e:
                raise CheckpointError(f"{e}: is it the run's model?") from None
            state.update({prefix + k: v for k, v in loaded.state_dict().items()})
        else:
            for f in files:
                state.update({prefix + k: v for k, v in load_file(str(f)).items()})
        names = set(module.state_dict())
        tied = bool(getattr(getattr(lm, "config", None), "tie_word_embeddings", False))
        missing = names - set(state) - ({f"{prefix}lm_head.weight"} if tied else set())
        unknown = set(state) - names
        if missing or unknown:
            raise CheckpointError(
                f"{folder} does not hold this model's weights (missing: "
                f"{sorted(missing)[:3]}, unknown: {sorted(unknown)[:3]}): is it the run's model?"
            )
        return state

    options = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=True)
    set_model_state_dict(module, rank0_reads(read), options=options)
