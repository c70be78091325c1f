"""The rollout role: an inference engine serving requests, and how weights reach it.

:class:`RolloutReplica` is a rollout replica of its own (``rollout.placement=split``): a Ray
actor, in a resource pool apart from the actor's, owning one inference engine behind a
:class:`~treadle.serving.server.RolloutServer`. It is an asynchronous Ray actor, so thousands of
requests can be in flight while the engine batches them, stepped in the actor's one thread.
Its weights come from the actor's rank 0 over a process group of their own
(:mod:`treadle.serving.weight_sync`).

Colocated (``rollout.placement=colocated``), each actor rank's process holds the server instead
(:class:`~treadle.workers.actor.ActorRolloutRefWorker` mixes in :class:`ServesRollout`) and the
weights are copied in memory. Both serve requests through the same async methods,
``rollout_generate`` and ``rollout_score``, so the client does not know which placement it
talks to.

The frozen **teacher** of ``treadle distill`` is served the same way
(:mod:`treadle.rollout.teacher`): ``teacher.placement=split`` starts :class:`RolloutReplica`
actors with ``role="teacher"`` (engine and dtype from the ``teacher`` section, weights from
``teacher.model_path``, no weight sync ever); ``teacher.placement=colocated`` gives each actor
rank's process a second server (:class:`ServesTeacher`: ``init_teacher``, then
``teacher_generate`` / ``teacher_score``).

=================  ==========================================  ================================
method             takes                                       returns
=================  ==========================================  ================================
rollout_generate   list of Request                             list of Response (in order)
rollout_score      list of ScoreRequest                        list of ScoreResponse (in order)
join_weight_sync   address, port, group rank, group size       (the group is made)
receive_weights    version, interrupt                          (weights loaded, version set)
busy_seconds       nothing                                     seconds with requests in flight
describe           nothing                                     name, node id and address, pid
=================  ==========================================  ================================
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch

from treadle.config import Config
from treadle.controller import Collect, Dispatch, register
from treadle.engines.inference import HFRolloutEngine, RolloutEngine
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.runtime.errors import ConfigError
from treadle.serving.server import (
    Request,
    Response,
    RolloutServer,
    ScoreRequest,
    ScoreResponse,
)
from treadle.serving.weight_sync import WeightSyncGroup

Role = Literal["rollout", "teacher"]

VLLM_DEFAULT_MAX_LOGPROBS = 20  # vLLM's own default of max_logprobs


def make_engine(
    cfg: Config, path: str, device: torch.device, role: Role = "rollout"
) -> RolloutEngine:
    """The inference engine of ``role`` with the weights at ``path``: ``rollout.engine`` with
    the ``rollout`` section's settings, or, for the teacher, ``teacher.engine`` with the
    ``teacher`` section's (no tensor parallelism; vLLM started with ``max_logprobs`` at least
    ``distill.top_k``)."""
    key = "teacher.model_path" if role == "teacher" else "model.path"
    if role == "teacher":
        t = cfg.teacher
        engine, dtype, micro = t.engine, t.dtype or cfg.model.dtype, t.micro_batch_size
        memory = {
            "kv_cache_gib": t.kv_cache_gib,
            "gpu_memory_utilization": t.gpu_memory_utilization,
        }
        extra: dict[str, Any] = {"max_logprobs": max(cfg.distill.top_k, VLLM_DEFAULT_MAX_LOGPROBS)}
    else:
        r = cfg.rollout
        engine, dtype, micro = r.engine, r.dtype or cfg.model.dtype, r.micro_batch_size
        memory = {
            "kv_cache_gib": r.kv_cache_gib,
            "gpu_memory_utilization": r.gpu_memory_utilization,
        }
        tp = r.tensor_parallel_size
        extra = {"tensor_parallel_size": tp} if tp > 1 else {}
    if engine == "vllm":
        from treadle.engines.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(
            path,
            dtype=dtype,
            seed=cfg.trainer.seed,
            # + 1: a scoring request samples one token after the whole sequence
            max_model_len=cfg.data.max_prompt_length + cfg.response_length() + (role == "teacher"),
            bucket_mb=cfg.rollout.weight_sync_bucket_mb,
            allow_download=cfg.model.allow_download,
            **memory,
            **extra,
        )
    tok = load_tokenizer(cfg.model.tokenizer_path or path, allow_download=cfg.model.allow_download)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    model: Any = load_causal_lm(path, dtype, key=key, allow_download=cfg.model.allow_download)
    return HFRolloutEngine(
        model.to(device),
        eos_token_ids=eos,
        pad_token_id=pad,
        micro_batch_size=micro,
        gpu_memory_utilization=memory["gpu_memory_utilization"],
    )


class ServesRollout:
    """Serves requests from a process's :class:`RolloutServer` (``self.server``)."""

    server: RolloutServer | None

    async def rollout_generate(self, requests: list[Request]) -> list[Response]:
        assert self.server is not None, "this worker has no rollout engine"
        return await self.server.generate(requests)

    async def rollout_score(self, requests: list[ScoreRequest]) -> list[ScoreResponse]:
        assert self.server is not None, "this worker has no rollout engine"
        return await self.server.score(requests)


class ServesTeacher:
    """A colocated teacher (``teacher.placement=colocated``): a second engine and server in an
    actor rank's process, made by ``init_teacher`` (the driver's
    :func:`~treadle.rollout.teacher.start_teacher` calls it on every rank), serving
    ``teacher_generate`` and ``teacher_score`` as a replica serves ``rollout_generate`` and
    ``rollout_score``. Only the transformers engine (one vLLM engine per process: the
    rollout's)."""

    cfg: Config
    device: torch.device
    rank: int
    teacher_server: RolloutServer | None = None

    @register(Dispatch.ALL, Collect.RANK0)
    def init_teacher(self) -> None:
        """Load ``teacher.model_path`` into this rank's teacher engine (once)."""
        if self.teacher_server is not None:
            return
        t = self.cfg.teacher
        if t.model_path is None:
            raise ConfigError("teacher.model_path is not set: there is no teacher to start")
        if t.engine != "hf":
            raise ConfigError(
                f"teacher.engine={t.engine} with teacher.placement=colocated: one vLLM engine "
                "per process (the rollout's); set teacher.engine=hf or teacher.placement=split"
            )
        engine = make_engine(self.cfg, t.model_path, self.device, role="teacher")
        name = f"teacher replica {self.rank} (actor rank {self.rank})"
        self.teacher_server = RolloutServer(engine, name, index=self.rank)

    async def teacher_generate(self, requests: list[Request]) -> list[Response]:
        self.init_teacher()
        assert self.teacher_server is not None
        return await self.teacher_server.generate(requests)

    async def teacher_score(self, requests: list[ScoreRequest]) -> list[ScoreResponse]:
        self.init_teacher()
        assert self.teacher_server is not None
        return await self.teacher_server.score(requests)


class RolloutReplica(ServesRollout):
    """Replica ``index`` of the rollout pool (``role="teacher"``: of the split teacher's pool,
    serving ``teacher.model_path``, never synced): one engine, its own process (and devices)."""

    def __init__(
        self,
        index: int,
        *,
        config: Config,
        model_path: str,
        version: int,
        threads: int = 1,
        role: Role = "rollout",
    ) -> None:
        torch.set_num_threads(threads)
        self.name = f"{role} replica {index}"
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        engine = make_engine(config, model_path, device, role)
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
