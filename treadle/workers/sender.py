"""The policy worker's side of a weight sync: the actor's full weights to its rollout.

:class:`SendsWeights` is what :class:`~treadle.workers.actor.ActorRolloutRefWorker` does after
each update: :meth:`~SendsWeights.sync_weights` walks the actor's full tensors
(:mod:`treadle.engines.full_weights`) and hands them to this rank's colocated replica in memory
(``rollout.placement=colocated``), or rank 0 broadcasts them in safetensors buckets to the split
replicas over the weight-sync group (:mod:`treadle.serving.weight_sync`), which
``weight_sync_address`` and ``init_weight_sync`` set up with the replicas'
``join_weight_sync``. The receiving side is :class:`~treadle.serving.replica.ServesRollout`'s
process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from treadle.controller import Collect, Dispatch, free_port, register
from treadle.engines.weights import CastTensors, weight_buckets
from treadle.runtime.precision import rollout_dtype
from treadle.serving.server import RolloutServer
from treadle.serving.weight_sync import WeightSyncGroup
from treadle.workers.base import TrainingWorker

if TYPE_CHECKING:  # imported where an engine is built: the driver does not need FSDP
    from treadle.engines.fsdp import TrainEngine


class SendsWeights(TrainingWorker):
    """Sends ``engine``'s weights to the rollout: this rank's colocated replica (``server``)
    or, from rank 0, the split replicas (``weight_sync``); then the actor and its reference
    (``ref``) wait."""

    server: RolloutServer | None
    ref: TrainEngine | None
    weight_sync: WeightSyncGroup | None = None  # split: rank 0 -> the replicas

    def _wait(self) -> None:
        """Actor and reference wait (the rollout generates next): in host memory with
        ``actor.offload_params``."""
        self.engine.offload()
        if self.ref is not None:
            self.ref.offload()

    @register(Dispatch.ALL, Collect.RANK0)
    def sync_weights(self, version: int) -> int:
        """The actor's full weights to the rollout as ``version``; returns the bytes moved.
        Then the actor waits for the next step (:meth:`_wait`).

        Every rank walks the full tensors (gathering one is a collective). Colocated: each
        rank hands them, cast to the rollout's dtype where they are (on the device), to its own
        replica's engine, one tensor at a time (the hf engine copies each into its weights in
        place; vLLM's cuts them into safetensors buckets). Split: rank 0 broadcasts them in
        buckets. A tied output head goes once, as the embedding (``full_tensors``). vLLM gets
        them as the model's files hold them (``full_state(as_saved=True)``)."""
        moved = self._send_weights(version)
        self._wait()
        return moved

    def _send_weights(self, version: int) -> int:
        r = self.cfg.rollout
        dtype = getattr(torch, rollout_dtype(r.dtype, self.cfg.model.dtype))
        as_saved = r.engine == "vllm"  # vLLM loads the files' format; the hf engine is the model
        if self.server is not None:
            tensors = CastTensors(self.engine.full_state(dtype, as_saved))  # (counts the bytes)
            self.server.update_weights(tensors, version)
            return tensors.bytes
        bucket = max(1, int(r.weight_sync_bucket_mb * (1 << 20)))
        buckets = weight_buckets(self.engine.full_state(dtype, as_saved), bucket, dtype)
        if self.weight_sync is not None:
            return self.weight_sync.send(buckets)
        for _ in self.engine.full_state():  # ranks > 0 of split: join the gathers only
            pass
        return 0

    @register(Dispatch.ALL, Collect.RANK0)
    def weight_sync_address(self) -> tuple[str, int]:
        """Where rank 0 will listen for the weight-sync group: its node's address, a free port."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    @register(Dispatch.ALL, Collect.RANK0)
    def init_weight_sync(self, addr: str, port: int, world_size: int) -> None:
        """Rank 0 joins the weight-sync group as its rank 0 (the replicas join as 1..R)."""
        if self.rank == 0:
            self.weight_sync = WeightSyncGroup(addr, port, 0, world_size)
