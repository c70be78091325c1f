"""One training engine's part of a run's checkpoint: its model, optimizer and random state.

:func:`save_checkpoint` writes a :class:`~treadle.engines.fsdp.TrainEngine` into a step's
folder (the run's folder, its seal and ``state.json``: :mod:`treadle.models.checkpoint`): the
model as a Hugging Face folder ``model/`` by rank 0 (LoRA: the adapters only, ``adapter/``),
the optimizer and schedule (:mod:`treadle.engines.state`) and each rank's RNG state.
:func:`load_checkpoint` reads it back into an engine built from ``model/`` (a resume);
:func:`load_weights` reads the model alone (evaluating a run's checkpoints). Every rank calls
each: the full tensors are collectives.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from treadle.engines.full_weights import full_tensors, load_full_weights
from treadle.engines.lora import is_adapter, load_adapters
from treadle.engines.state import (
    load_optimizer,
    load_rng_state,
    save_optimizer,
    save_rng_state,
    save_schedule,
)
from treadle.models.checkpoint import CheckpointError
from treadle.models.loading import ADAPTER_DIR, save_adapter, save_hf_folder
from treadle.runtime.faults import failpoint

if TYPE_CHECKING:
    from treadle.engines.fsdp import TrainEngine


def save_checkpoint(
    engine: TrainEngine, out: Path, rank: int, tokenizer: Any, with_optimizer: bool = True
) -> None:
    """``out/model`` (an HF folder, written by rank 0; LoRA: ``out/adapter``, the adapters
    only), the optimizer gathered to rank 0 (unless not ``with_optimizer``: then the
    learning-rate schedule alone), this rank's RNG state."""
    out.mkdir(parents=True, exist_ok=True)
    engine.residence.weights_in()
    module = engine.module
    if engine.lora:
        adapters = {
            name.replace(".default.", "."): t.cpu().clone()
            for name, t in full_tensors(module, only=is_adapter)
            if rank == 0
        }
        if rank == 0:
            save_adapter(adapters, module.lm.peft_config["default"], tokenizer, out / ADAPTER_DIR)
    else:
        state = {name: t.cpu().clone() for name, t in engine.full_state() if rank == 0}
        if rank == 0:
            step = out.name.removesuffix(".tmp").removeprefix("step_")  # step_<N>.tmp
            weights = out / "model" / "model.safetensors"
            failpoint("write", int(step) if step.isdigit() else 0, weights)
            save_hf_folder(state, module.lm.config, tokenizer, out / "model")
    optimizer, scheduler = engine.optimizer, engine.scheduler
    assert optimizer is not None and scheduler is not None
    if with_optimizer:  # (gathered over the ranks where the moments are at home)
        engine.residence.moments_in(optimizer)
        save_optimizer(module, optimizer, scheduler, out, rank)
        engine.residence.moments_out(optimizer)
    elif rank == 0:
        save_schedule(scheduler, out)
    save_rng_state(out, rank)
    dist.barrier()


def load_checkpoint(engine: TrainEngine, out: Path, rank: int) -> None:
    """The optimizer, schedule and RNG state :func:`save_checkpoint` wrote to ``out``; the
    weights were loaded at start (LoRA: the base model's; the adapters are loaded here)."""
    engine.residence.weights_in()  # (the optimizer's state is loaded where the parameters are)
    if engine.lora:
        load_adapters(engine.module, out / ADAPTER_DIR)
    elif (out / ADAPTER_DIR).is_dir():
        raise CheckpointError(
            f"{out} holds LoRA adapters (adapter/): resume it with the run's "
            "actor.lora.rank, or set trainer.resume=false"
        )
    assert engine.optimizer is not None and engine.scheduler is not None
    load_optimizer(engine.module, engine.optimizer, engine.scheduler, out)
    engine.residence.moments_out(engine.optimizer)
    load_rng_state(out, rank)


def load_weights(engine: TrainEngine, out: Path) -> None:
    """The model weights of the checkpoint ``out`` (``model/``; LoRA: ``adapter/``), not its
    optimizer or RNG: for evaluating a run's checkpoints one after another."""
    engine.residence.weights_in()
    if engine.lora:
        load_adapters(engine.module, out / ADAPTER_DIR)
    elif (out / "model").is_dir():
        load_full_weights(engine.module, out / "model")
    else:
        raise CheckpointError(
            f"{out} holds LoRA adapters (adapter/), not a model/: evaluate it with the "
            "run's actor.lora"
        )
