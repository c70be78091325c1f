"""What this machine gives a run: memory, CPUs, the endpoint's port.

A run that starts its own Ray cluster or runs locally is held to this machine's sizes (a
joined cluster's nodes are Ray's to say): a step's batch on the driver and the vLLM KV caches
must fit in its memory, and each actor rank needs a CPU. The sizes are estimates from the
config alone (``BATCH_BYTES_PER_TOKEN``), nothing is allocated. ``treadle serve``'s endpoint,
or a black-box agent's, must be able to listen on its fixed port here.
"""

from __future__ import annotations

import os

from treadle.config import Config
from treadle.config.rules import RL_KINDS, Kind
from treadle.runtime.errors import ConfigError
from treadle.runtime.precision import emulated_bf16

BATCH_BYTES_PER_TOKEN = 64  # a step's batch on the driver: ids, masks, log-probs, advantages...


def joined(cfg: Config) -> bool:
    """The run joins a Ray cluster rather than starting one here or running locally."""
    t = cfg.trainer
    return (
        t.backend == "ray" and (t.ray_address or os.environ.get("RAY_ADDRESS", "local")) != "local"
    )


def machine_problems(cfg: Config, kind: Kind) -> list[str]:
    """Sizes beyond this machine (a run that starts its own Ray cluster or runs locally):
    memory for a step's batch and the vLLM KV caches, a CPU for each actor rank."""
    t, r = cfg.trainer, cfg.rollout
    if joined(cfg):
        return []  # a joined cluster: its nodes' sizes are Ray's to say
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpus = os.cpu_count() or 1
    problems = []
    if kind in RL_KINDS:
        samples = cfg.data.batch_size * r.n
        tokens = cfg.data.max_prompt_length + cfg.response_length()
        need = samples * tokens * BATCH_BYTES_PER_TOKEN / 2**30
        if need > gib:
            problems.append(
                f"rollout.n={r.n}: a step's batch of data.batch_size x rollout.n = {samples} "
                f"samples of up to {tokens} tokens takes about {need:,.0f} GiB, more than this "
                f"machine's {gib:.0f} GiB of memory: lower rollout.n or data.batch_size"
            )
    replicas = r.replicas or (cfg.actor.world_size if r.placement == "colocated" else 1)
    if (
        r.engine == "vllm"
        and kind in (*RL_KINDS, "eval", "serve")
        and r.kv_cache_gib * replicas > gib
    ):
        problems.append(
            f"rollout.kv_cache_gib={r.kv_cache_gib:g} for each of {replicas} vLLM replicas is "
            f"more than this machine's {gib:.0f} GiB of memory: lower rollout.kv_cache_gib"
        )
    ranks = cfg.actor.world_size
    if t.backend == "ray" and ranks > (t.num_cpus or cpus):
        have = f"trainer.num_cpus={t.num_cpus:g}" if t.num_cpus else f"{cpus} CPUs of this machine"
        problems.append(
            f"actor.world_size={ranks} ranks need a CPU each, more than the {have}: lower "
            "actor.world_size, or join a Ray cluster with more (trainer.ray_address)"
        )
    return problems


def precision_warning(cfg: Config, kind: Kind) -> str | None:
    """bfloat16 asked for on a machine that emulates it (a run on this machine)."""
    if joined(cfg):
        return None  # a joined cluster's nodes are not this machine
    settings: dict[str, str] = {"model.dtype": cfg.model.dtype}
    if kind not in ("eval", "serve"):
        settings["actor.mixed_precision"] = cfg.actor.mixed_precision
    if kind in (*RL_KINDS, "eval", "serve") and cfg.rollout.dtype:
        settings["rollout.dtype"] = cfg.rollout.dtype
    return emulated_bf16(settings)


def check_endpoint(cfg: Config, kind: Kind) -> None:
    """`treadle serve`'s endpoint, or a black-box agent's, listens on its fixed port: one taken
    (or an address not this machine's) stopped the command once the model had loaded."""
    from treadle.agents.registry import needs_endpoint
    from treadle.config.endpoint import listen_problem

    if kind == "serve" or needs_endpoint(cfg.rollout.agent_loop):
        e = cfg.rollout.endpoint
        problem = listen_problem(e.host, e.port)
        if problem is not None:
            raise ConfigError(problem)
