"""Replicas of a frozen model beside the actors: the teacher of ``treadle distill``
(:mod:`treadle.rollout.teacher`) and the LLM judge of ``reward.judge``
(:mod:`treadle.rollout.judge`), served as the rollout is, by a
:class:`~treadle.serving.client.RolloutClient` of their own, placed as their section says:

- ``split``: ``replicas`` (default 1) :class:`~treadle.serving.replica.RolloutReplica` actors
  started with the role (``"teacher"``, ``"judge"``: engine, dtype and memory from its
  section) in a placement group of their own, ``cpus_per_replica`` CPUs and
  ``gpus_per_replica`` GPUs a bundle (:func:`reserve_frozen_pool`; a driver that plans its
  placement keeps :func:`frozen_cpus` out of the actors' share). Named "<role> replica i" in
  errors. Ray only. One that dies or stops answering is started again, as a split rollout
  replica is (``rollout.max_restarts``), from the same folder: it has no weights to sync.
- ``colocated``: an engine (transformers only: a process runs one vLLM engine, the rollout's)
  and its own server in every actor rank's process, made by ``init_<role>`` and called as
  ``<role>_generate``/``<role>_score`` on the actor's Ray workers, or in this process with
  the local backend (the server's engine then steps in the caller's thread).

Either way the result is a :class:`~treadle.rollout.fleet.Rollout` over those replicas (version
0 throughout, never synced), which closes them.
"""

from __future__ import annotations

import logging
from typing import Any

from treadle.config import Config
from treadle.config.frozen import FrozenModelConfig
from treadle.controller import ResourcePool, WorkerGroup
from treadle.controller.cluster import ensure_ray, use_gpus
from treadle.rollout.fleet import Agents, Restarter, Rollout, kill_replicas, start_replicas
from treadle.runtime.errors import ConfigError
from treadle.serving.client import LocalReplica, RayReplica, ReplicaHandle, RolloutClient
from treadle.serving.replica import Role

log = logging.getLogger("treadle")


def frozen_cpus(section: FrozenModelConfig) -> float:
    """CPUs of the split pool (0 when colocated)."""
    if section.placement == "colocated":
        return 0.0
    return (section.replicas or 1) * section.cpus_per_replica


def reserve_frozen_pool(cfg: Config, section: FrozenModelConfig) -> ResourcePool | None:
    """The split replicas' placement group (None when colocated)."""
    if section.placement == "colocated":
        return None
    ensure_ray(cfg)
    on_gpus = use_gpus(cfg)
    gpus = section.gpus_per_replica if on_gpus else 0.0
    if on_gpus and not gpus and section.engine == "vllm":
        raise ConfigError(
            f"{section.key}.engine=vllm on a cluster with GPUs needs {section.key}."
            "gpus_per_replica > 0 (a replica given no GPU sees none, and vLLM's CUDA build "
            "does not run on a CPU)"
        )
    if on_gpus and not gpus:
        log.warning(
            "%s.gpus_per_replica=0 on a cluster with GPUs: the %s replicas run on CPUs",
            section.key,
            section.role,
        )
    return ResourcePool(section.replicas or 1, section.cpus_per_replica, gpus)


def serve_frozen(
    cfg: Config,
    group: WorkerGroup,
    role: Role,
    section: FrozenModelConfig,
    path: str,
    agents: Agents,
    pool: ResourcePool | None = None,
) -> Rollout:
    """The replicas of ``role`` holding the weights at ``path``, placed as ``section`` says
    (see the module docstring), as a Rollout whose ``agents`` (and their tokenizer, which
    decodes) generate with them. Colocated: on ``group`` (the actor's workers); split: in
    ``pool`` (reserved here if not given)."""
    r = cfg.rollout
    opts: dict[str, Any] = {
        "max_inflight": r.max_inflight_per_replica,
        "timeout_s": r.request_timeout_s,
    }
    tokenizer = agents.tokenizer

    def decode(tokens: list[list[int]]) -> list[str]:
        return list(tokenizer.batch_decode(tokens, skip_special_tokens=True))

    pad = tokenizer.pad_token_id or 0
    if section.placement == "colocated":
        getattr(group, f"init_{role}")()
        handles: list[ReplicaHandle]
        if group.backend == "local":
            handles = [LocalReplica(getattr(w, f"{role}_server")) for w in group.workers]
        else:
            handles = [
                RayReplica(
                    w, f"{role} replica {i} (actor rank {i})", f"{role}_generate", f"{role}_score"
                )
                for i, w in enumerate(group.workers)
            ]
        return Rollout(group, RolloutClient(handles, **opts), decode, pad, agents)
    if pool is None:
        pool = reserve_frozen_pool(cfg, section)
        assert pool is not None
    replicas = start_replicas(cfg, pool, path, 0, role=role)
    try:
        names = [f"{role} replica {i}" for i in range(len(replicas))]
        handles = [RayReplica(a, n) for a, n in zip(replicas, names, strict=True)]
        client = RolloutClient(handles, **opts, max_restarts=r.max_restarts)
        rollout = Rollout(group, client, decode, pad, agents, replicas, pool)
        Restarter.attach(rollout, cfg, path, role=role)  # (rollout.max_restarts)
        return rollout
    except BaseException:
        kill_replicas(replicas, pool)
        raise
