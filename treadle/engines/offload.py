"""Weights and optimizer moments in host memory while an engine waits: verl's ``param_offload``
and ``optimizer_offload`` (``actor.offload_params``, ``actor.offload_optimizer``).

On one GPU the actor, its reference, a critic and the rollout engine share the card, and most
of a step each of them waits while another computes. A float32 model of N parameters holds 4N
bytes of weights, and AdamW 8N more of moments (a 1.5B model: 6 and 12 GB); generation's KV
cache, the reference's pass and the update's activations could have that memory.

- **Weights** (:meth:`Residence.weights_out`): the FSDP2 module moved to host memory whole,
  buffers with it (FSDP2 takes ``module.cpu()``: it reshards first and re-registers each
  parameter's local shard, the same parameter objects, so the optimizer's keys hold). They
  come back at the engine's next use (:meth:`Residence.weights_in`), which every entry point of
  :class:`~treadle.engines.fsdp.TrainEngine` calls first; a worker says when its engine waits
  (the actor after its weight sync, the reference after each pass, a critic after each of its
  calls).
- **Moments** (:meth:`Residence.moments_out`): after every optimizer step, back just before the
  next; forwards and backwards run without them.

A move costs a copy each way over the host link (PCIe, ~25 GB/s: a 1.5B model's weights and
moments together, 18 GB, about 1.5 s a step); off by default, as in verl. The caching
allocator's freed blocks go back to the driver (``empty_cache``), so an engine outside torch's
allocator (vLLM's sleep-mode pool) sees the memory too. On a CPU host and device are the same
memory and nothing moves.

The transformers rollout engine's weights (:class:`HostCopy`) sleep in host memory too, where
its server puts it to sleep (colocated on CUDA, between generations, as vLLM's sleep level 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn


class Residence:
    """Where one engine's weights (``params``: they may leave) and its optimizer's moments
    (``moments``: they may leave) are. A reference view of a LoRA engine shares the actor's
    (the same module): one residence, not two."""

    def __init__(self, module: nn.Module, params: bool, moments: bool) -> None:
        self.module = module
        self.home = next(iter(module.parameters())).device  # where FSDP2 put them
        self.params, self.moments = params, moments
        self.weights_away = False

    def weights_out(self) -> None:
        """The weights and buffers to host memory, when ``params``; until :meth:`weights_in`."""
        if not self.params or self.weights_away:
            return
        self.module.cpu()
        self.weights_away = True
        _release()

    def weights_in(self) -> None:
        """The weights and buffers back on the device, if :meth:`weights_out` moved them."""
        if self.weights_away:
            self.module.to(self.home)
            self.weights_away = False

    def moments_out(self, optimizer: torch.optim.Optimizer) -> None:
        """Every tensor of the optimizer's state (AdamW's moments and step count) to host
        memory, when ``moments``; until :meth:`moments_in`."""
        if self.moments:
            _move_state(optimizer, lambda t: t.cpu())
            _release()

    def moments_in(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's state back on the device (where its parameters are)."""
        if self.moments:
            _move_state(optimizer, lambda t: t.to(self.home, non_blocking=True))


def _move_state(optimizer: torch.optim.Optimizer, move: Callable[[Tensor], Tensor]) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, Tensor):
                state[key] = move(value)


def _release() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class HostCopy:
    """A rollout engine's weights in host memory while it sleeps: each tensor's data swapped
    for a pinned host copy (the same tensor objects: a tied head stays tied, and a weight sync
    while asleep writes into the copies), swapped back on the device at :meth:`wake`.

    The copies stay after a wake, and a sleep that follows no weight change since
    (:meth:`changed`) only lets the device's go: with the weights synced while asleep, a step
    moves them once, host to device, besides the sync's own device-to-host copy."""

    def __init__(self, tensors: Iterable[Tensor]) -> None:
        self.tensors = list({id(t): t for t in tensors}.values())  # tied: one copy
        self.home = self.tensors[0].device
        self.host: list[Tensor] = []  # made at the first sleep
        self.current = False  # the copies hold the weights as they are
        self.asleep = False

    def sleep(self) -> None:
        """The weights to host memory (a copy only where :meth:`changed` since the last)."""
        if self.asleep:
            return
        if not self.host:
            pin = self.home.type == "cuda"
            self.host = [torch.empty_like(t, device="cpu", pin_memory=pin) for t in self.tensors]
        if not self.current:
            for host, t in zip(self.host, self.tensors, strict=True):
                host.copy_(t)
        for host, t in zip(self.host, self.tensors, strict=True):
            t.data = host
        self.asleep = self.current = True

    def wake(self) -> None:
        """The weights back on the device."""
        if self.asleep:
            for host, t in zip(self.host, self.tensors, strict=True):
                t.data = host.to(self.home, non_blocking=True, copy=True)
            self.asleep = False

    def changed(self) -> None:
        """The device's weights changed while awake: the next sleep copies them."""
        if not self.asleep:
            self.current = False
