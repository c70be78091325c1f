"""The learning-rate schedule of a training engine: linear warm-up, then constant or a decay.

The factor of the configured lr at optimizer step ``k`` (1-based, ``W`` warm-up steps, ``T``
optimizer steps in the run, ``m`` the min ratio):

- warm-up, ``k <= W``: ``k / W`` (the first step trains at ``lr / W``, step ``W`` at ``lr``);
- then, with ``p = (k - W) / (T - W)`` clamped to [0, 1]: constant ``1``; linear
  ``m + (1 - m)(1 - p)``; cosine ``m + (1 - m)(1 + cos(pi p)) / 2`` (verl's and transformers'
  half cosine with a floor).

This is transformers' ``get_cosine_schedule_with_warmup`` (with ``min_lr_rate``) one step on:
its step 0 trains at lr 0 and its step ``T`` (never taken) would reach the floor; here the first
step trains and the last one, ``k = T``, is at ``lr x m``. Steps beyond ``T`` (a run whose
batches gave more optimizer steps than its nominal count) stay at the floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from treadle.config.actor import LrScheduleName


@dataclass(frozen=True)
class LrSchedule:
    """Warm-up steps, the decay after them, its floor, and the run's optimizer steps (``total``:
    where a decaying schedule reaches ``min_lr_ratio``; unread by ``constant``)."""

    warmup_steps: int = 0
    name: LrScheduleName = "constant"
    min_lr_ratio: float = 0.0
    total: int = 0

    def __call__(self, k: int) -> float:
        """The lr factor of optimizer step ``k`` (1-based)."""
        w = max(self.warmup_steps, 0)
        if k <= w:
            return k / w
        if self.name == "constant":
            return 1.0
        p = min(max((k - w) / max(self.total - w, 1), 0.0), 1.0)
        decay = 1.0 - p if self.name == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay
