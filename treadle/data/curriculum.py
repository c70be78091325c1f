"""A curriculum over the prompt pool (``data.sampler=pass_rate``): prompts drawn by their recent
pass rate, read from the rollouts the run already made.

The rule is "sampling for learnability" (Foster et al. 2025, *Learning to Reason at the
Frontier of Learnability*; Bae et al. 2025, *Online Difficulty Filtering*): a prompt whose
responses pass with probability ``p`` gives a group-baseline estimator (GRPO, RLOO, DAPO)
gradient signal in proportion to the variance of its reward, ``p (1 - p)``; a prompt always or
never solved gives none (its advantages are all 0, which is why DAPO's dynamic sampling throws
such groups away after paying for their rollouts). So a prompt's weight is

    w(p) = max(p (1 - p), (1 - p) floor + p solved)

and a prompt never drawn has the weight ``unseen``. The floor (``floor`` at p = 0, ``solved``
at p = 1, linear between) keeps the unsolved ones in play (the policy may come to solve them)
and draws the solved ones now and then (forgetting shows), the solved less than the unsolved by
default; the prompts being learned get the most. Weights are relative: a batch is
``batch_size`` distinct prompts drawn without replacement with probabilities proportional to
them.

``p`` is a prompt's recent pass rate: the share of its group's responses whose score is at
least ``threshold``, folded into an exponential moving average (``ema``: the newest group's
weight) each time the prompt is drawn. Nothing is generated for it: the groups of every step
are what the rollout made anyway, dropped ones included.

Resume is exact: a draw is seeded by ``(seed, draws so far)`` and the state is that count and
the pass rates of the prompts seen (floats, which JSON writes back exactly), so a resumed run
draws the prompts the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treadle.runtime.errors import DataError

KIND = "pass_rate"  # the state's "kind", which a uniform sampler refuses to load


@dataclass(frozen=True)
class PassRateRule:
    """The knobs of the rule (``data.pass_rate_*``; see the module docstring)."""

    threshold: float = 1.0  # a response passes when its score is at least this
    ema: float = 0.5  # the newest group's weight in a prompt's pass rate (1: the latest only)
    unseen: float = 0.25  # a prompt never drawn (0.25: the most p(1 - p) can be)
    floor: float = 0.05  # the weight of a prompt never solved (p = 0)
    solved: float = 0.01  # the weight of a prompt always solved (p = 1)


def group_pass_rate(scores: Sequence[float], threshold: float) -> float:
    """The share of a group's responses scored ``threshold`` or more."""
    return sum(s >= threshold for s in scores) / len(scores)


def updated_rate(old: float, observed: float, ema: float) -> float:
    """A prompt's pass rate after a new group: the observed rate the first time (``old`` is
    NaN), else ``old`` moved ``ema`` of the way to it."""
    return observed if np.isnan(old) else old + ema * (observed - old)


def floors(p: np.ndarray, rule: PassRateRule) -> np.ndarray:
    """The floor under the learnability: ``floor`` at p = 0 to ``solved`` at p = 1, linear
    between."""
    return (1 - p) * rule.floor + p * rule.solved


def pass_rate_weights(rates: np.ndarray, rule: PassRateRule) -> np.ndarray:
    """Each prompt's weight from its pass rate (NaN: never drawn): ``unseen``, or the
    larger of ``p (1 - p)`` and the floor."""
    p = np.nan_to_num(rates)
    w = np.maximum(p * (1 - p), floors(p, rule))
    return np.where(np.isnan(rates), rule.unseen, w)


def pool_metrics(rates: np.ndarray, rule: PassRateRule) -> dict[str, float]:
    """The pool's difficulty: the share of prompts seen, their mean pass rate, and the shares of
    the pool being learned (weight ``p (1 - p)``), solved or unsolved (weight the floor, above
    or below p = 1/2)."""
    seen = ~np.isnan(rates)
    p = rates[seen]
    learning = p * (1 - p) >= floors(p, rule)
    n = len(rates)
    out = {
        "data/pool_seen": float(seen.sum()) / n,
        "data/pool_learning": float(learning.sum()) / n,
        "data/pool_solved": float((~learning & (p > 0.5)).sum()) / n,
        "data/pool_unsolved": float((~learning & (p <= 0.5)).sum()) / n,
    }
    if len(p):  # (no mean of nothing: a metric that is not finite stops a run)
        out["data/pool_pass_rate"] = float(p.mean())
    return out


class PassRateSampler:
    """Batches of ``batch_size`` distinct prompts drawn by :func:`pass_rate_weights`;
    :meth:`observe` hands it the scores of the groups the rollout made."""

    def __init__(self, n: int, batch_size: int, seed: int, rule: PassRateRule) -> None:
        if batch_size <= 0 or seed < 0:
            raise ValueError(f"need batch_size > 0 and seed >= 0, got {batch_size}, {seed}")
        if n < batch_size:
            raise DataError(
                f"the dataset has {n} rows, fewer than one batch of {batch_size}: "
                "lower data.batch_size or add rows"
            )
        self.n, self.batch_size, self.seed, self.rule = n, batch_size, seed, rule
        self.draws = 0
        self.rates = np.full(n, np.nan)  # NaN: never drawn

    def next_indices(self) -> list[int]:
        """The next batch: distinct prompts, with probabilities proportional to the weights."""
        w = pass_rate_weights(self.rates, self.rule)
        rng = np.random.default_rng([self.seed, self.draws])
        self.draws += 1
        picked = rng.choice(self.n, size=self.batch_size, replace=False, p=w / w.sum())
        return [int(i) for i in picked]

    def observe(self, groups: Mapping[int, Sequence[float]]) -> None:
        """The scores of each drawn prompt's group (a prompt whose every run failed: none)."""
        rule = self.rule
        for index, scores in groups.items():
            if scores:
                observed = group_pass_rate(scores, rule.threshold)
                self.rates[index] = updated_rate(float(self.rates[index]), observed, rule.ema)

    def pool_metrics(self) -> dict[str, float]:
        return pool_metrics(self.rates, self.rule)

    def state_dict(self) -> dict[str, Any]:
        seen = np.flatnonzero(~np.isnan(self.rates))
        return {
            "kind": KIND,
            "draws": self.draws,
            "seed": self.seed,
            "n": self.n,
            "seen": seen.tolist(),
            "rates": self.rates[seen].tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != KIND:
            raise DataError(
                "the checkpoint's prompts were drawn uniformly (data.sampler=uniform), this "
                "run draws them by pass rate: resume with data.sampler=uniform, or start a "
                "new run (another trainer.output_dir)"
            )
        if state["n"] != self.n:
            raise DataError(
                f"the checkpoint's sampler was saved for a dataset of {state['n']} rows, this "
                f"one has {self.n}: the data changed since the checkpoint"
            )
        self.draws, self.seed = int(state["draws"]), int(state["seed"])
        self.rates = np.full(self.n, np.nan)
        self.rates[np.asarray(state["seen"], dtype=np.int64)] = state["rates"]
