"""Held-out evaluation of named validation sets, for every driver and ``treadle eval``.

A run's validation sets (:func:`load_val_sets`) are ``data.val_files`` (or reasoning-gym's
held-out rows), the set named ``val``, and every ``data.val_sets`` entry, each with its own
reward function (default ``reward.function``) and its first ``size`` rows (``val``:
``data.val_size``). :func:`evaluate_sets` generates ``eval.n`` samples per prompt with the
evaluation-only sampling of the ``eval`` section (greedy, one sample, by default), scores them
with the set's reward, and reports per set (:mod:`treadle.algorithms.sampled` does the math):

- ``eval/<set>/accuracy``: the fraction of samples scored 1.0 (or more), averaged over the
  prompts (greedy: the fraction of prompts right); ``eval/<set>/reward``: the mean score;
- with ``eval.n`` > 1 also ``mean@n``, ``std@n``, ``pass@k`` (Chen et al.'s unbiased
  estimator), ``best@k``, ``worst@k`` and ``maj@k`` with their bootstrap ``/std``, as verl 0.9.1
  reports them, for k = 2, 4, ... up to n;
- the same per data source, ``eval/<set>/<source>/<metric>``, when the rows carry one: a
  ``data_source`` column (verl's convention) or, for reasoning-gym's rows, the dataset that made
  them (``metadata.source_dataset``); a row without one is ``unknown``.

A sample is one agent run: a session split into segments is scored by its best segment, and a
failed run counts as a sample scored 0 with no answer. maj@k votes on the answer the set's
reward reads, for the built-in rewards (:func:`treadle.rewards.functions.answer_reader`: arithmetic,
chat_arithmetic, calculator, reasoning_gym); for any other reward on the whole response,
stripped (a reward's dict may hold numbers only, so a user function cannot name its answer).
An answer that cannot be read is "" (those samples vote together, for "no answer").
Sampling uses ``eval.seed``, the bootstrap too: the same weights give the same numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from treadle.algorithms.sampled import PromptSamples, sampled_metrics
from treadle.config import Config
from treadle.config.data import VAL
from treadle.controller import Actors
from treadle.data import PromptDataset, prompt_batch
from treadle.engines.inference import SamplingParams
from treadle.protocol import Batch
from treadle.rewards import Judge, Scorer, answer_reader
from treadle.rewards.service import ServiceOptions
from treadle.rollout.fleet import Rollout, start_rollout
from treadle.runtime.errors import ConfigError, RewardError
from treadle.runtime.faults import failpoint
from treadle.tracking.tracker import quiet_start
from treadle.trainers.datasets import val_set_prompts
from treadle.trainers.prompts import load_prompts, tokenizer, tool_schemas
from treadle.trainers.roles import build_actors


@dataclass
class ValSet:
    """One validation set: its prompts ``ds``, the rows of it evaluated, its reward (``reward``,
    scored by ``scorer``, whose processes start on first use: :meth:`close` it), and each
    evaluated row's data source (None: the rows carry none)."""

    name: str
    ds: PromptDataset
    rows: list[int]
    reward: str
    scorer: Scorer
    sources: list[str] | None = None
    answer: Callable[[str, Mapping[str, Any]], str] = field(init=False)

    def __post_init__(self) -> None:
        self.answer = answer_reader(self.reward)

    def close(self) -> None:
        self.scorer.close()


def make_scorer(
    cfg: Config, spec: str | None = None, key: str = "reward.function", judge: Judge | None = None
) -> Scorer:
    """``spec`` (default ``reward.function``), called as ``reward.num_workers`` and
    ``reward.timeout_s`` say; a bad spec is a ConfigError naming ``key``. Without ``spec``: the
    run's reward, with the reward service ``reward.url`` and the weights when there is one, and
    the training samples' ``judge`` (``reward.judge``) when given (held-out sets have none:
    ``reward.eval_rule_weight``)."""
    r = cfg.reward
    if spec is not None:
        return Scorer(spec, r.num_workers, r.timeout_s, key)
    service = r.url and ServiceOptions(
        r.url, r.url_batch_size, r.url_concurrency, r.url_timeout_s, r.url_retries,
        r.url_backoff_s, r.url_auth_env, r.url_weight,
    )  # fmt: skip
    weight = r.rule_weight if judge is not None else r.eval_rule_weight
    return Scorer(r.function, r.num_workers, r.timeout_s, key, service or None, weight, judge)


