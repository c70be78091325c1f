"""What the driver takes its batches from: the :class:`RolloutSource` interface, one for every
``trainer.mode``, and the sampling of a step.

The driver asks a source for a step's scored batch (:meth:`~RolloutSource.sample`), tells it
when the actor's weights changed (:meth:`~RolloutSource.after_update`), has it evaluate the
learner's weights (:meth:`~RolloutSource.evaluate`: now, or beside training with the metrics
later, :meth:`~RolloutSource.late_metrics`), and saves and restores its position with the
checkpoint (:meth:`~RolloutSource.state` / :meth:`~RolloutSource.load_state`). It never asks
which mode runs.

Sampling seeds are derived from (seed, step, round) (:func:`sampling_params`), so a resumed
synchronous run draws the same samples as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import torch

from treadle.config import Config
from treadle.engines.inference import SamplingParams
from treadle.protocol import Batch

Score = Callable[[Batch, dict[str, float] | None], torch.Tensor]
"""The driver's scorer: token-level scores [B, R] of a generated batch; it may log into the
metrics it is given (None: nothing)."""

EvalRequests = Callable[[], Coroutine[Any, Any, Any]]
"""An evaluation's generation: a coroutine on the client's loop (made in the caller's thread)."""
EvalScores = Callable[[Any], dict[str, float]]
"""An evaluation's metrics from what its generation returned (called in the trainer's thread)."""


class RolloutSource(Protocol):
    """What the driver takes its batches from, in every ``trainer.mode``."""

    def sample(self, step: int, m: dict[str, float]) -> Batch:
        """Step ``step``'s ``data.batch_size`` groups of ``rollout.n`` samples, scored
        (``token_level_scores``); its metrics (timings, rollout/, async/) go into ``m``."""
        ...

    def after_update(self, version: int) -> dict[str, float]:
        """The actor's weights are now ``version``: sync them to the replicas (when due)."""
        ...

    def evaluate(self, step: int, requests: EvalRequests, scores: EvalScores) -> dict[str, float]:
        """Evaluate the learner's weights (those of step ``step``): ``requests`` generate on
        the replicas, ``scores`` make the metrics of what they return. Now, the metrics
        returned; or beside training, ``{}`` returned and the metrics by :meth:`late_metrics`."""
        ...

    def late_metrics(self, wait: bool) -> dict[int, dict[str, float]]:
        """The metrics of the evaluations finished since the last call, by the step whose
        weights they evaluated; ``wait``: every one in flight (at the end of a run)."""
        ...

    def evaluating(self) -> set[int]:
        """The steps whose evaluation is in flight."""
        ...

    def metrics(self, step_seconds: float) -> dict[str, float]:
        """Metrics of the whole step (``step_seconds`` long), after it ran."""
        ...

    def state(self) -> dict[str, Any]:
        """The data position a checkpoint keeps (``sampler``, and ``async`` when ahead)."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state` of the checkpoint a run resumes from."""
        ...


def sampling_params(cfg: Config, step: int, round_: int = 0) -> SamplingParams:
    """``rollout``'s sampling for step ``step``, round ``round_`` (its own seed)."""
    r = cfg.rollout
    return SamplingParams(
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        seed=cfg.trainer.seed * 100_003 + step + round_ * 1_000_003,
        ignore_eos=r.ignore_eos,
    )
