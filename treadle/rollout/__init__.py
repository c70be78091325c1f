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

from treadle.serving import __getattr__ as _serving

# The service's names (RolloutClient, Request, ...) where they were before serving/ had a
# package of its own: imported from treadle.serving on first use.
__getattr__ = _serving