def scorer_metrics(scorer: Scorer, sets: Mapping[str, ValSet]) -> dict[str, float]:
    """``reward/worker_restarts``: the reward processes that died and were started again, in
    training's pool and the sets' (none when no scorer has a pool); and what the training
    scorer's last judged batch reports (``reward/judge_*``, ``timing/judge``: reward.judge)."""
    scorers = [scorer, *(s.scorer for s in sets.values())]
    judged = dict(scorer.last)
    if all(s.pool is None for s in scorers):
        return judged
    return {"reward/worker_restarts": float(sum(s.restarts for s in scorers)), **judged}


def first_rows(ds: PromptDataset, size: int | None) -> list[int]:
    """The rows of ``ds`` evaluated: the first ``size`` (all when None)."""
    return list(range(len(ds) if size is None else min(size, len(ds))))


def data_sources(ds: PromptDataset, rows: list[int]) -> list[str] | None:
    """Each row's data source (``data_source``, or reasoning-gym's ``source_dataset``); None
    when no row carries one."""
    found = []
    for i in rows:
        row = ds[i]["row"]
        meta = row.get("metadata")
        gym = meta.get("source_dataset") if isinstance(meta, dict) else None
        found.append(row.get("data_source", gym))
    if all(s is None for s in found):
        return None
    return ["unknown" if s is None else str(s) for s in found]


def load_val_sets(cfg: Config) -> dict[str, ValSet]:
    """Every validation set of the run (see the module docstring), ``val`` first."""
    sets: dict[str, ValSet] = {}
    try:
        for name in cfg.data.set_names:
            if name == VAL and cfg.data.has_val:
                ds = load_prompts(cfg, cfg.data.val_files, "data.val_files")
                rows, spec, key = first_rows(ds, cfg.data.val_size), None, "reward.function"
            else:
                s = cfg.data.val_sets[name]
                ds = val_set_prompts(cfg, name, tokenizer(cfg), tool_schemas(cfg))
                rows, spec, key = first_rows(ds, s.size), s.reward, f"data.val_sets.{name}.reward"
            scorer = make_scorer(cfg, spec, key)
            sets[name] = ValSet(name, ds, rows, scorer.spec, scorer, data_sources(ds, rows))
    except BaseException:
        close_sets(sets)
        raise
    return sets


def close_sets(sets: Mapping[str, ValSet]) -> None:
    for s in sets.values():
        s.close()


def eval_params(cfg: Config) -> SamplingParams:
    """The ``eval`` section's sampling (``max_new_tokens``: ``rollout.max_new_tokens`` if
    null)."""
    e = cfg.eval
    return SamplingParams(
        n=e.n,
        temperature=e.temperature,
        top_p=e.top_p,
        max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
        seed=e.seed,
    )


async def agenerate_sets(
    rollout: Rollout, sets: Mapping[str, ValSet], params: SamplingParams
) -> dict[str, Batch]:
    """Every set's ``params.n`` samples per evaluated prompt, all sent at once (their failed
    runs count as wrong answers, not in ``agent/errors``)."""
    batches = [prompt_batch(s.ds, s.rows, s.ds.pad_id) for s in sets.values()]
    outs = await asyncio.gather(*(rollout.agenerate(b, params, count=False) for b in batches))
    return dict(zip(sets, outs, strict=True))


def score_sets(
    cfg: Config, sets: Mapping[str, ValSet], outs: Mapping[str, Batch]
) -> dict[str, float]:
    """Every set's metrics from its samples ``outs`` (:func:`agenerate_sets`), and
    ``eval/weight_version``: the oldest weights any evaluated token came from."""
    metrics: dict[str, float] = {}
    for name, s in sets.items():
        metrics.update(set_metrics(s, outs[name], cfg.eval.n, cfg.eval.seed))
    versions = [
        int(b["weight_version"].min()) for b in outs.values() if len(b) and "weight_version" in b
    ]
    if versions:
        metrics["eval/weight_version"] = float(min(versions))
    return metrics


