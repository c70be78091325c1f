"""Where the roles run and how they are cut: the rollout replicas' placement, the critic's
and PRIME's PRM's placement and mini-batches, a frozen model's replicas (the teacher's, the
LLM judge's), tensor and sequence parallel layouts.

Config validation reads the rules of the config alone (``sections.config_problems`` calls
:func:`check_rollout`, :func:`check_parallel`, :func:`check_side_role` and, for the judge,
:func:`check_frozen`; ``treadle distill``'s rules call it for the teacher); the layouts against
the model's shape, its ``config.json`` (:func:`parallel_model_problems`, :func:`model_problems`),
are read by ``treadle check`` and by the engine at start-up.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from treadle.config.actor import ActorConfig
from treadle.config.frozen import FrozenModelConfig
from treadle.config.rollout import RolloutConfig
from treadle.config.run import Sections
from treadle.config.trainer import TrainerConfig
from treadle.models.folders import row_state_layers


def check_frozen(key: str, section: FrozenModelConfig, cfg: Sections) -> Iterator[str]:
    """Where the frozen model of section ``key`` can run: vLLM only in replicas of its own,
    split only on Ray, colocated one in each actor rank."""
    if section.engine == "vllm" and section.placement == "colocated":
        yield (
            f"{key}.engine=vllm cannot share the actor's processes (one vLLM engine per "
            f"process): set {key}.placement=split, or {key}.engine=hf"
        )
    if section.placement == "split" and cfg.trainer.backend == "local":
        yield (
            f"trainer.backend=local runs one rank in-process; set {key}.placement=colocated "
            "or use trainer.backend=ray"
        )
    ws = cfg.actor.world_size
    if section.placement == "colocated" and section.replicas not in (None, ws):
        yield (
            f"{key}.replicas={section.replicas} must equal actor.world_size={ws} "
            f"when {key}.placement=colocated (one in each actor rank's process); set "
            f"{key}.placement=split or drop {key}.replicas"
        )


def check_rollout(
    rollout: RolloutConfig, actor: ActorConfig, trainer: TrainerConfig
) -> Iterator[str]:
    tp = rollout.tensor_parallel_size
    if tp > 1 and rollout.engine != "vllm":
        yield (
            f"rollout.tensor_parallel_size={tp} splits a vLLM replica; rollout.engine="
            f"{rollout.engine} runs whole: set rollout.engine=vllm or the size to 1"
        )
    elif tp > 1 and rollout.placement == "colocated":
        yield (
            f"rollout.tensor_parallel_size={tp} needs rollout.placement=split (a colocated "
            "replica lives in one actor rank's process, on its one device); on CPU set it to 1"
        )
    if rollout.cache_implementation != "dynamic" and rollout.engine != "hf":
        yield (
            f"rollout.cache_implementation={rollout.cache_implementation} is the hf engine's "
            "(vLLM pages its own KV cache): set rollout.engine=hf or drop it"
        )
    if rollout.placement == "colocated":
        if rollout.replicas is not None and rollout.replicas != actor.world_size:
            yield (
                f"rollout.replicas={rollout.replicas} must equal actor.world_size="
                f"{actor.world_size} when rollout.placement=colocated (one replica in each "
                "actor rank's process); set rollout.placement=split or drop rollout.replicas"
            )
        if rollout.num_cpus is not None or rollout.ray_resources:
            yield (
                "rollout.num_cpus and rollout.ray_resources shape the rollout pool of "
                "rollout.placement=split; colocated replicas use the actor's bundles: drop "
                "them or set rollout.placement=split"
            )
        return
    if trainer.backend == "local":
        yield (
            "trainer.backend=local runs one rank in-process; set rollout.placement=colocated "
            "or use trainer.backend=ray"
        )
    cpus = trainer.num_cpus
    if cpus is not None and rollout.num_cpus is not None and rollout.num_cpus >= cpus:
        yield (
            f"rollout.num_cpus={rollout.num_cpus} leaves nothing of trainer.num_cpus={cpus} "
            "for the actor: give the rollout pool fewer CPUs or the run more"
        )


def check_parallel(cfg: Sections) -> Iterator[str]:
    """Tensor and sequence parallel layouts of the actor and the critic: the world size
    divisible by a group, one kind at a time, packed rows for sequence parallel, no LoRA.
    (The model's heads and widths are checked when the engine is built:
    :func:`treadle.engines.parallel.check_model`.)"""
    a = cfg.actor
    critic_ws = cfg.critic.world_size or a.world_size
    for section, ws, tp, sp in (
        ("actor", a.world_size, a.tensor_parallel_size, a.sequence_parallel_size),
        (
            "critic",
            critic_ws,
            cfg.critic.tensor_parallel_size,
            cfg.critic.sequence_parallel_size,
        ),
    ):
        if tp == sp == 1:
            continue
        if tp > 1 and sp > 1:
            yield (
                f"{section}.tensor_parallel_size={tp} and {section}.sequence_parallel_size={sp}: "
                "treadle splits a layer's weights or its sequence, not both; set one to 1"
            )
        world_key = f"{section}.world_size" if section == "actor" else "critic.world_size"
        if ws % (tp * sp):
            key = "tensor_parallel_size" if tp > 1 else "sequence_parallel_size"
            yield (
                f"{world_key}={ws} must be divisible by {section}.{key}={tp * sp} "
                "(the data-parallel ranks are world_size / its value)"
            )
        if sp > 1 and not a.remove_padding:
            yield (
                f"{section}.sequence_parallel_size={sp} splits packed rows: set "
                "actor.remove_padding=true"
            )
    if a.lora.rank and a.tensor_parallel_size * a.sequence_parallel_size > 1:
        yield (
            "actor.lora.rank > 0 with actor.tensor_parallel_size or "
            "actor.sequence_parallel_size > 1 is not supported: set them to 1, or lora.rank=0"
        )


def parallel_model_problems(
    section: str, tp: int, sp: int, model_config: dict[str, Any]
) -> Iterator[str]:
    """The model's shape (its ``config.json``) allows ``section``'s layout: tensor parallel
    divides the attention heads, the key/value heads and the MLP width, sequence parallel
    the heads and key/value heads, and is not asked to soft-cap attention scores nor to split
    layers with a state along the sequence (a linear attention, a convolution). Read by
    ``treadle check`` and by the engine at start-up."""
    heads = model_config.get("num_attention_heads")
    shape = {
        "num_attention_heads": heads,
        "num_key_value_heads": model_config.get("num_key_value_heads") or heads,
        "intermediate_size": model_config.get("intermediate_size"),
    }
    for size, key, names in (
        (tp, "tensor_parallel_size", tuple(shape)),
        (sp, "sequence_parallel_size", ("num_attention_heads", "num_key_value_heads")),
    ):
        for name in names if size > 1 else ():
            value = shape[name]
            if isinstance(value, int) and value % size:
                yield (
                    f"{section}.{key}={size} must divide the model's {name}={value}: "
                    "choose a divisor of it"
                )
    row_state = row_state_layers(model_config)
    if sp > 1 and row_state is not None:
        yield (
            f"{section}.sequence_parallel_size={sp}: the model's {row_state!r} layers carry a "
            "state along the sequence, which sequence parallel splits over ranks: set it to 1"
        )
    softcap = model_config.get("attn_logit_softcapping")
    if sp > 1 and softcap is not None:
        yield (
            f"{section}.sequence_parallel_size={sp}: the model soft-caps its attention scores "
            f"(attn_logit_softcapping={softcap}, as Gemma 2), which sequence parallel's "
            "attention does not: set it to 1"
        )


def model_problems(cfg: Sections, model_config: dict[str, Any]) -> Iterator[str]:
    """:func:`parallel_model_problems` of the actor and the critic (one model shape)."""
    a, c = cfg.actor, cfg.critic
    yield from parallel_model_problems(
        "actor", a.tensor_parallel_size, a.sequence_parallel_size, model_config
    )
    yield from parallel_model_problems(
        "critic", c.tensor_parallel_size, c.sequence_parallel_size, model_config
    )


def check_side_role(
    section: str,
    what: str,
    world_size: int | None,
    placement: str,
    mini_key: str,
    mini_batch_size: int | None,
    actor: ActorConfig,
    samples: int,
    backend: str,
) -> Iterator[str]:
    """The placement and batch rules of a role beside the actor (the critic, PRIME's PRM)."""
    ws = world_size or actor.world_size
    if placement == "colocated" and ws != actor.world_size:
        yield (
            f"{section}.world_size={ws} must equal actor.world_size={actor.world_size} when "
            f"{section}.placement=colocated (it shares the actor's bundles); set "
            f"{section}.placement=split or drop {section}.world_size"
        )
    if backend == "local" and placement == "split":
        yield (
            f"trainer.backend=local runs one rank in-process; set {section}.placement=colocated "
            "or use trainer.backend=ray"
        )
    mini = mini_batch_size or actor.ppo_mini_batch_size
    same_as_actor = mini_batch_size is None and ws == actor.world_size
    if not same_as_actor and (samples % mini or mini % ws):  # else the actor's rule says it
        yield (
            f"{section}.{mini_key}={mini} must divide data.batch_size x rollout.n = "
            f"{samples} and be divisible by the {what}'s world size {ws}"
        )
