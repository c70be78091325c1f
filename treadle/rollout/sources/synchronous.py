"""The synchronous source (``trainer.mode=sync``): generation inside the step, with the
learner's weights.

The step draws its prompts, generates with the learner's weights, scores, and syncs the weights
after the update; with dynamic sampling it draws fresh prompts for each further round (a prompt
drawn again in a later round is a group of its own). The scores of every group generated, kept
or dropped, go back to the sampler (a curriculum draws by them, ``data.sampler=pass_rate``).
Choices: an evaluation runs at once on the replicas (they hold the learner's weights); ReMax's
baseline (an estimator that needs ``baseline_rewards``) is the score of a greedy response to
each prompt, generated here, which the modes that generate ahead do not offer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from treadle.algorithms import ADV_ESTIMATORS
from treadle.config import Config
from treadle.data import PromptDataset, PromptSampler, prompt_batch
from treadle.engines.inference import SamplingParams
from treadle.protocol import Batch
from treadle.rollout.fleet import Rollout
from treadle.rollout.sources.group_filter import GroupFilter
from treadle.rollout.sources.source import EvalRequests, EvalScores, Score, sampling_params
from treadle.tracking.tracker import timed


@dataclass
class SyncSource:
    """Generation inside the step, with the learner's weights (``trainer.mode=sync``)."""

    cfg: Config
    rollout: Rollout
    dataset: PromptDataset
    sampler: PromptSampler
    score: Score

    def __post_init__(self) -> None:
        # ReMax's baseline: the scores of greedy responses, generated here
        self.greedy = "baseline_rewards" in ADV_ESTIMATORS.needs(self.cfg.algorithm.adv_estimator)

    def sample(self, step: int, m: dict[str, float]) -> Batch:
        """Rounds of fresh prompts (one without dynamic sampling), each generated and scored."""
        groups = GroupFilter(self.cfg)
        rounds = 0
        while not groups.done():
            ds, indices = self.dataset, self.sampler.next_indices()
            prompts = prompt_batch(ds, indices, ds.pad_id)
            if rounds:  # a prompt drawn again in a later round is a group of its own
                prompts["uid"] = [f"{u}/{rounds}" for u in prompts["uid"]]
            with timed(m, "generate"):
                batch = self.rollout.generate(prompts, sampling_params(self.cfg, step, rounds))
            with timed(m, "reward"):
                batch["token_level_scores"] = self.score(batch, m)
            # every group, kept or not, tells a curriculum its prompt's pass rate
            self.sampler.observe(drawn_groups(indices, list(prompts["uid"]), batch))
            if self.greedy:
                with timed(m, "generate_greedy"):
                    batch["baseline_scores"] = self.greedy_scores(prompts, list(batch["uid"]))
            groups.add(batch, failed=len(prompts) - len(set(batch["uid"])))
            rounds += 1
        if groups.on:
            m["rollout/gen_rounds"] = float(rounds)
        m.update(self.rollout.take_counters())
        m.update(self.sampler.pool_metrics())  # data/pool_*: a curriculum's view of the pool
        return groups.batch(m)

    def greedy_scores(self, prompts: Batch, uids: list[str]) -> torch.Tensor:
        """ReMax's baseline: the score of the greedy response to each prompt, for each of the
        rows ``uids`` (a prompt whose greedy run failed: 0)."""
        r = self.cfg.rollout
        out = self.rollout.generate(
            prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=r.max_new_tokens)
        )
        scores = dict(zip(out["uid"], self.score(out, None).sum(-1).tolist(), strict=True))
        return torch.tensor([scores.get(uid, 0.0) for uid in uids])

    def after_update(self, version: int) -> dict[str, float]:
        return self.rollout.sync_weights(version=version)

    def evaluate(self, step: int, requests: EvalRequests, scores: EvalScores) -> dict[str, float]:
        return scores(self.rollout.client.run(requests()))  # synced after every update

    def late_metrics(self, wait: bool) -> dict[int, dict[str, float]]:
        return {}

    def evaluating(self) -> set[int]:
        return set()

    def metrics(self, step_seconds: float) -> dict[str, float]:
        return {}

    def state(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


def drawn_groups(indices: list[int], uids: list[str], batch: Batch) -> dict[int, list[float]]:
    """The scores of each drawn prompt's group, by its dataset index (``indices``, the
    prompts' ``uids``): one score a sample, a session split into segments scored by its best
    segment (as an evaluation scores it); a prompt whose every run failed has none."""
    scores = batch["token_level_scores"].sum(-1).tolist()
    runs = batch["sample_index"].tolist() if "sample_index" in batch else range(len(batch))
    best: dict[str, dict[int, float]] = {}
    for uid, run, score in zip(batch["uid"], runs, scores, strict=True):
        group = best.setdefault(uid, {})
        group[run] = max(score, group.get(run, score))
    return {i: list(best.get(uid, {}).values()) for i, uid in zip(indices, uids, strict=True)}