def set_metrics(s: ValSet, out: Batch, n: int, seed: int) -> dict[str, float]:
    """``eval/<set>/...`` of the samples ``out`` (``n`` per prompt) of set ``s``."""
    scores = rule_scores(s.scorer, out) if len(out) else []
    best: dict[int, tuple[float, str]] = {}  # sample -> (its best segment's score, its answer)
    for i, score, text, row in zip(
        out["sample_index"].tolist(), scores, out["response_text"], out["row"], strict=True
    ):
        if i not in best or score > best[i][0]:
            best[i] = (score, s.answer(text, row))
    prompts = []
    for p in range(len(s.rows)):
        got = [best.get(p * n + j, (0.0, "")) for j in range(n)]  # a failed run: 0, no answer
        prompts.append(
            PromptSamples(
                [score for score, _ in got],
                [1.0 if score >= 1.0 else 0.0 for score, _ in got],
                [answer for _, answer in got],
            )
        )
    metrics = sampled_metrics(prompts, s.sources, seed)
    return {f"eval/{s.name}/{key}": value for key, value in metrics.items()}


def evaluate_sets(cfg: Config, rollout: Rollout, sets: Mapping[str, ValSet]) -> dict[str, float]:
    """Every set's metrics (see the module docstring) with the replicas' present weights."""
    if not sets:
        return {}
    failpoint("eval")
    outs = rollout.client.run(agenerate_sets(rollout, sets, eval_params(cfg)))
    return score_sets(cfg, sets, outs)


def rule_scores(scorer: Scorer, batch: Batch) -> list[float]:
    """The score of every sample of ``batch``: its agent's own reward where it gave one
    (``trajectory_reward``), the reward function's elsewhere (a batched reward also gets the
    columns of the data rows)."""
    given = (
        batch["trajectory_reward"].tolist()
        if "trajectory_reward" in batch
        else [math.nan] * len(batch)
    )
    todo = [i for i, r in enumerate(given) if math.isnan(r)]
    if not todo:
        return given
    part = batch if len(todo) == len(batch) else batch.select(todo)
    rows = list(part["row"]) if "row" in part else None
    try:
        scores = scorer(
            list(part["prompt_text"]), list(part["response_text"]), list(part["ground_truth"]), rows
        )
    except RewardError as e:  # "sample 2" is a place in the batch: name the data row too
        if e.sample is None or "uid" not in part:
            raise
        raise RewardError(f"{e}; its data row: {part['uid'][e.sample]}") from e
    if len(todo) == len(batch):
        return scores
    for i, score in zip(todo, scores, strict=True):
        given[i] = score
    return given


def evaluate_model(cfg: Config) -> dict[str, float]:
    """Every validation set's metrics with the weights of ``model.path`` (a model folder or a
    checkpoint's model)."""
    if not cfg.data.set_names:
        raise ConfigError("data.val_files and data.val_sets are empty: eval needs held-out prompts")
    if not cfg.model.path:
        raise ConfigError("model.path is empty: give a local Hugging Face model folder")
    sets = load_val_sets(cfg)
    try:
        with evaluation_rollout(cfg, cfg.model.path, 0) as (_, rollout):
            return evaluate_sets(cfg, rollout, sets)
    finally:
        close_sets(sets)


def colocated(cfg: Config) -> Config:
    """``cfg`` with the replicas in the actor's processes: a one-off evaluation needs no
    others, whatever the run's placement."""
    update: dict[str, Any] = {
        "placement": "colocated",
        "replicas": None,
        "num_cpus": None,
        "ray_resources": {},
    }
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=update)})


@contextlib.contextmanager
def evaluation_rollout(cfg: Config, start: str, version: int) -> Iterator[tuple[Actors, Rollout]]:
    """The actors (no reference) from the weights at ``start`` (version ``version``) and their
    colocated replicas, for an evaluation outside training; closed on the way out. While they
    start, this process's output goes to the run's logs when they are routed there."""
    cfg = colocated(cfg)
    with quiet_start():
        actors = build_actors(cfg, start, with_ref=False)
    try:
        with quiet_start():
            rollout = start_rollout(cfg, actors.group, start, version)
        try:
            yield actors, rollout
        finally:
            rollout.close()
    finally:
        actors.close()
