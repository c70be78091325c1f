"""The staleness bound of the modes that generate ahead: when a step-batch may start, and when
the trainer may take the buffer's first groups.

A step-batch is the ``data.batch_size`` prompts the sampler gives for one step, sent
together (:mod:`.ahead`); its groups enter the buffer when they finish.

- **Staleness.** A sample's version is the oldest weight version of its tokens; its staleness
  is the learner's version (the step of the actor's last update) minus that. A step-batch
  starts only while the buffer, with what is in flight, has room (``async.buffer_groups``,
  default ``(max_staleness + 1) x data.batch_size``), and ``async.admission`` says how the
  bound ``async.max_staleness`` is kept:

  - ``bounded`` (the default) admits work so that it cannot go stale. The trainer takes groups
    oldest first, waiting for an older group still generating rather than take a newer one
    past it, and every step takes at least ``data.batch_size`` groups, so the group ``p``
    places behind the front of those started and not yet taken is trained by step
    :func:`trained_by` at the latest. A step-batch starts only when its last group will be
    trained by then within the bound of the replicas' version now (its oldest token's version
    at worst, with partial rollouts too). Groups dynamic sampling takes on top only come
    earlier; a trainer waiting for them takes them in its current step, which the sync rule
    (``sync_every <= max_staleness + 1``) keeps within the bound. Nothing is dropped (tinker
    cookbook PR 822: dropping favours prompts that finish fast).
  - ``drop`` starts step-batch ``s`` once the replicas hold version ``s - 1 - max_staleness``
    or newer; the trainer takes whichever groups finished first, and a sample that is older
    than the bound when taken (it finished after a later step-batch, or waited behind others)
    is dropped and counted.

  Either way a sample still outside the bound when taken is dropped and counted
  (``async/dropped``). ``max_staleness: 0`` is synchronous training, sample for sample;
  ``one_step_off`` is ``max_staleness: 1`` with a sync after every update and no partial
  rollouts: step t+1's samples are generated with the weights before step t's update while
  step t trains.

:class:`Admission` holds the two rules, :func:`trained_by` the arithmetic the bounded one rests
on, and :class:`Group` is what the buffer holds. Pure: no threads, no clock, no client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from treadle.protocol import Batch


@dataclass
class Group:
    """A finished group in the buffer."""

    step: int  # the step-batch it was drawn for (and sampled with the seed of)
    index: int  # its prompt's place in that step-batch
    batch: Batch  # its rollout.n samples


@dataclass(frozen=True)
class Admission:
    """``async.admission``: whether a step-batch may start now for the staleness bound, and
    whether the trainer may take the buffer's first groups (see the module docstring)."""

    bounded: bool
    max_staleness: int
    batch_size: int

    def fresh(
        self, step: int, count: int, version: int, ahead: int, at: tuple[int, int], waiting: int
    ) -> bool:
        """Step-batch ``step``'s ``count`` groups, started now with the replicas' ``version``
        behind the ``ahead`` groups started and not yet taken; ``at``: the step the trainer
        takes groups for and how many it took, ``waiting``: how many more it waits for."""
        if not self.bounded:  # within its own step's bound (taken later, it may be dropped)
            return version >= step - 1 - self.max_staleness
        last = trained_by(ahead + count - 1, *at, waiting, self.batch_size)
        return last <= version + self.max_staleness + 1  # its oldest token: ``version``

    def ready(self, buffer: list[Group], count: int, flying: set[int]) -> bool:
        """Whether the buffer's first ``count`` groups may be taken (``flying``: the step-batches
        generating): bounded, only when no older group is still generating."""
        if len(buffer) < count:
            return False
        return not self.bounded or buffer[count - 1].step < min(flying, default=math.inf)


def trained_by(position: int, step: int, taken: int, waiting: int, batch_size: int) -> int:
    """The latest step that trains the group ``position`` places behind the front of those
    admitted and not yet taken (0: the next to be taken), when the trainer takes groups oldest
    first for step ``step``, has taken ``taken`` of them and waits for ``waiting`` more. Every
    step takes at least ``batch_size`` groups (dynamic sampling may take more: earlier, never
    later)."""
    now = max(batch_size - taken, waiting)  # groups step ``step`` is still sure to take
    if position < now:
        return step
    return step + 1 + (position - now) // batch_size
