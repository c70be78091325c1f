"""The base of every role's worker: one opening, and the checkpoints of a trained engine.

:class:`RoleWorker` is what every worker (the policy, the critic, the reward models, PRIME's
PRM) does before building its engines, in this order: the thread count (once, before
anything computes; a Ray actor otherwise gets one thread per core of the node), the device
and the torch.distributed process group (:class:`~treadle.controller.Worker`), the run's
config, and the role's parallel layout (:meth:`RoleWorker.parallel_sizes`: tensor- and
sequence-parallel groups, their device meshes, the shard of a batch this rank reads).
Nothing here seeds a random generator: the engines are built from saved weights, LoRA's
initial adapters are seeded by :func:`~treadle.models.loading.apply_lora` itself, and a resumed run
restores every rank's RNG state from its checkpoint.

:class:`TrainingWorker` adds what every role that trains one engine declares the same way:
``save_checkpoint`` and ``load_checkpoint`` of ``self.engine`` with ``self.tokenizer``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from treadle.config import Config
from treadle.controller import Collect, Dispatch, Worker, register
from treadle.engines.parallel import Layout, Meshes
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.runtime.memory import keep_heap
from treadle.runtime.startup import PartTimer

if TYPE_CHECKING:  # imported where an engine is built: the driver does not need FSDP
    from treadle.engines.fsdp import TrainEngine


class RoleWorker(Worker):
    """Threads, device, process group and config: the opening every role's worker shares.

    A role builds its engines in :meth:`setup`, which takes the role's own keyword arguments
    (the worker group's ``kwargs`` beside ``config`` and ``threads``): a keyword it does not
    take is an error. ``startup`` times the construction's parts (``process_group`` here; a
    role adds its own, reported by :meth:`~treadle.controller.Worker.startup_seconds`)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        *,
        config: Config,
        threads: int = 1,
        **role: Any,
    ) -> None:
        torch.set_num_threads(threads)
        keep_heap()  # an update's activations reuse the last one's pages (treadle.runtime.memory)
        self.startup = PartTimer()
        super().__init__(rank, world_size, master_addr, master_port)
        self.cfg = config
        # Tensor- or sequence-parallel groups of consecutive ranks read the same shard.
        tp, sp = self.parallel_sizes()
        self.layout = Layout(world_size, tp, sp)
        self.dp_rank, self.collects = self.layout.data_parallel(rank)
        self.meshes = Meshes(self.layout, self.device.type) if tp * sp > 1 else None
        self.startup.done("process_group")
        self._startup_parts = self.startup.parts
        self.setup(**role)

    setup: Callable[..., None]
    """Builds the role's engines; a role defines it with its own keyword arguments."""

    parallel_section: str | None = None
    """The config section (``actor``, ``critic``) whose parallel sizes lay the role out."""

    def parallel_sizes(self) -> tuple[int, int]:
        """``(tensor_parallel_size, sequence_parallel_size)`` of this role (default: 1, 1)."""
        if self.parallel_section is None:
            return 1, 1
        section = getattr(self.cfg, self.parallel_section)
        return section.tensor_parallel_size, section.sequence_parallel_size

    def load_tokenizer(self, path: str | None = None) -> Any:
        """The run's tokenizer: ``model.tokenizer_path``, else the one at ``path`` (default:
        ``model.path``)."""
        m = self.cfg.model
        return load_tokenizer(m.tokenizer_path or path or m.path, allow_download=m.allow_download)

    def load_lm(self, path: str, key: str = "model.path") -> nn.Module:
        """The causal LM at ``path`` (``key``: the config key that named it, for an error) in
        ``model.dtype``, on the host: FSDP2 moves it to this worker's device one unit (decoder
        layer) at a time as it shards it (:func:`~treadle.engines.fsdp.shard_model`), so no
        rank's device holds the whole model (moved whole first, a float32 7B model takes 28 GB
        of every rank's GPU at start-up, whatever the rank count)."""
        m = self.cfg.model
        model: nn.Module = load_causal_lm(path, m.dtype, key=key, allow_download=m.allow_download)
        return model


class TrainingWorker(RoleWorker):
    """A role that trains one engine (``engine``) and saves it with ``tokenizer``."""

    engine: TrainEngine
    tokenizer: Any

    @register(Dispatch.ALL, Collect.RANK0)
    def save_checkpoint(self, path: str, with_optimizer: bool = True) -> None:
        """The model as an HF folder ``path/model`` (LoRA: the adapters only) by rank 0, the
        optimizer gathered (unless trainer.save_optimizer=false), RNG per rank."""
        from treadle.engines.checkpoint import save_checkpoint  # (where an engine was built)

        with_optimizer = with_optimizer and self.cfg.trainer.save_optimizer
        save_checkpoint(self.engine, Path(path), self.rank, self.tokenizer, with_optimizer)

    @register(Dispatch.ALL, Collect.RANK0)
    def load_checkpoint(self, path: str) -> None:
        """Optimizer and RNG (LoRA: and the adapters); the weights were loaded at start from
        ``path/model``."""
        from treadle.engines.checkpoint import load_checkpoint

        load_checkpoint(self.engine, Path(path), self.rank)
