"""Starting a run's rollout as ``rollout.placement`` says.

- ``colocated``: the replicas are the actor's own ranks (each process holds a server next to
  its FSDP shard, :class:`~treadle.serving.replica.ServesRollout`); a sync is an in-memory
  copy on every rank. In the local backend the one replica is the in-process server.
- ``split``: replicas in a pool of their own (:mod:`.split_pool`), spawned earlier or here,
  waited for, then joined with the actor's rank 0 in the weight-sync group
  (:mod:`.sync_group`); a :class:`~.restarts.Restarter` is attached when
  ``rollout.max_restarts`` > 0.

Choices: the tokenizer (``model.tokenizer_path`` or the actor's folder) decodes the response
text; the OpenAI-compatible endpoint is made only when the run's agents talk to the model
through it; a split start that fails kills its replicas and gives their pool back.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from treadle.agents.registry import needs_endpoint
from treadle.config import Config
from treadle.controller import WorkerGroup
from treadle.models.loading import load_tokenizer
from treadle.rollout.fleet.batch import Agents
from treadle.rollout.fleet.fanout import Rollout
from treadle.rollout.fleet.restarts import Restarter
from treadle.rollout.fleet.split_pool import Spawned, kill_replicas, spawn_rollout, start_replicas
from treadle.rollout.fleet.sync_group import join_weight_sync
from treadle.serving.client import LocalReplica, RayReplica, ReplicaHandle, RolloutClient

if TYPE_CHECKING:
    from treadle.serving.endpoint import Endpoint


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
        cfg.model.tokenizer_path or actor_path,
        allow_download=cfg.model.allow_download,
        template_kwargs=cfg.data.chat_template_kwargs,
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
        join_weight_sync(group, replicas)
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
    """The run's OpenAI-compatible endpoint, when its agents talk to the model through it or
    ``rollout.endpoint.enabled`` (then served from now on, between steps too)."""
    enabled = cfg.rollout.endpoint.enabled
    if not needs_endpoint(cfg.rollout.agent_loop) and not enabled:
        return None
    from treadle.serving.endpoint import Endpoint  # (aiohttp and vLLM's parsers: when used)

    endpoint = Endpoint.from_config(cfg, client, tokenizer)
    if enabled:
        endpoint.serve_always()
        key = "" if cfg.rollout.endpoint.api_key else f" (api key: {endpoint.api_key})"
        logging.getLogger("treadle").info(
            "rollout.endpoint: serving the run's model at %s%s", endpoint.url, key
        )
    return endpoint
