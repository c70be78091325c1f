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
``teacher_generate`` / ``teacher_score``). The LLM judge of ``reward.judge``
(:mod:`treadle.rollout.judge`) is served the same way, with ``role="judge"`` or
:class:`ServesJudge` (``init_judge``, ``judge_generate``, ``judge_score``); it tokenizes with
its own tokenizer, not the actor's.

=================  ==========================================  ================================
method             takes                                       returns
=================  ==========================================  ================================
rollout_generate   list of Request                             list of Response (in order)
rollout_score      list of ScoreRequest                        list of ScoreResponse (in order)
join_weight_sync   address, port, group rank, group size       (the group is made)
receive_weights    version, interrupt                          (weights loaded, version set)
busy_seconds       nothing                                     seconds with requests in flight
start_profile      a folder                                    (its process profiled)
stop_profile       nothing                                     the profile's files
describe           nothing                                     name, node id and address, pid
=================  ==========================================  ================================
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from treadle.config import Config
from treadle.controller import Collect, Dispatch, register
from treadle.controller.groups.worker import gpu_index
from treadle.data.templating import template_end_of_turn
from treadle.engines.inference import Cache, HFRolloutEngine, RolloutEngine, stop_token_ids
from treadle.models.folders import model_config, row_state_layers
from treadle.models.loading import load_causal_lm, load_tokenizer, soft_caps_attention
from treadle.runtime.errors import ConfigError
from treadle.runtime.precision import rollout_dtype
from treadle.serving.server import (
    Request,
    Response,
    RolloutServer,
    ScoreRequest,
    ScoreResponse,
)
from treadle.serving.weight_sync import WeightSyncGroup
from treadle.tracking import profiler

Role = Literal["rollout", "teacher", "judge"]

VLLM_DEFAULT_MAX_LOGPROBS = 20  # vLLM's own default of max_logprobs


@dataclass(frozen=True)
class RoleEngine:
    """How the engine of a role is made, from its config section."""

    engine: str
    dtype: str
    micro_batch_size: int
    memory: dict[str, float]
    max_model_len: int
    tokenizer: str | None  # the folder whose tokenizer gives EOS and padding (None: the model's)
    key: str  # the config key of its weights, for errors
    extra: dict[str, Any]
    cache: Cache = "dynamic"  # the hf engine's KV cache (rollout.cache_implementation)


def judge_length(cfg: Config, path: str) -> int:
    """Tokens of a judge prompt plus its answer, at most (``JudgeConfig.length`` of the
    judge's context, from its config.json)."""
    config = model_config(path, "reward.judge.model_path", cfg.model.allow_download)
    return cfg.reward.judge.length(config.get("max_position_embeddings"))


def role_engine(cfg: Config, role: Role, path: str) -> RoleEngine:
    """The ``rollout`` section's engine settings, or the teacher's (no tensor parallelism;
    vLLM's ``max_logprobs`` at least ``distill.top_k``), or the judge's (its own tokenizer)."""
    if role == "judge":
        j = cfg.reward.judge
        length = judge_length(cfg, path) + 1  # + 1: a scoring request samples one token after
        key = "reward.judge.model_path"
        dtype = j.dtype or cfg.model.dtype
        return RoleEngine(j.engine, dtype, j.micro_batch_size, _memory(j), length, None, key, {})
    length = cfg.data.max_prompt_length + cfg.response_length() + (role == "teacher")
    tokenizer = cfg.model.tokenizer_path
    if role == "teacher":
        t = cfg.teacher
        top_k = {"max_logprobs": max(cfg.distill.top_k, VLLM_DEFAULT_MAX_LOGPROBS)}
        dtype = t.dtype or cfg.model.dtype
        key = "teacher.model_path"
        return RoleEngine(
            t.engine, dtype, t.micro_batch_size, _memory(t), length, tokenizer, key, top_k
        )
    r = cfg.rollout
    tp = r.tensor_parallel_size
    # vLLM's default executor for tp > 1 inside a Ray placement group is its Ray one, which
    # takes a GPU a bundle and refuses our one bundle of tp GPUs (vllm/v1/executor/
    # ray_utils.py); its multiprocessing executor runs the tp workers on this actor's GPUs.
    extra = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    return RoleEngine(
        r.engine,
        rollout_dtype(r.dtype, cfg.model.dtype),
        r.micro_batch_size,
        _memory(r),
        length,
        tokenizer,
        "model.path",
        extra,
        r.cache_implementation,
    )


