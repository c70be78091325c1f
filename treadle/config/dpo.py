"""``dpo``: preference pairs (`treadle dpo`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from treadle.config.base import Section, eval_task_field

DPO_KNOBS = ("label_smoothing", "discopop_tau", "simpo_gamma", "f_divergence", "f_alpha")
"""``dpo`` settings that only some losses read (the ``knobs`` of their registration)."""


class DPOConfig(Section):
    """Preference pairs (`treadle dpo`): rows of a prompt, a chosen and a rejected response
    (`data.prompt_key`, `data.chosen_key`, `data.rejected_key`). Every loss of the DPO family
    compares the policy with the frozen initial model, except the reference-free `orpo` and
    `simpo`, for which no reference model is built. The table of losses, their papers and
    knobs: README, "Preference learning"."""

    beta: float = Field(
        0.1,
        gt=0,
        description="DPO beta: strength of the reference (IPO: tau; ORPO: lambda, the weight "
        "of the odds-ratio term; SimPO: the reward scale, 2.0-2.5 in the paper).",
    )
    loss_type: str = Field(
        "sigmoid",
        description="Preference loss, by registered name: sigmoid, ipo, hinge, robust, "
        "exo_pair, nca_pair, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, "
        "discopop, sigmoid_norm (with a reference); orpo, simpo (reference-free).",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="Label noise epsilon: sigmoid (cDPO), robust, aot, aot_unpaired, simpo; "
        "exo_pair needs it > 0 (1e-3 in the paper).",
    )
    discopop_tau: float = Field(
        0.05, gt=0, description="discopop: temperature of the log-ratio modulation."
    )
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: target reward margin gamma.")
    f_divergence: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = Field(
        "reverse_kl",
        description="f-DPO: the divergence to the reference (reverse_kl: DPO's); for "
        "sigmoid, ipo, hinge, robust, exo_pair, discopop, sigmoid_norm.",
    )
    f_alpha: float = Field(
        0.5, description="f_divergence=alpha_divergence: its alpha (1: the reverse KL)."
    )
    nll_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the chosen responses' token-mean NLL added to the loss "
        "(RPO, arXiv 2404.19733); 0: the preference loss alone (orpo includes it at 1).",
    )
    eval_task: bool = eval_task_field()
