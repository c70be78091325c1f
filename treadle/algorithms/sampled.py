"""Metrics of sampled evaluation: several samples per prompt, as verl 0.9.1 reports them.

Pure math on plain lists (numpy only, no torch, no config): the evaluation driver
(:mod:`treadle.trainers.evaluation`) gives, per prompt, each sample's score, whether it is right
(``acc``: 1.0 or 0.0) and its predicted answer (``pred``, a string the votes are counted on),
and gets named numbers back. Every prompt's metric is computed alone, then averaged over the
prompts (over all of them, and over those of each data source).

With ``n`` samples per prompt and ``k`` in ``2, 4, 8, ... , n`` (verl's ``gen_ns``: powers of
two below ``n``, then ``n``):

- ``accuracy``: the mean of ``acc`` over a prompt's samples (verl's ``mean@n``; the fraction
  of prompts right when ``n`` is 1); ``reward``: the mean score.
- ``accuracy/stderr``: the standard error of ``accuracy`` over the prompts (not in verl): the
  standard deviation of the prompts' accuracies over the square root of their number; with one
  sample per prompt it is the binomial ``sqrt(p (1 - p) / prompts)``. The prompts are the
  sample the set was drawn as: several samples of one prompt are not independent questions.
- ``mean@n`` (= ``accuracy``) and ``std@n``: the mean and the population standard deviation of
  ``acc`` over the prompt's ``n`` samples (verl's ``mean@N`` and ``std@N``).
- ``pass@k``: the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374),
  ``1 - C(n-c, k) / C(n, k)`` with ``c`` samples right: the chance that at least one of ``k``
  samples drawn without replacement is right. Exact (integer binomials), no bootstrap.
- ``best@k``, ``worst@k``, ``maj@k`` and their ``/std``: verl's ``bootstrap_metric``: 1000
  subsets of ``k`` samples drawn with replacement (``numpy``'s legacy generator seeded with
  ``seed`` for every prompt and every ``k``, as verl seeds it), the mean (and the standard
  deviation) over subsets of the best ``acc``, the worst, and the ``acc`` of the majority answer
  (verl's ``calc_maj_val``: the most frequent ``pred``, ties to the one seen first in the subset,
  and the ``acc`` of its first sample). verl names the means ``best@k/mean``; here they are
  ``best@k`` and the spread ``best@k/std``.

verl also reports these for every numeric variable of its reward's extra info; here they are
reported for ``acc`` only (and the mean of the score as ``reward``). The numbers equal verl's
``process_validation_metrics`` on the same samples (``tests/algorithms/test_sampled.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

N_BOOTSTRAP = 1000  # verl's


@dataclass(frozen=True)
class PromptSamples:
    """One prompt's samples: each one's score, whether it is right (1.0/0.0), its answer."""

    scores: Sequence[float]
    acc: Sequence[float]
    preds: Sequence[str]


def sizes(n: int) -> list[int]:
    """The subset sizes reported for ``n`` samples: 2, 4, 8, ... below ``n``, then ``n``
    (none for one sample), as verl's ``gen_ns``."""
    if n <= 1:
        return []
    out, k = [], 2
    while k < n:
        out.append(k)
        k *= 2
    return [*out, n]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k of ``c`` right samples out of ``n``: the chance that at
    least one of ``k`` drawn without replacement is right, ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 0 < k <= n (n={n}, c={c}, k={k})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority(acc: np.ndarray, votes: np.ndarray) -> np.ndarray:
    """Per row of ``votes`` (subsets x k answer codes) the ``acc`` of the majority answer:
    the most frequent code, ties to the one that comes first, its first sample's ``acc``
    (verl's ``calc_maj_val``, row by row)."""
    counts = (votes[:, :, None] == votes[:, None, :]).sum(-1)  # how often each entry's code occurs
    # the first entry whose code has the most votes is that code's first occurrence, and of the
    # codes with the most votes the one seen first (a dict's insertion order in verl)
    first = (counts == counts.max(-1, keepdims=True)).argmax(-1)
    return acc[np.arange(len(acc)), first]


def bootstrap(
    acc: Sequence[float], preds: Sequence[str], k: int, seed: int, n_bootstrap: int = N_BOOTSTRAP
) -> dict[str, tuple[float, float]]:
    """(mean, std) over ``n_bootstrap`` subsets of ``k`` samples of the best, worst and
    majority ``acc``, as verl's ``bootstrap_metric`` draws and reduces them."""
    values = np.asarray(acc, dtype=np.float64)
    _, codes = np.unique(np.asarray(preds, dtype=object).astype(str), return_inverse=True)
    idx = np.random.RandomState(seed).choice(len(values), size=(n_bootstrap, k), replace=True)
    picked = values[idx]
    reduced = {
        "best": picked.max(-1),
        "worst": picked.min(-1),
        "maj": majority(picked, codes.reshape(-1)[idx]),
    }
    return {name: (float(np.mean(r)), float(np.std(r))) for name, r in reduced.items()}


def prompt_metrics(p: PromptSamples, seed: int) -> dict[str, float]:
    """The metrics of one prompt (see the module docstring)."""
    n = len(p.acc)
    if not n or len(p.scores) != n or len(p.preds) != n:
        raise ValueError(
            f"a prompt needs as many scores, acc and preds as samples, at least one "
            f"(got {len(p.scores)}, {n}, {len(p.preds)})"
        )
    acc = np.asarray(p.acc, dtype=np.float64)
    out = {"accuracy": float(np.mean(acc)), "reward": float(np.mean(p.scores))}
    if n == 1:
        return out
    out[f"mean@{n}"], out[f"std@{n}"] = out["accuracy"], float(np.std(acc))
    right = int(sum(a >= 1.0 for a in p.acc))
    for k in sizes(n):
        out[f"pass@{k}"] = pass_at_k(n, right, k)
        for name, (mean, std) in bootstrap(p.acc, p.preds, k, seed).items():
            out[f"{name}@{k}"], out[f"{name}@{k}/std"] = mean, std
    return out


def mean_metrics(per_prompt: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each metric averaged over the prompts that have it, in their order (as verl does)."""
    gathered: dict[str, list[float]] = {}
    for metrics in per_prompt:
        for name, value in metrics.items():
            gathered.setdefault(name, []).append(value)
    return {name: float(np.mean(values)) for name, values in gathered.items()}


def standard_error(values: Sequence[float]) -> float:
    """The standard error of the mean of ``values``: their (population) standard deviation over
    the square root of their number; for 0/1 values, ``sqrt(p (1 - p) / n)``."""
    return float(np.std(values) / math.sqrt(len(values)))


def set_summary(per_prompt: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The prompts' metrics averaged (:func:`mean_metrics`) and ``accuracy/stderr``."""
    stderr = standard_error([m["accuracy"] for m in per_prompt])
    return {**mean_metrics(per_prompt), "accuracy/stderr": stderr}


def sampled_metrics(
    prompts: Sequence[PromptSamples], sources: Sequence[str] | None = None, seed: int = 42
) -> dict[str, float]:
    """The metrics over ``prompts`` (``name``), and per data source (``<source>/name``) when
    ``sources`` gives one per prompt."""
    per_prompt = [prompt_metrics(p, seed) for p in prompts]
    out = set_summary(per_prompt)
    if sources is not None:
        by_source: dict[str, list[dict[str, float]]] = {}
        for source, metrics in zip(sources, per_prompt, strict=True):
            by_source.setdefault(source, []).append(metrics)
        for source, group in by_source.items():
            out.update({f"{source}/{k}": v for k, v in set_summary(group).items()})
    return out