def _memory(section: Any) -> dict[str, float]:
    """A section's engine memory: vLLM's KV cache on CPU, its share of a GPU."""
    return {
        "kv_cache_gib": section.kv_cache_gib,
        "gpu_memory_utilization": section.gpu_memory_utilization,
    }


def make_engine(
    cfg: Config, path: str, device: torch.device, role: Role = "rollout"
) -> RolloutEngine:
    """The inference engine of ``role`` with the weights at ``path``, as :func:`role_engine`
    says: ``rollout.engine`` with the ``rollout`` section's settings, ``teacher.engine`` with
    the ``teacher`` section's, ``reward.judge.engine`` with the judge's."""
    s = role_engine(cfg, role, path)
    kwargs = cfg.data.chat_template_kwargs if role == "rollout" else None
    tok = load_tokenizer(
        s.tokenizer or path, allow_download=cfg.model.allow_download, template_kwargs=kwargs
    )
    templated = cfg.reward.judge.chat_template if role == "judge" else cfg.data.apply_chat_template
    turn = template_end_of_turn(tok) if templated else None
    if s.engine == "vllm":
        from treadle.engines.vllm import VLLMRolloutEngine

        generation = Path(path) / "generation_config.json"
        listed = json.loads(generation.read_text()) if generation.is_file() else {}
        end_of_turn = turn_stop(tok.eos_token_id, turn, listed.get("eos_token_id"))
        return VLLMRolloutEngine(
            path,
            dtype=s.dtype,
            seed=cfg.trainer.seed,
            max_model_len=s.max_model_len,
            bucket_mb=cfg.rollout.weight_sync_bucket_mb,
            allow_download=cfg.model.allow_download,
            end_of_turn=end_of_turn,
            **s.memory,
            **s.extra,
        )
    model: Any = load_causal_lm(path, s.dtype, key=s.key, allow_download=cfg.model.allow_download)
    if s.cache == "paged" and soft_caps_attention(model.config):
        raise ConfigError(
            "rollout.cache_implementation=paged: transformers' paged attention drops the "
            "soft-cap this model puts on its attention scores (attn_logit_softcapping, as "
            "Gemma 2), which vLLM and the other caches apply: use dynamic or static"
        )
    row_state = row_state_layers(model.config)
    if s.cache == "paged" and row_state is not None:
        raise ConfigError(
            f"rollout.cache_implementation=paged: transformers' paged cache holds attention "
            f"keys and values only, not the state of the model's {row_state!r} layers: use "
            "dynamic or static"
        )
    listed = getattr(model.generation_config, "eos_token_id", None)
    end_of_turn = turn_stop(tok.eos_token_id, turn, listed)
    eos = stop_token_ids(tok.eos_token_id, model.generation_config, end_of_turn)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    return HFRolloutEngine(
        model.to(device),
        eos_token_ids=eos,
        pad_token_id=pad,
        micro_batch_size=s.micro_batch_size,
        gpu_memory_utilization=s.memory["gpu_memory_utilization"],
        cache=s.cache,
    )


def turn_stop(eos: int | None, turn: tuple[int, str] | None, listed: Any) -> int | None:
    """The chat template's end of turn (``turn``) as one more stop of a response, where
    neither the tokenizer's EOS nor the model's generation config (``listed``: its
    ``eos_token_id``) names it and the config names one EOS at most: a base model trained with
    the template (Qwen2.5's: EOS and config ``<|endoftext|>``, turns closed by ``<|im_end|>``).
    A model whose config lists several stops has its turn's end among them, and a template
    may close a turn with a token the model also writes inside one (gpt-oss's ``<|end|>``
    after its reasoning, in some copies of its template)."""
    ids = [i for i in (listed if isinstance(listed, list) else [listed]) if i is not None]
    if turn is None or len(ids) > 1 or turn[0] == eos or turn[0] in ids:
        return None
    return turn[0]


