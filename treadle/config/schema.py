"""``Config``: every section of a run, validated with the cross-field rules of
``treadle.config.rules`` when it is built (and when a section is assigned)."""

from __future__ import annotations

from pydantic import model_validator

from treadle.config import rules
from treadle.config.run import Sections


class Config(Sections):
    """A whole run: one YAML file, sections as below."""

    @model_validator(mode="after")
    def _check_old_log_probs(self) -> Config:
        problem = rules.old_log_probs_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Config:
        # Every broken rule is reported (one line each), not only the first.
        problems = list(rules.config_problems(self))
        if problems:
            raise ValueError("\n".join(problems))
        return self
