"""``kto``: unpaired examples (`treadle kto`)."""

from __future__ import annotations

from pydantic import Field

from treadle.config.base import Section, eval_task_field


class KTOConfig(Section):
    """Unpaired examples (`treadle kto`): rows of a prompt, a completion and a boolean label
    (`data.prompt_key`, `data.completion_key`, `data.label_key`; true: desirable), as TRL's
    unpaired preference format. A file of pairs (`data.chosen_key`, `data.rejected_key`)
    is read as two examples per pair, the chosen one desirable."""

    beta: float = Field(0.1, gt=0, description="KTO beta: strength of the reference.")
    loss_type: str = Field(
        "kto", description="Unpaired loss, by registered name: kto, apo_zero_unpaired."
    )
    desirable_weight: float = Field(
        1.0,
        gt=0,
        description="lambda_D, the weight of desirable examples; with unbalanced data keep "
        "lambda_D n_D / (lambda_U n_U) in [1, 4/3] (the paper).",
    )
    undesirable_weight: float = Field(
        1.0, gt=0, description="lambda_U, the weight of undesirable examples."
    )
    nll_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the desirable completions' token-mean NLL added to the loss "
        "(as dpo.nll_coef; not in TRL's KTO); 0: the KTO loss alone.",
    )
    eval_task: bool = eval_task_field()
