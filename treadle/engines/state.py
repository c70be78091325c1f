"""A training engine's optimizer state on disk: safetensors and JSON, no pickle.

:func:`save_optimizer` gathers the sharded AdamW state to rank 0 and writes its tensors as
``optimizer.safetensors`` and its parameter groups and learning-rate schedule as
``optimizer.json``; :func:`save_schedule` writes the schedule alone (``trainer.save_optimizer
=false``); :func:`load_optimizer` reads either back into the sharded optimizer.
"""

from __future__ import annotations

import json
import logging
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
    """What :func:`save_optimizer` (or :func:`save_schedule`) wrote, into the sharded optimizer."""
    meta = json.loads((path / "optimizer.json").read_text())
    if not (path / "optimizer.safetensors").is_file():
        log.warning(
            "%s holds no optimizer state (trainer.save_optimizer=false): the optimizer "
            "starts afresh",
            path,
        )
        _load_scheduler(scheduler, meta)
        return
    tensors = load_file(str(path / "optimizer.safetensors"))
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        fqn, _, name = key.rpartition("::")
        state.setdefault(fqn, {})[name] = value
    for group in meta["param_groups"]:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    osd = {"state": state, "param_groups": meta["param_groups"]}
    set_optimizer_state_dict(module, optimizer, osd, options=StateDictOptions(full_state_dict=True))
    _load_scheduler(scheduler, meta)
    dist.barrier()


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
