"""Where the driver's batches come from: one :class:`RolloutSource`, whatever ``trainer.mode``.

The driver asks a source for a step's scored batch, tells it when the actor's weights changed,
has it evaluate the learner's weights, and saves and restores its position with the checkpoint.
It never asks which mode runs; :func:`make_source` picks the source once.

- :class:`SyncSource` (``trainer.mode=sync``): the step draws its prompts, generates with the
  learner's weights, scores, and syncs the weights after the update.
- :class:`AsyncSource` (one_step_off, async): the split replicas generate ahead into a bounded
  buffer the step takes its batch from; weights are synced as ``async.sync_every`` says.

Both hand the scored groups to one :class:`GroupFilter`, DAPO's dynamic sampling
(``algorithm.filter_groups``, arXiv 2503.14476): groups whose rewards are all equal are
dropped and more are generated (or taken), at most ``algorithm.max_gen_rounds`` batches' worth;
if that does not fill the batch, dropped groups top it up (their advantage is zero under a
group baseline).

The modules, each importing only those above it:

- :mod:`.source`: the :class:`RolloutSource` interface and :func:`sampling_params` (seeds
  from seed, step and round, so a resumed synchronous run draws the same samples);
- :mod:`.group_filter`: :class:`GroupFilter`;
- :mod:`.admission`: the staleness bound of generating ahead (:class:`Admission`,
  :func:`trained_by`);
- :mod:`.synchronous`: :class:`SyncSource`;
- :mod:`.ahead`: :class:`AsyncSource`, the producer, the buffer and the sync policy;
- :mod:`.by_mode`: :func:`make_source`.

The names are handed on here, where they were when this was one module.
"""

from treadle.rollout.sources.admission import Admission, trained_by
from treadle.rollout.sources.ahead import AsyncSource
from treadle.rollout.sources.by_mode import make_source
from treadle.rollout.sources.group_filter import GroupFilter
from treadle.rollout.sources.source import (
    EvalRequests,
    EvalScores,
    RolloutSource,
    Score,
    sampling_params,
)
from treadle.rollout.sources.synchronous import SyncSource

__all__ = [
    "Admission",
    "AsyncSource",
    "EvalRequests",
    "EvalScores",
    "GroupFilter",
    "RolloutSource",
    "Score",
    "SyncSource",
    "make_source",
    "sampling_params",
    "trained_by",
]
