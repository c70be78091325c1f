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
  collective of the FSDP group); only rank 0 sends. On NCCL each bucket's bytes go from rank
  0's host to its GPU and from each replica's GPU to its host (the engine loads bytes); a
  replica that dies mid-sync is not survived there (:func:`_nccl_group`).

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
            self.group = _nccl_group(prefixed, rank, world_size, timeout)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (on this member's device) broadcast from rank 0, done: on NCCL the host
        waits for it too (one bucket in flight, its memory given back before the next)."""
        self.group.broadcast(tensor, 0).wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return tensor

    def send(self, payloads: Iterable[bytes]) -> int:
        """Rank 0: broadcast every payload, then the end mark; returns the bytes sent.

        When the group breaks (a replica died), the rest of ``payloads`` is still walked before
        the error is raised: the actor's other ranks gather every tensor with this one."""
        total = 0
        stream = iter(payloads)
        try:
            for payload in stream:
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                self._broadcast(self._length(len(payload)))
                self._broadcast(data.to(self.device))
                total += len(payload)
            self._broadcast(self._length(_END))
        except RuntimeError:
            for _ in stream:
                pass
            raise
        return total

    def receive(self) -> Iterator[bytes]:
        """Ranks 1..R: the payloads rank 0 sends, until its end mark (received on the
        device, then brought to the host once)."""
        while True:
            size = int(self._broadcast(self._length(0)))
            if size == _END:
                return
            data = torch.empty(size, dtype=torch.uint8, device=self.device)
            yield self._broadcast(data).cpu().numpy().tobytes()

    def _length(self, n: int) -> torch.Tensor:
        return torch.tensor([n], dtype=torch.int64, device=self.device)


def _nccl_group(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """The NCCL backend of the group, with ``timeout`` (a plain ``Options()`` has torch's own
    10 minutes, whatever ``timeout_s`` says).

    Unlike gloo's, an NCCL broadcast does not fail promptly when a member dies: the others
    wait until ``timeout``, and then torch's watchdog takes their processes down (its default;
    the actor's rank 0 with them), so the restarts of :mod:`treadle.rollout.fleet.restarts`
    are not reached on GPUs (docs/findings.md, 2026-11-30)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)
