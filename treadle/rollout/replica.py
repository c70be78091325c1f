"""The rollout role: an inference engine serving requests, and how weights reach it.

:class:`RolloutReplica` is a rollout replica of its own (``rollout.placement=split``): a Ray
actor, in a resource pool apart from the actor's, owning one inference engine behind a
:class:`~treadle.rollout.server.RolloutServer`. It is an asynchronous Ray actor, so thousands of
requests can be in flight while the engine batches them, stepped in the actor's one thread.
Its weights come from the actor's rank 0 over a process group of their own
(:mod:`treadle.rollout.weight_sync`).

Colocated (``rollout.placement=colocated``), each actor rank's process holds the server instead
(:class:`~treadle.workers.actor.ActorRolloutRefWorker` mixes in :class:`ServesRollout`) and the
weights are copied in memory. Both serve requests through the same async method,
``rollout_generate``, so the client does not know which placement it talks to.

=================  ==========================================  ================================
method             takes                                       returns
=================  ==========================================  ================================
rollout_generate   list of Request                             list of Response (in order)
join_weight_sync   address, port, group rank, group size       (the group is made)
receive_weights    version, interrupt                          (weights loaded, version set)
busy_seconds       nothing                                     seconds with requests in flight
describe           nothing                                     name, node id and address, pid
=================  ==========================================  ================================
"""

from __future__ import annotations

import os
from typing import Any

import torch

from treadle.config import Config
from treadle.engines.fsdp import DTYPES
from treadle.engines.inference import HFRolloutEngine, RolloutEngine
from treadle.models import load_causal_lm, load_tokenizer
from treadle.rollout.server import Request, Response, RolloutServer
from treadle.rollout.weight_sync import WeightSyncGroup


def make_engine(cfg: Config, path: str, device: torch.device) -> RolloutEngine:
    """The inference engine ``rollout.engine`` names, with the weights at ``path``."""
    r = cfg.rollout
    dtype = r.dtype or cfg.model.dtype
    if r.engine == "vllm":
        from treadle.engines.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(
            path,
            dtype=dtype,
            seed=cfg.trainer.seed,
            max_model_len=cfg.data.max_prompt_length + cfg.response_length(),
            bucket_mb=r.weight_sync_bucket_mb,
            kv_cache_gib=r.kv_cache_gib,
            gpu_memory_utilization=r.gpu_memory_utilization,
            allow_download=cfg.model.allow_download,
            **(
                {"tensor_parallel_size": r.tensor_parallel_size}
                if r.tensor_parallel_size > 1
                else {}
            ),
        )
    tok = load_tokenizer(cfg.model.tokenizer_path or path, allow_download=cfg.model.allow_download)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    model: Any = load_causal_lm(path, DTYPES[dtype], allow_download=cfg.model.allow_download)
    return HFRolloutEngine(
        model.to(device),
        eos_token_ids=eos,
        pad_token_id=pad,
        micro_batch_size=r.micro_batch_size,
    )


class ServesRollout:
    """Serves requests from a process's :class:`RolloutServer` (``self.server``)."""

    server: RolloutServer | None

    async def rollout_generate(self, requests: list[Request]) -> list[Response]:
        assert self.server is not None, "this worker has no rollout engine"
        return await self.server.generate(requests)


class RolloutReplica(ServesRollout):
    """Replica ``index`` of the rollout pool: one engine, its own process (and devices)."""

    def __init__(
        self, index: int, *, config: Config, model_path: str, version: int, threads: int = 1
    ) -> None:
        torch.set_num_threads(threads)
        self.name = f"rollout replica {index}"
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        engine = make_engine(config, model_path, device)
        self.server = RolloutServer(engine, self.name, index=index, version=version)
        self.sync: WeightSyncGroup | None = None

    def describe(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "name": self.name,
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

    def join_weight_sync(self, addr: str, port: int, rank: int, world_size: int) -> None:
        self.sync = WeightSyncGroup(addr, port, rank, world_size)

    def receive_weights(self, version: int, interrupt: bool = False) -> None:
        """Load the buckets the actor's rank 0 broadcasts: once no request is in flight, or,
        with ``interrupt``, pausing those in flight (partial rollouts). A method of the async
        actor that is not a coroutine, so the engine does not step while it runs."""
        assert self.sync is not None and self.server is not None, "join_weight_sync first"
        sync = self.sync
        self.server.update_weights(
            lambda engine: engine.load_payloads(sync.receive()), version, interrupt=interrupt
        )

    def busy_seconds(self) -> float:
        """Seconds the engine has had requests in flight since the replica started."""
        assert self.server is not None
        return self.server.busy_seconds
