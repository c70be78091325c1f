"""The driver's rollout: replicas placed as the config says, agent loops run over them into
batches, and the sources the driver takes its batches from.

- :mod:`.fleet`: the trainer side: replicas placed as the config says, agent loops to a batch,
  weight sync under a version.
- :mod:`.sources`: what the driver takes its batches from (:class:`~.sources.RolloutSource`),
  synchronous or generated ahead (one_step_off, async), and DAPO's group filter.
- :mod:`.teacher`: the distillation teacher's replicas and its scores of the student's samples.

The service itself (server, client, replicas, weight sync, the OpenAI-compatible endpoint) is
:mod:`treadle.serving`; its names are handed on here too (``from treadle.rollout import
RolloutClient``), where they were before it had a package of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treadle.serving import __getattr__ as _serving

if TYPE_CHECKING:
    from treadle.serving import (
        LocalReplica,
        RayReplica,
        Request,
        Response,
        RolloutClient,
        RolloutError,
        RolloutServer,
    )

__all__ = [
    "LocalReplica",
    "RayReplica",
    "Request",
    "Response",
    "RolloutClient",
    "RolloutError",
    "RolloutServer",
]

__getattr__ = _serving  # the service's names, imported on first use
