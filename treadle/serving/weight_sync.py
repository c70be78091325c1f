"""Weights from the actor to the rollout replicas, in buckets, without a file.

A weight update is a stream of ``(HF name, full tensor)`` pairs gathered one parameter at a time
from the FSDP2 actor (:meth:`~treadle.engines.fsdp.TrainEngine.full_state`). It is cut into
buckets of about ``rollout.weight_sync_bucket_mb`` (:func:`treadle.engines.weights.weight_buckets`);
each bucket travels as safetensors bytes, so names, shapes and dtypes travel with the data and
nothing is unpickled on arrival.

- **Colocated** (the replica lives in the actor rank's process): the buckets go straight into the
  engine, a copy in memory.
- **Split** (replicas in processes of their own, on other devices or nodes): a
  torch.distributed process group of its own joins the actor's rank 0 (group rank 0) and every
  replica (group ranks 1..R), made from a ``TCPStore`` on rank 0's node, gloo on CPU and NCCL on
  GPU, as verl, slime and OpenRLHF do. It is not the default group, so the actor's FSDP group and
  vLLM's own are untouched. Rank 0 broadcasts each bucket as a length, then the bytes; a length
  of 0 ends the update. Every actor rank walks the stream (gathering a full tensor is a
  collective of the FSDP group); only rank 0 sends.

Each update carries a version number, chosen by the driver (the step whose update it is); the
replica stamps every response with the version of the weights that produced it.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from treadle.controller import tcp_store

_END = 0


class WeightSyncGroup:
    """One end of the actor-to-replicas process group (rank 0: the actor's rank 0).

    Every member must construct it at about the same time (the constructor is a rendezvous):
    the driver starts the replicas' calls, then the actor's, then waits for all.
    """

    def __init__(
        self,
        addr: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        timeout_s: float = 600.0,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = tcp_store(addr, port, world_size, rank, timeout)
        prefixed = dist.PrefixStore("treadle-weight-sync", store)
        self._store = store  # the master's server lives as long as this object
        self.group: Any
        if self.device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(
                prefixed, rank, world_size, dist.ProcessGroupNCCL.Options()
            )
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            tensor = tensor.to(self.device)
        self.group.broadcast(tensor, 0).wait()
        return tensor.cpu()

    def send(self, payloads: Iterable[bytes]) -> int:
        """Rank 0: broadcast every payload, then the end mark; returns the bytes sent.

        When the group breaks (a replica died), the rest of ``payloads`` is still walked before
        the error is raised: the actor's other ranks gather every tensor with this one."""
        total = 0
        stream = iter(payloads)
        try:
            for payload in stream:
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                self._broadcast(torch.tensor([len(payload)], dtype=torch.int64))
                self._broadcast(data)
                total += len(payload)
            self._broadcast(torch.tensor([_END], dtype=torch.int64))
        except RuntimeError:
            for _ in stream:
                pass
            raise
        return total

    def receive(self) -> Iterator[bytes]:
        """Ranks 1..R: the payloads rank 0 sends, until its end mark."""
        while True:
            size = int(self._broadcast(torch.zeros(1, dtype=torch.int64)))
            if size == _END:
                return
            yield self._broadcast(torch.empty(size, dtype=torch.uint8)).numpy().tobytes()
