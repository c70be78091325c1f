"""``eval``: how held-out prompts are sampled when a run (or ``treadle eval``) evaluates."""

from __future__ import annotations

from pydantic import Field

from treadle.config.base import Section


class EvalConfig(Section):
    """Evaluation-only sampling: greedy (``n: 1``, ``temperature: 0``) by default; with
    ``n`` > 1 the sampled metrics (mean@k, pass@k, maj@k, best@k, worst@k) are reported too."""

    n: int = Field(
        1,
        gt=0,
        description="Samples per held-out prompt; above 1 also mean@n, pass@k, maj@k, best@k "
        "and worst@k (k = 2, 4, ... up to n), as verl reports them.",
    )
    temperature: float = Field(
        0.0, ge=0, description="Sampling temperature of evaluation (0: greedy decoding)."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of evaluation.")
    max_new_tokens: int | None = Field(
        None, gt=0, description="Longest evaluated response; null: rollout.max_new_tokens."
    )
    seed: int = Field(
        42,
        ge=0,
        description="Seed of evaluation's sampling and of the bootstrap of best@k, worst@k and "
        "maj@k (verl's default, 42): the same weights give the same numbers.",
    )
