"""Held-out accuracy and the reward function's scores, for every driver and ``treadle eval``.

Accuracy is the fraction of held-out prompts (the first ``data.val_size``, all by default)
whose one greedy sample the reward function scores 1.0.
"""

from __future__ import annotations

import math

from treadle.config import Config
from treadle.data import PromptDataset, prompt_batch
from treadle.engines.inference import SamplingParams
from treadle.errors import ConfigError
from treadle.faults import failpoint
from treadle.protocol import Batch
from treadle.rewards import Scorer
from treadle.rollout.fleet import Rollout, start_rollout
from treadle.trainers.prompts import held_out, load_prompts
from treadle.trainers.roles import build_actors


def evaluate(
    cfg: Config, rollout: Rollout, ds: PromptDataset, pad_id: int, scorer: Scorer
) -> float:
    """Held-out accuracy (fraction of reward 1.0) with greedy decoding, one sample each."""
    batch = prompt_batch(ds, held_out(cfg, ds), pad_id)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
    failpoint("eval")
    out = rollout.generate(batch, greedy)
    rollout.take_counters()  # (an evaluation's failed agent runs count as wrong, not as errors)
    scores = rule_scores(scorer, out)
    # per prompt: a failed agent run counts as wrong, a session split into segments once
    right = {uid for uid, s in zip(out["uid"], scores, strict=True) if s >= 1.0}
    return len(right) / max(len(batch), 1)


def make_scorer(cfg: Config) -> Scorer:
    """``reward.function``, called as ``reward.num_workers`` and ``reward.timeout_s`` say."""
    r = cfg.reward
    return Scorer(r.function, r.num_workers, r.timeout_s)


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
    scores = scorer(
        list(part["prompt_text"]), list(part["response_text"]), list(part["ground_truth"]), rows
    )
    if len(todo) == len(batch):
        return scores
    for i, score in zip(todo, scores, strict=True):
        given[i] = score
    return given


def evaluate_model(cfg: Config) -> float:
    """Held-out accuracy of ``model.path`` (a model folder or a checkpoint's model)."""
    if not cfg.data.has_val:
        raise ConfigError("data.val_files is empty: eval needs held-out prompts")
    val = load_prompts(cfg, cfg.data.val_files, "data.val_files")
    if not cfg.model.path:
        raise ConfigError("model.path is empty: give a local Hugging Face model folder")
    # A one-off greedy pass: the replicas live in the actor's processes whatever the placement.
    colocated = cfg.rollout.model_copy(
        update={"placement": "colocated", "replicas": None, "num_cpus": None, "ray_resources": {}}
    )
    cfg = cfg.model_copy(update={"rollout": colocated})
    actors = build_actors(cfg, cfg.model.path, with_ref=False)
    try:
        rollout = start_rollout(cfg, actors.group, cfg.model.path, 0)
        try:
            with make_scorer(cfg) as scorer:
                return evaluate(cfg, rollout, val, val.pad_id, scorer)
        finally:
            rollout.close()
    finally:
        actors.close()