class ServesRollout:
    """Serves requests from a process's :class:`RolloutServer` (``self.server``)."""

    server: RolloutServer | None

    async def rollout_generate(self, requests: list[Request]) -> list[Response]:
        assert self.server is not None, "this worker has no rollout engine"
        return await self.server.generate(requests)

    async def rollout_score(self, requests: list[ScoreRequest]) -> list[ScoreResponse]:
        assert self.server is not None, "this worker has no rollout engine"
        return await self.server.score(requests)


def frozen_server(cfg: Config, role: Role, device: torch.device, rank: int) -> RolloutServer:
    """A colocated frozen model's server in actor rank ``rank``'s process: the teacher's
    (``teacher``) or the LLM judge's (``reward.judge``); the transformers engine only (one vLLM
    engine per process: the rollout's)."""
    key, section = (
        ("teacher", cfg.teacher) if role == "teacher" else ("reward.judge", cfg.reward.judge)
    )
    if section.model_path is None:
        raise ConfigError(f"{key}.model_path is not set: there is no {role} to start")
    if section.engine != "hf":
        raise ConfigError(
            f"{key}.engine={section.engine} with {key}.placement=colocated: one vLLM engine "
            f"per process (the rollout's); set {key}.engine=hf or {key}.placement=split"
        )
    engine = make_engine(cfg, section.model_path, device, role=role)
    return RolloutServer(engine, f"{role} replica {rank} (actor rank {rank})", index=rank)


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
        if self.teacher_server is None:
            self.teacher_server = frozen_server(self.cfg, "teacher", self.device, self.rank)

    async def teacher_generate(self, requests: list[Request]) -> list[Response]:
        self.init_teacher()
        assert self.teacher_server is not None
        return await self.teacher_server.generate(requests)

    async def teacher_score(self, requests: list[ScoreRequest]) -> list[ScoreResponse]:
        self.init_teacher()
        assert self.teacher_server is not None
        return await self.teacher_server.score(requests)


class ServesJudge:
    """A colocated LLM judge (``reward.judge.placement=colocated``), served as the colocated
    teacher is: ``init_judge`` (the driver's :class:`~treadle.rollout.judge.LLMJudge` calls it
    on every rank), then ``judge_generate`` and ``judge_score``."""

    cfg: Config
    device: torch.device
    rank: int
    judge_server: RolloutServer | None = None

    @register(Dispatch.ALL, Collect.RANK0)
    def init_judge(self) -> None:
        """Load ``reward.judge.model_path`` into this rank's judge engine (once)."""
        if self.judge_server is None:
            self.judge_server = frozen_server(self.cfg, "judge", self.device, self.rank)

    async def judge_generate(self, requests: list[Request]) -> list[Response]:
        self.init_judge()
        assert self.judge_server is not None
        return await self.judge_server.generate(requests)

    async def judge_score(self, requests: list[ScoreRequest]) -> list[ScoreResponse]:
        self.init_judge()
        assert self.judge_server is not None
        return await self.judge_server.score(requests)


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
        if device.type == "cuda":
            torch.cuda.set_device(gpu_index())  # the GPU Ray gave this replica (its first)
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

    def start_profile(self, folder: str) -> None:
        """Profile this replica's process until :meth:`stop_profile` (``trainer.profile_steps``;
        an in-process vLLM engine's work included)."""
        profiler.begin(folder, self.name.replace(" ", "-"))

    def stop_profile(self) -> list[str]:
        """Stop the profile :meth:`start_profile` began; the files it wrote."""
        return profiler.end()

    def busy_seconds(self) -> float:
        """Seconds the engine has had requests in flight since the replica started."""
        assert self.server is not None
        return self.server.busy_seconds
