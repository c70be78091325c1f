"""The driver's rollout: replicas placed as the config says, a client over them, weight sync.

:class:`Rollout` is all the driver knows of generation. ``generate`` runs the agent loop
(``rollout.agent_loop``, :mod:`treadle.agents`) ``rollout.n`` times on each prompt (once when
greedy) over the :class:`~treadle.serving.client.RolloutClient` and builds the response side of
the batch from the trajectories (single_turn: one request per sample, all sent at once, as
before agent loops); ``sync_weights`` pushes the actor's new weights to every replica under a
version number.

- ``rollout.placement=colocated``: the replicas are the actor's own ranks (each process holds
  a server next to its FSDP shard, :class:`~treadle.serving.replica.ServesRollout`); a sync is
  an in-memory copy on every rank. In the local backend the one replica is the in-process
  server.
- ``rollout.placement=split``: ``rollout.replicas`` :class:`~treadle.serving.replica.RolloutReplica`
  actors in a placement group of their own, ``rollout.num_cpus`` CPUs (default: half the run's)
  divided equally, ``rollout.tensor_parallel_size`` GPUs each on GPU machines; the actor's
  rank 0 broadcasts the weights to them over a process group of their own. On a Ray cluster
  the pool goes wherever it fits, another node included.

The version of the weights a replica holds is the step whose update produced them: the start
weights are version ``start`` (0, or the resumed step), and the sync after step ``t`` makes
them ``t``; every response carries its version into the batch (``weight_version``).

A split replica that dies or stops answering (``rollout.request_timeout_s``) is restarted, at
most ``rollout.max_restarts`` times in a run (:class:`Restarter`, called by the client, which
sends the requests it held again to the replicas that are up, see
:mod:`treadle.serving.client`): one warning line naming it and the cause, the old actor
killed, a new one started on its bundle, then the weight-sync group made again from scratch on
a new port (a dead member breaks a gloo/NCCL group for good: every replica and the actor's
rank 0 join the new one) and the current weights and version broadcast over it, before any
request reaches it. The actor is idle while the synchronous driver generates, so that happens
at once; while the asynchronous producer generates (the client's loop in a thread of its own,
the actor training), the new replica waits, down, for the driver's next ``sync_weights``,
which makes the group again first. A teacher replica has no weights to sync: it starts again
from ``teacher.model_path`` and is up at once. Each restart counts in
``rollout/replica_restarts``. An agent loop never sees the failure: its call is answered by
another replica. A colocated replica (an actor rank) is not restarted.

A replica that dies *during* a weight sync breaks the group under every member: the actor's
rank 0 fails (and walks the rest of the update, so that its other ranks finish their gathers),
while the live replicas may wait in their receive for good (gloo tells a member nothing of
another's death; measured, FINDINGS). So every replica that has not loaded the whole update a
few seconds after the failure is restarted with the dead one (:meth:`Restarter.replace_broken`,
each a restart), the group is made again and the update sent once more; a second death in
the same sync stops the run.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from treadle.agents.loops import (
    AgentLoop,
    AgentRuns,
    Failures,
    Limits,
    Sample,
    run_agents,
    single_turn,
    tool_loop,
)
from treadle.agents.registry import load_agent_loop, needs_endpoint
from treadle.agents.tools import Toolbox
from treadle.agents.trajectory import Trajectory
from treadle.config import Config
from treadle.controller import (
    ResourcePool,
    WorkerGroup,
    death_cause,
    guarded,
    pid_note,
    rank_threads,
    ray_env,
    ray_get,
)
from treadle.controller.cluster import ensure_ray, total_cpus
from treadle.data import collate_prompts
from treadle.data.images import PIXELS
from treadle.engines.inference import SamplingParams
from treadle.models.loading import load_tokenizer
from treadle.protocol import Batch
from treadle.runtime.errors import ConfigError
from treadle.serving.client import (
    LocalReplica,
    RayReplica,
    ReplicaHandle,
    RolloutClient,
    RolloutError,
)
from treadle.serving.replica import Role, RolloutReplica

if TYPE_CHECKING:
    from treadle.serving.endpoint import Endpoint

log = logging.getLogger("treadle")


def rollout_cpus(cfg: Config) -> float:
    """CPUs of the split rollout pool (0 when colocated)."""
    if cfg.rollout.placement == "colocated":
        return 0.0
    return cfg.rollout.num_cpus or total_cpus(cfg) / 2


def _left_trim(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(row[m.bool()].tolist()) for row, m in zip(ids, mask, strict=True)]


def _pad_right(rows: list[list[Any]], width: int, value: Any, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


@dataclass
class Agents:
    """The agent loop of a run, its tools and bounds (``rollout.agent_loop`` and friends)."""

    loop: AgentLoop
    tools: Toolbox
    tokenizer: Any
    max_turns: int = 1
    max_response_length: int | None = None  # None: one turn, params.max_new_tokens
    max_tool_response_tokens: int = 256
    max_concurrent: int = 256
    failures: Failures = field(default_factory=Failures)

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Any) -> Agents:
        r = cfg.rollout
        loop = load_agent_loop(r.agent_loop, r.env)
        builtin = loop in (single_turn, tool_loop)  # they end within their requests' timeouts
        return cls(
            loop,
            Toolbox.load(r.tools, r.tool_timeout_s),
            tokenizer,
            r.max_turns,
            None if loop is single_turn else cfg.response_length(),
            r.max_tool_response_tokens,
            r.max_concurrent_trajectories,
            Failures(None if builtin else r.agent_timeout_s, r.max_agent_error_frac),
        )

    def width(self, params: SamplingParams) -> int:
        """Response columns of a batch: the most tokens a trajectory may have after its prompt."""
        return self.max_response_length or params.max_new_tokens

    def limits(self, params: SamplingParams) -> Limits:
        return Limits(self.max_turns, self.width(params), self.max_tool_response_tokens)


class Rollout:
    """Generation and weight sync for the driver; see the module docstring."""

    def __init__(
        self,
        group: WorkerGroup,
        client: RolloutClient,
        decode: Callable[[list[list[int]]], list[str]],
        pad_id: int,
        agents: Agents,
        replicas: list[Any] | None = None,
        pool: ResourcePool | None = None,
        endpoint: Endpoint | None = None,
    ) -> None:
        """``replicas``, ``pool``: the split pool's Ray actors and placement group;
        ``endpoint``: the OpenAI-compatible endpoint over ``client`` (black-box agents)."""
        self.group, self.client = group, client
        self.decode, self.pad_id, self.agents = decode, pad_id, agents
        self.replicas, self.pool = replicas or [], pool
        self.names = [h.name for h in client.replicas] if self.replicas else []
        self.endpoint = endpoint
        self.counters: dict[str, float] = {}
        self._counting = threading.Lock()
        self.version = 0  # of the weights the replicas hold (set by start_rollout, each sync)
        self.restarter: Restarter | None = None  # split replicas, rollout.max_restarts > 0

    # ------------------------------------------------------------------ generate

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """``params.n`` samples per prompt (consecutive rows), each a trajectory of the agent
        loop, with the response-side fields: responses, response_mask (the loss mask),
        rollout_log_probs, response_text, stop_reason, weight_version (the oldest of the
        sample's tokens), token_versions (per token; -1 where the model did not sample),
        sample_index (``i x params.n + j`` for the j-th sample of prompt i: the segments of
        one split session share it, a failed run has no row); for
        agent loops other than single_turn also response_attention_mask, turns and
        agent_<info key>."""
        return self.client.run(self.agenerate(prompts, params))

    async def agenerate(self, prompts: Batch, params: SamplingParams, count: bool = True) -> Batch:
        """:meth:`generate` as a coroutine on the client's loop; ``count``: its failed runs
        and broken sessions count in :meth:`take_counters` (not an evaluation's)."""
        copies = params.n if params.temperature == 0 else 1  # greedy samples are all equal
        a = self.agents
        pictures = prompts[PIXELS] if PIXELS in prompts else [None] * len(prompts)
        samples = [
            Sample(uid, list(ids), text, truth, row, pixel_values)
            for uid, ids, text, truth, row, pixel_values in zip(
                prompts["uid"],
                _left_trim(prompts["prompts"], prompts["prompt_mask"]),
                prompts["prompt_text"],
                prompts["ground_truth"],
                prompts.objects.get("row", [{}] * len(prompts)),
                pictures,
                strict=True,
            )
        ]
        if self.endpoint is not None:
            await self.endpoint.start()  # (again: a no-op)
        runs = await run_agents(
            a.loop,
            self.client,
            samples,
            params.n // copies,
            params,
            tokenizer=a.tokenizer,
            tools=a.tools,
            limits=a.limits(params),
            max_concurrent=a.max_concurrent,
            failures=a.failures,
            endpoint=self.endpoint,
        )
        if count:
            self._count(runs)
        runs.trajectories = [ts for ts in runs.trajectories for _ in range(copies)]
        rows = runs.rows()  # a prompt's rows stay consecutive; a failed run has none
        batch = prompts.select([i // params.n for i, _ in rows])
        batch = self.trajectory_batch(batch, [t for _, t in rows], a.width(params))
        batch["sample_index"] = torch.tensor([i for i, _ in rows])  # prompt x n + its sample
        return batch

    def _count(self, runs: AgentRuns) -> None:
        with self._counting:  # (the async modes generate in the client's thread)
            for key, value in runs.counters().items():
                self.counters[key] = self.counters.get(key, 0.0) + value

    def count(self, key: str, value: float = 1.0) -> None:
        with self._counting:
            self.counters[key] = self.counters.get(key, 0.0) + value

    def take_counters(self) -> dict[str, float]:
        """``agent/errors``, ``agent/prefix_breaks`` and, when replicas may be restarted,
        ``rollout/replica_restarts`` since the last call (0 when none)."""
        with self._counting:
            counted, self.counters = self.counters, {}
        zeros = {}
        if self.agents.loop is not single_turn:  # single_turn never fails nor splits
            zeros = {"agent/errors": 0.0, "agent/prefix_breaks": 0.0}
        if self.restarter is not None:
            zeros["rollout/replica_restarts"] = 0.0
        return {**zeros, **counted}

    def trajectory_batch(self, batch: Batch, trajectories: list[Trajectory], width: int) -> Batch:
        """The response side of ``batch`` (one row per trajectory) padded to ``width``."""
        given = [list(ids) for ids in _left_trim(batch["prompts"], batch["prompt_mask"])]
        if [t.prompt_ids for t in trajectories] != given:
            ids, mask = collate_prompts([t.prompt_ids for t in trajectories], self.pad_id)
            batch["prompts"], batch["prompt_mask"] = ids, mask  # a loop rewrote its prompt
        longest = max(len(t.token_ids) for t in trajectories)
        if longest > width:
            raise RolloutError(
                f"an agent loop returned {longest} tokens after the prompt, more than its "
                f"budget of {width} (rollout.max_response_length)"
            )

        def pad(rows: list[list[Any]], value: Any, dtype: torch.dtype) -> torch.Tensor:
            return _pad_right(rows, width, value, dtype)

        batch["responses"] = pad([t.token_ids for t in trajectories], self.pad_id, torch.long)
        batch["response_mask"] = pad([t.loss_mask for t in trajectories], 0, torch.long)
        batch["rollout_log_probs"] = pad([t.log_probs for t in trajectories], 0.0, torch.float32)
        batch["weight_version"] = torch.tensor([min(t.weight_versions) for t in trajectories])
        batch["token_versions"] = pad([t.token_versions for t in trajectories], -1, torch.long)
        decoded = self.decode([t.model_token_ids for t in trajectories])
        batch["response_text"] = [
            text if t.response_text is None else t.response_text
            for t, text in zip(trajectories, decoded, strict=True)
        ]
        batch["stop_reason"] = [t.stop_reason for t in trajectories]
        rewards = [math.nan if t.reward is None else t.reward for t in trajectories]
        batch["trajectory_reward"] = torch.tensor(rewards, dtype=torch.float64)  # NaN: none
        if self.agents.loop is not single_turn:  # tool tokens are attended, not trained
            ones = [[1] * len(t.token_ids) for t in trajectories]
            batch["response_attention_mask"] = pad(ones, 0, torch.long)
            batch.update(tensors=_agent_fields(trajectories))
        return batch

    # ------------------------------------------------------------------ weights

    def sync_weights(self, version: int, interrupt: bool = False) -> dict[str, float]:
        """Push the actor's weights to every replica as ``version``; the bytes sent (the time
        is the driver's ``timing/sync_weights``). ``interrupt``: split replicas pause the
        requests in flight instead of refusing them (partial rollouts). Replicas restarted
        since the last sync join a new weight-sync group first (module docstring)."""
        if self.restarter is None:
            return self.broadcast(version, interrupt)
        self.restarter.revive()
        with self.restarter.lock:
            pending = self.restarter.rejoin_pending()
            try:
                out = self.broadcast(version, interrupt)
            except SyncBroken as e:  # once: a second death in the same sync stops the run
                pending |= self.restarter.replace_broken(e.broken, e)
                self.restarter.rejoin_pending()
                out = self.broadcast(version, interrupt)
            self.client.mark_up(pending)
            return out

    def broadcast(self, version: int, interrupt: bool = False) -> dict[str, float]:
        """:meth:`sync_weights` over the weight-sync group as it is; a replica's death
        during it is a :class:`SyncBroken`."""
        receiving = [r.receive_weights.remote(version, interrupt) for r in self.replicas]
        try:
            sent = self.group.sync_weights(version)
        except Exception:  # a replica that died mid-broadcast breaks the sender's group
            _settle(self.names, receiving, wait_s=5.0)  # (those that loaded it all are done)
            raise  # no replica died: the actor's own error
        _settle(self.names, receiving)
        self.version = version
        return {"rollout/weight_sync_bytes": float(sent)}

    def busy_seconds(self) -> list[float | None]:
        """Per split replica, the seconds its engine has had requests in flight (None: the
        replica died, its restart is the rollout's to make)."""
        import ray

        out: list[float | None] = []
        for future in [r.busy_seconds.remote() for r in self.replicas]:
            try:
                out.append(float(ray.get(future)))
            except ray.exceptions.RayActorError:
                out.append(None)
        return out

    def close(self) -> None:
        if self.endpoint is not None:
            self.client.run(self.endpoint.stop())
        self.client.close()
        self.agents.tools.close()
        if self.replicas:
            import ray

            for r in self.replicas:
                ray.kill(r)
        if self.pool is not None:
            self.pool.remove()


def _agent_fields(trajectories: list[Trajectory]) -> dict[str, torch.Tensor]:
    """``turns`` and ``agent_<key>`` for every number each trajectory's info has [B]."""
    fields = {"turns": torch.tensor([float(t.turns) for t in trajectories])}
    for key in sorted(set.intersection(*(set(t.info) for t in trajectories))):
        values = [t.info[key] for t in trajectories]
        if all(isinstance(v, int | float) for v in values):
            fields[f"agent_{key}"] = torch.tensor([float(v) for v in values])
    return fields


def reserve_rollout_pool(cfg: Config) -> ResourcePool | None:
    """The split rollout pool (None when colocated), reserved before the actor's so that
    replicas pinned to nodes (``rollout.ray_resources``) get them before others choose."""
    if cfg.rollout.placement == "colocated":
        return None
    ensure_ray(cfg)
    r, total, cpus = cfg.rollout, total_cpus(cfg), rollout_cpus(cfg)
    if cpus >= total:
        raise ConfigError(
            f"rollout.num_cpus={cpus:g} leaves nothing of the run's {total:g} CPUs for the "
            "actor: give the rollout pool fewer CPUs or the run more (trainer.num_cpus)"
        )
    gpus = float(r.tensor_parallel_size) if torch.cuda.is_available() else 0.0
    if not gpus and r.tensor_parallel_size > 1:
        raise ConfigError(
            f"rollout.tensor_parallel_size={r.tensor_parallel_size} needs GPUs; on CPU a "
            "replica is one process: set it to 1"
        )
    count = cfg.rollout_replicas()
    return ResourcePool(count, cpus / count, gpus, dict(r.ray_resources))


@dataclass
class Spawned:
    """A split rollout's pool and its replicas, started and not waited for, until
    :func:`start_rollout` takes them (``close``: killed, the pool given back, if it never does)."""

    pool: ResourcePool
    replicas: list[Any]

    def close(self) -> None:
        kill_replicas(self.replicas, self.pool)


def spawn_rollout(cfg: Config, path: str, version: int) -> Spawned | None:
    """Split: the rollout pool (:func:`reserve_rollout_pool`) and its replicas of the weights at
    ``path``, starting (imports, engines) while the driver starts the actors' group; None when
    colocated."""
    pool = reserve_rollout_pool(cfg)
    if pool is None:
        return None
    try:
        return Spawned(pool, spawn_replicas(cfg, pool, path, version))
    except BaseException:
        pool.remove()
        raise


def start_rollout(
    cfg: Config,
    group: WorkerGroup,
    actor_path: str,
    version: int,
    spawned: Spawned | None = None,
) -> Rollout:
    """Replicas as ``rollout.placement`` says, a client over them. Split: the replicas of
    ``spawned`` (:func:`spawn_rollout`) or, not given, replicas started here from ``actor_path``
    in a pool reserved here; waited for here, and killed with their pool if this fails.

    ``version``: the version of the weights at ``actor_path`` (the step they come from)."""
    tok = load_tokenizer(
        cfg.model.tokenizer_path or actor_path, allow_download=cfg.model.allow_download
    )

    def decode(tokens: list[list[int]]) -> list[str]:
        return list(tok.batch_decode(tokens, skip_special_tokens=True))

    pad_id = tok.pad_token_id or 0
    agents = Agents.from_config(cfg, tok)
    r = cfg.rollout
    opts: dict[str, Any] = {
        "max_inflight": r.max_inflight_per_replica,
        "timeout_s": r.request_timeout_s,
    }
    if r.placement == "colocated":
        handles: list[ReplicaHandle]
        if group.backend == "local":
            handles = [LocalReplica(w.server) for w in group.workers]
        else:
            handles = [
                RayReplica(w, f"rollout replica {i} (actor rank {i})")
                for i, w in enumerate(group.workers)
            ]
        client = RolloutClient(handles, **opts)
        return Rollout(group, client, decode, pad_id, agents, endpoint=_endpoint(cfg, client, tok))
    if spawned is None:
        spawned = spawn_rollout(cfg, actor_path, version)
        assert spawned is not None
    pool = spawned.pool
    replicas = start_replicas(cfg, pool, actor_path, version, spawned=spawned.replicas)
    try:
        _join_weight_sync(group, replicas)
        names = [f"rollout replica {i}" for i in range(len(replicas))]
        client = RolloutClient(
            [RayReplica(a, n) for a, n in zip(replicas, names, strict=True)],
            **opts,
            max_restarts=r.max_restarts,
        )
    except BaseException:
        kill_replicas(replicas, pool)
        raise
    rollout = Rollout(
        group, client, decode, pad_id, agents, replicas, pool, _endpoint(cfg, client, tok)
    )
    rollout.version = version
    Restarter.attach(rollout, cfg, actor_path)
    return rollout


def _endpoint(cfg: Config, client: RolloutClient, tokenizer: Any) -> Endpoint | None:
    """The run's OpenAI-compatible endpoint, when its agents talk to the model through it."""
    if not needs_endpoint(cfg.rollout.agent_loop):
        return None
    from treadle.serving.endpoint import Endpoint  # (aiohttp and vLLM's parsers: when used)

    return Endpoint.from_config(cfg, client, tokenizer)


def spawn_replicas(
    cfg: Config, pool: ResourcePool, path: str, version: int, role: Role = "rollout"
) -> list[Any]:
    """One :class:`RolloutReplica` actor of ``role`` serving the weights at ``path`` on each
    bundle of ``pool``, not waited for: their processes start (imports, engine) while the
    driver goes on; :func:`start_replicas` waits for them."""
    return [_start_replica(cfg, pool, i, path, version, role) for i in range(pool.world_size)]


def start_replicas(
    cfg: Config,
    pool: ResourcePool,
    path: str,
    version: int,
    role: Role = "rollout",
    spawned: list[Any] | None = None,
) -> list[Any]:
    """:func:`spawn_replicas` (or ``spawned``, its replicas), ready; on failure the replicas
    are killed and the pool removed."""
    replicas = spawned or spawn_replicas(cfg, pool, path, version, role)
    try:
        ray_get([a.treadle_check.remote() for a in replicas])
    except BaseException:
        kill_replicas(replicas, pool)
        raise
    return replicas


def _start_replica(
    cfg: Config, pool: ResourcePool, index: int, path: str, version: int, role: Role
) -> Any:
    """The :class:`RolloutReplica` actor on bundle ``index`` of ``pool`` (not waited for)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cpus, gpus = pool.cpus_per_rank, pool.gpus_per_rank
    threads = rank_threads(cfg, cpus)
    remote_cls: Any = ray.remote(guarded(RolloutReplica))  # type: ignore[arg-type]
    return remote_cls.options(
        num_cpus=cpus,
        num_gpus=gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pool.pg, placement_group_bundle_index=index
        ),
        runtime_env={"env_vars": ray_env(threads)},
    ).remote(index, config=cfg, model_path=path, version=version, threads=threads, role=role)


class Restarter:
    """Restarts the split replicas of ``rollout`` for its client (see the module docstring);
    ``path``: the weights a new replica starts from (the actor's start, or the teacher's)."""

    def __init__(self, rollout: Rollout, cfg: Config, path: str, role: Role) -> None:
        self.rollout, self.cfg, self.path, self.role = rollout, cfg, path, role
        self.lock = threading.Lock()  # one restart or weight sync at a time
        self.pending: set[int] = set()  # restarted, not in the weight-sync group yet

    @classmethod
    def attach(cls, rollout: Rollout, cfg: Config, path: str, role: Role = "rollout") -> None:
        """Let ``rollout``'s client restart its replicas (when ``rollout.max_restarts`` > 0)."""
        if cfg.rollout.max_restarts > 0 and rollout.replicas:
            rollout.restarter = cls(rollout, cfg, path, role)
            rollout.client.restarts.restart = rollout.restarter.restart

    async def restart(self, index: int, error: Exception) -> None:
        """Replica ``index`` failed with ``error``: start it again (on the client's loop)."""
        client, budget = self.rollout.client, self.rollout.client.restarts
        log.warning(
            "%s; restarting it (restart %d of rollout.max_restarts=%d)",
            error,
            budget.max_restarts - budget.left,
            budget.max_restarts,
        )
        failed = self.rollout.replicas[index]
        loop = asyncio.get_running_loop()
        up = await loop.run_in_executor(None, self._restart, index, failed)
        if up is None:  # a weight sync restarted it meanwhile (and counted it)
            return
        name = self.rollout.names[index]
        client.replace(index, RayReplica(self.rollout.replicas[index], name), up)
        self.rollout.count("rollout/replica_restarts")

    def _restart(self, index: int, failed: Any) -> bool | None:
        """Kill and start replica ``index`` (the actor ``failed``) again; whether it is up
        (has the weights), None if a weight sync restarted it already."""
        import ray

        r = self.rollout
        assert r.pool is not None
        with self.lock:
            if r.replicas[index] is not failed:
                return None
            ray.kill(r.replicas[index])  # (a replica that stopped answering may be alive)
            actor = _start_replica(self.cfg, r.pool, index, self.path, r.version, self.role)
            _get(actor.treadle_check.remote(), r.names[index], "its restart")
            r.replicas[index] = actor
            if self.role == "teacher":  # frozen: nothing to sync
                return True
            self.pending.add(index)
            if r.client.background:  # the actor may be training: at the next sync
                return False
            self.rejoin_pending()
            r.broadcast(r.version, interrupt=True)  # the others keep their requests
            return True

    def replace_broken(self, broken: list[int], error: SyncBroken) -> set[int]:
        """Kill and start again the replicas ``broken`` by a weight sync (``error``), under
        ``lock``; they wait, down, for the group to be made again (``pending``). Each is a
        restart, counted and charged to ``rollout.max_restarts``, unless the client's own
        restart of it is under way (that one then finds it done, :meth:`_restart`)."""
        import ray

        r = self.rollout
        assert r.pool is not None
        log.warning("%s; restarting %s", error, ", ".join(r.names[i] for i in broken))
        r.client.run(self._take_down(broken, error))
        for index in broken:
            ray.kill(r.replicas[index])
        started = [
            _start_replica(self.cfg, r.pool, i, self.path, r.version, self.role) for i in broken
        ]
        for index, actor in zip(broken, started, strict=True):
            _get(actor.treadle_check.remote(), r.names[index], "its restart")
            r.replicas[index] = actor
            r.count("rollout/replica_restarts")
        r.client.run(self._rehandle(broken))
        self.pending.update(broken)
        return set(broken)

    async def _take_down(self, broken: list[int], error: SyncBroken) -> None:
        """On the client's loop: charge the restarts of ``broken``, route nothing to them,
        and give each a new handle (a call that fails on the old one is then not a restart,
        see :meth:`~treadle.serving.client.Restarts.failed`)."""
        budget = self.rollout.client.restarts
        charged = [i for i in broken if i not in budget.tasks]
        if len(charged) > budget.left:
            raise RolloutError(
                f"{error}; rollout.max_restarts={budget.max_restarts} restarts used already"
            )
        budget.left -= len(charged)
        await self._rehandle(broken)

    async def _rehandle(self, indices: list[int]) -> None:
        """On the client's loop: new handles of the actors at ``indices``, down."""
        r = self.rollout
        for index in indices:
            r.client.down.add(index)
            r.client.replace(index, RayReplica(r.replicas[index], r.names[index]), up=False)

    def revive(self) -> None:
        """Restart the replicas that died since their last call (before a weight sync, whose
        group a dead member would break)."""
        import ray

        r = self.rollout
        pings = [a.busy_seconds.remote() for a in r.replicas]
        for index, ref in enumerate(pings):
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                dead = f"{r.names[index]}{pid_note(e)} died between rollouts ({death_cause(e)})"
                r.client.run(r.client.restarts.now(index, RolloutError(dead)))

    def rejoin_pending(self) -> set[int]:
        """Make the weight-sync group again if a replica was restarted since it was made;
        the replicas restarted (under ``lock``)."""
        pending, self.pending = self.pending, set()
        if pending:
            _join_weight_sync(self.rollout.group, self.rollout.replicas)
        return pending


def _get(ref: Any, name: str, what: str) -> Any:
    """``ray.get(ref)``; a dead replica is a RolloutError naming it (``name``, pid, cause)."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as e:
        dead = f"{name}{pid_note(e)} died during {what}"
        raise RolloutError(f"{dead} ({death_cause(e)})") from None


class SyncBroken(RolloutError):
    """A weight sync during which a replica died; ``broken``: the replicas (indices) that did
    not answer that they loaded the whole update (the others of the broken group may wait
    in it for good: a gloo group does not tell a member that another one died)."""

    def __init__(self, message: str, broken: list[int] | None = None) -> None:
        super().__init__(message)  # (one argument: the driver re-raises it with the step)
        self.broken = broken or []


def _settle(names: list[str], receiving: list[Any], wait_s: float | None = None) -> None:
    """Wait (at most ``wait_s``) for the replicas' ``receive_weights`` calls; raise
    :class:`SyncBroken` if one of them died, else the first error one of them raised."""
    if not receiving:  # colocated: the sync was an in-memory copy in each rank
        return
    import ray

    done, _ = ray.wait(receiving, num_returns=len(receiving), timeout=wait_s)
    broken, death, error = [], "", None
    for index, (name, ref) in enumerate(zip(names, receiving, strict=True)):
        if ref not in done:
            broken.append(index)
            continue
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            broken.append(index)
            death = death or f"{name}{pid_note(e)} died during a weight sync ({death_cause(e)})"
        except Exception as e:
            broken.append(index)
            error = error or e
    if death:
        raise SyncBroken(death, broken)
    if error is not None:
        raise error


def _join_weight_sync(group: WorkerGroup, replicas: list[Any]) -> None:
    """The actor's rank 0 and every replica form the weight-sync process group."""
    addr, port = group.weight_sync_address()
    world = len(replicas) + 1
    joining = [a.join_weight_sync.remote(addr, port, i + 1, world) for i, a in enumerate(replicas)]
    group.init_weight_sync(addr, port, world)
    ray_get(joining)


def kill_replicas(replicas: list[Any], pool: ResourcePool) -> None:
    """Kill replica actors and give their pool back."""
    import ray

    for a in replicas:
        ray.kill(a)
    pool.remove()
