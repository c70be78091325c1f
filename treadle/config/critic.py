"""``critic``: PPO's value model."""

from __future__ import annotations

from pydantic import Field

from treadle.config.actor import LrScheduleName
from treadle.config.base import Placement, Section, own_pool_placement_field


class CriticConfig(Section):
    """The critic of PPO: a value model trained toward the returns, beside the actor."""

    enable: bool | None = Field(
        None,
        description="Build a critic: null = exactly when algorithm.adv_estimator reads values "
        "(gae); true/false must agree with the estimator.",
    )
    model_path: str | None = Field(
        None,
        description="Critic start model (causal LM or value-model folder); null = model.path.",
    )
    placement: Placement = own_pool_placement_field()
    world_size: int | None = Field(
        None,
        gt=0,
        description="Critic ranks (data-parallel x its tensor or sequence parallel size); "
        "null = actor.world_size.",
    )
    tensor_parallel_size: int = Field(
        1,
        gt=0,
        description="Critic ranks that split each decoder layer (as actor.tensor_parallel_size).",
    )
    sequence_parallel_size: int = Field(
        1,
        gt=0,
        description="Critic ranks that split each packed row (as actor.sequence_parallel_size).",
    )
    lr: float = Field(1e-5, gt=0, description="Critic AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Critic AdamW weight decay.")
    lr_schedule: LrScheduleName = Field(
        "constant",
        description="The critic's lr: constant, or a linear or half-cosine decay (no "
        "warm-up) from critic.lr to critic.lr x critic.min_lr_ratio at its last optimizer "
        "step, trainer.total_steps x its ppo_epochs x ceil(data.batch_size x rollout.n / its "
        "ppo_mini_batch_size) (the nominal batch, as actor.lr_schedule's).",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="A decaying critic.lr_schedule ends at critic.lr x this."
    )
    grad_clip: float = Field(1.0, gt=0, description="Critic gradient-norm clipping threshold.")
    cliprange_value: float = Field(
        0.5, gt=0, description="Value clipping: new values stay within ±this of the old ones."
    )
    ppo_epochs: int | None = Field(
        None, gt=0, description="Passes over each RL batch; null = actor.ppo_epochs."
    )
    ppo_mini_batch_size: int | None = Field(
        None,
        gt=0,
        description="Samples per critic optimizer step, all ranks; null = actor's.",
    )
    micro_batch_size: int | None = Field(
        None, gt=0, description="Samples per forward/backward per rank; null = actor's."
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Critic warm-up: for the first N RL steps only the critic trains, the "
        "actor is not updated (verl's critic_warmup).",
    )
