"""A training engine's optimizer and random state on disk: safetensors and JSON, no pickle.

:func:`save_optimizer` gathers the sharded AdamW state to rank 0 and writes its tensors as
``optimizer.safetensors`` and its parameter groups and learning-rate schedule as
``optimizer.json``; :func:`save_schedule` writes the schedule alone (``trainer.save_optimizer
=false``); :func:`load_optimizer` reads either back into the sharded optimizer.
:func:`save_rng_state` and :func:`load_rng_state`: each rank's random state, so a resumed run
draws what the run it resumes would have.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from treadle.models.checkpoint import CheckpointError

log = logging.getLogger("treadle")


def save_optimizer(
    module: Any, optimizer: Optimizer, scheduler: LambdaLR, path: Path, rank: int
) -> None:
    """Gather the optimizer state to rank 0 and write it as safetensors + JSON (no pickle)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    osd: Any = get_optimizer_state_dict(module, optimizer, options=options)
    if rank != 0:
        return
    tensors = {
        f"{fqn}::{key}": value.contiguous()
        for fqn, state in osd["state"].items()
        for key, value in state.items()
    }
    groups = [{k: v for k, v in g.items()} for g in osd["param_groups"]]
    save_file(tensors, str(path / "optimizer.safetensors"))
    meta = {"param_groups": groups, "scheduler": scheduler.state_dict()}
    (path / "optimizer.json").write_text(json.dumps(meta, default=_jsonable))


def save_schedule(scheduler: LambdaLR, path: Path) -> None:
    """The learning-rate schedule alone (a checkpoint without optimizer state)."""
    meta = {"scheduler": scheduler.state_dict()}
    (path / "optimizer.json").write_text(json.dumps(meta, default=_jsonable))


def load_optimizer(module: Any, optimizer: Optimizer, scheduler: LambdaLR, path: Path) -> None:
    """What :func:`save_optimizer` (or :func:`save_schedule`) wrote, into the sharded optimizer.

    Rank 0 alone reads ``optimizer.safetensors`` (two float32 copies of the model) and
    broadcasts it a tensor at a time, each rank keeping its shard: every rank reading it
    would hold the whole file in host memory at once (8 ranks of a node resuming a 7B model:
    ~450 GB)."""
    meta = json.loads((path / "optimizer.json").read_text())
    if not (path / "optimizer.safetensors").is_file():
        log.warning(
            "%s holds no optimizer state (trainer.save_optimizer=false): the optimizer "
            "starts afresh",
            path,
        )
        _load_scheduler(scheduler, meta)
        return
    osd = rank0_reads(lambda: _full_optimizer_state(path, meta))
    # not strict: a trainable parameter that never had a gradient (a vision tower on text
    # alone) has no saved state and keeps a fresh one; strict, torch raises on rank 0 alone
    # (the only rank holding the state), while the others wait in its broadcast.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_optimizer_state_dict(module, optimizer, osd, options=options)
    _load_scheduler(scheduler, meta)
    dist.barrier()


def _full_optimizer_state(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(path / "optimizer.safetensors")).items():
        fqn, _, name = key.rpartition("::")
        state.setdefault(fqn, {})[name] = value
    for group in meta["param_groups"]:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": meta["param_groups"]}


def rank0_reads(read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``read()`` on rank 0 (``{}`` on the others, for a ``broadcast_from_rank0`` load); an
    error there is raised on every rank, which would otherwise wait for rank 0's broadcast
    until the group's timeout."""
    value: dict[str, Any] = {}
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            value = read()
        except Exception as e:  # raised below, on every rank
            error = e
    said = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(said, src=0)
    if error is not None:
        raise error
    if said[0] is not None:
        raise CheckpointError(f"rank 0 could not read the checkpoint: {said[0]}")
    return value


def _load_scheduler(scheduler: LambdaLR, meta: dict[str, Any]) -> None:
    """The saved step count, and the lr of the next step from this run's schedule at it: the
    same as saved when the run is resumed as it was, the new one's when its length changed
    (``trainer.total_steps`` raised: a decay then ends at the new last step)."""
    scheduler_state = meta["scheduler"]
    scheduler_state.pop("lr_lambdas", None)
    scheduler.load_state_dict({**scheduler.state_dict(), **scheduler_state})
    step = scheduler.last_epoch
    lrs = [base * f(step) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (LambdaLR's own step sets it so)


def _jsonable(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return str(value)


def save_rng_state(out: Path, rank: int) -> None:
    """This rank's random state into the checkpoint ``out``: the CPU generator's (``torch``)
    and, on a GPU, the GPU's (``cuda``), which a GPU's dropout (LoRA's among them) draws from."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    save_file(state, str(out / f"rng_rank{rank}.safetensors"))


def load_rng_state(out: Path, rank: int) -> None:
    """This rank's random state from the checkpoint ``out``; its GPU part where both it and a
    GPU are here (a checkpoint saved on a CPU resumes on a GPU, and the other way round)."""
    rng = out / f"rng_rank{rank}.safetensors"
    if not rng.is_file():
        raise CheckpointError(
            f"{rng} is missing: the checkpoint was saved by fewer ranks, or damaged; "
            "resume with the same actor.world_size, or set trainer.resume=false"
        )
    state = load_file(str(rng))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
