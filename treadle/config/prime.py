"""``prime``: PRIME's implicit process reward model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from treadle.config.base import Placement, Section, own_pool_placement_field


class PrimeConfig(Section):
    """PRIME's implicit process reward model (``algorithm.adv_estimator=prime``): a causal LM
    trained online on the outcome labels, whose log-ratio to a frozen copy rewards each token."""

    model_path: str | None = Field(
        None, description="The PRM's start (a causal LM folder); null = model.path."
    )
    ref_path: str | None = Field(
        None, description="The PRM's frozen reference; null = its start (model_path)."
    )
    beta: float = Field(
        0.05, gt=0, description="r_t = beta (log pi_prm - log pi_ref) (verl's beta_train)."
    )
    loss: Literal["ce", "dpo"] = Field(
        "ce",
        description="'ce': BCE of sigmoid(beta sum_t q_t) against the outcome; 'dpo': "
        "-log sigmoid(beta (Q - Q_opp)) against the group's samples of the other outcome "
        "(verl's detached dpo loss; costs one more PRM forward a step).",
    )
    update: Literal["before", "after"] = Field(
        "before",
        description="'before': update the PRM on the batch, then reward it with the updated "
        "PRM (a second forward, verl's default); 'after': the rewards come from the update's "
        "own forward, before its optimizer step.",
    )
    norm: Literal["batch_norm", "none"] = Field(
        "batch_norm",
        description="'batch_norm': divide the token rewards by the largest |reward to go| of "
        "the batch (verl's prime_norm); 'none': beta q as is.",
    )
    reward_gt_coef: float = Field(
        5.0, ge=0, description="Weight of the outcome reward's RLOO advantage (verl's)."
    )
    reward_dpo_coef: float = Field(
        5.0, ge=0, description="Weight of the implicit rewards' RLOO advantage (verl's)."
    )
    lr: float = Field(1e-6, gt=0, description="PRM AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="PRM AdamW weight decay.")
    grad_clip: float = Field(10.0, gt=0, description="PRM gradient-norm clipping threshold.")
    mini_batch_size: int | None = Field(
        None,
        gt=0,
        description="Samples per PRM optimizer step, all ranks (one pass over the batch, in "
        "order); null = actor.ppo_mini_batch_size.",
    )
    micro_batch_size: int | None = Field(
        None, gt=0, description="Samples per PRM forward/backward per rank; null = actor's."
    )
    placement: Placement = own_pool_placement_field()
    world_size: int | None = Field(
        None, gt=0, description="PRM ranks (FSDP2 shards); null = actor.world_size."
    )
