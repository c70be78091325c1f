"""Held-out accuracy and the reward function's scores, for every driver and ``treadle eval``.

Accuracy is the fraction of held-out prompts (the first ``data.val_size``, all by default)
whose one greedy sample the reward function scores 1.0.
"""

from __future__ import annotations

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
    scores = rule_scores(scorer, out)
    return sum(1.0 for s in scores if s >= 1.0) / max(len(scores), 1)


def make_scorer(cfg: Config) -> Scorer:
    """``reward.function``, called as ``reward.num_workers`` and ``reward.timeout_s`` say."""
    r = cfg.reward
    return Scorer(r.function, r.num_workers, r.timeout_s)


def rule_scores(scorer: Scorer, batch: Batch) -> list[float]:
    """The reward function's score of every sample of ``batch`` (a batched reward also gets
    the columns of the data rows)."""
    rows = list(batch["row"]) if "row" in batch else None
    return scorer(
        list(batch["prompt_text"]), list(batch["response_text"]), list(batch["ground_truth"]), rows
    )


def evaluate_model(cfg: Config) -> float:
    """Held-out accuracy of ``model.path`` (a model folder or a checkpoint's model)."""
    if not cfg.data.val_files:
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
