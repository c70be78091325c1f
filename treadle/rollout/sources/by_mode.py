"""The one place that reads ``trainer.mode``: :func:`make_source` picks the driver's source once.

``sync``: :class:`~.synchronous.SyncSource`; ``one_step_off`` and ``async``:
:class:`~.ahead.AsyncSource`. The driver never asks which mode runs.
"""

from __future__ import annotations

from treadle.config import Config
from treadle.data import PromptDataset, PromptSampler
from treadle.rollout.fleet import Rollout
from treadle.rollout.sources.ahead import AsyncSource
from treadle.rollout.sources.source import RolloutSource, Score
from treadle.rollout.sources.synchronous import SyncSource


def make_source(
    cfg: Config,
    rollout: Rollout,
    dataset: PromptDataset,
    sampler: PromptSampler,
    score: Score,
    version: int,
) -> RolloutSource:
    """The source ``trainer.mode`` names; ``version``: the weights the replicas start with."""
    if cfg.trainer.mode == "sync":
        return SyncSource(cfg, rollout, dataset, sampler, score)
    return AsyncSource(cfg, rollout, dataset, sampler, score, version)
