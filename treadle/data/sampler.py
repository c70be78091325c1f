"""``ResumableSampler``: batches of dataset indices, shuffled per epoch from ``(seed, epoch)``
alone, so its state is three integers and a resumed run draws exactly the batches the
uninterrupted run would have.

``PromptSampler`` is what the RL sources draw prompts from: this uniform sampler
(``data.sampler=uniform``) or the curriculum of :mod:`treadle.data.curriculum`
(``data.sampler=pass_rate``). A source hands every sampler the scores of the groups it made
(:meth:`PromptSampler.observe`); the uniform one reads none of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from treadle.runtime.errors import DataError


class PromptSampler(Protocol):
    """Where the RL sources draw a step's prompts from (see the module docstring)."""

    def next_indices(self) -> list[int]:
        """The next batch of dataset indices."""
        ...

    def observe(self, groups: Mapping[int, Sequence[float]]) -> None:
        """The scores of the group each drawn prompt (by dataset index) was answered with."""
        ...

    def pool_metrics(self) -> dict[str, float]:
        """``data/pool_*``: the prompt pool's difficulty as the sampler knows it."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ResumableSampler:
    """Batches of dataset indices, reshuffled each epoch from `(seed, epoch)`.

    A batch never spans two epochs. With `drop_last` the tail of an epoch that does not fill a
    batch is skipped (it is in a different place next epoch); without it the last batch is
    short. The state is `{"epoch", "position", "seed"}` (plus `n` to detect a changed dataset).
    """

    def __init__(
        self, n: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        if batch_size <= 0 or seed < 0:
            raise ValueError(f"need batch_size > 0 and seed >= 0, got {batch_size}, {seed}")
        if n <= 0 or (drop_last and n < batch_size):
            raise DataError(
                f"the dataset has {n} rows, fewer than one batch of {batch_size}: "
                "lower data.batch_size or add rows"
            )
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.position = 0, 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) cache

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.n, self.batch_size)
        return full + int(bool(rest) and not self.drop_last)

    def _permutation(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
                self._order = (self.epoch, order.tolist())
            else:
                self._order = (self.epoch, list(range(self.n)))
        return self._order[1]

    def next_indices(self) -> list[int]:
        """The next batch; moves to the next epoch when this one has no full batch left."""
        remaining = self.n - self.position
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._permutation()[self.position : self.position + self.batch_size]
        self.position += len(batch)
        return batch

    def observe(self, groups: Mapping[int, Sequence[float]]) -> None:
        """A uniform draw reads no outcomes."""

    def pool_metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") == "pass_rate":  # (treadle.data.curriculum's)
            raise DataError(
                "the checkpoint's prompts were drawn by pass rate (data.sampler=pass_rate), "
                "this run draws them uniformly: resume with data.sampler=pass_rate, or start a "
                "new run (another trainer.output_dir)"
            )
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise DataError(f"sampler state lacks {sorted(missing)}: got {state}")
        if state.get("n", self.n) != self.n or not 0 <= int(state["position"]) <= self.n:
            raise DataError(
                f"sampler state {state} was saved for a dataset of {state.get('n')} rows, "
                f"this one has {self.n}: the data files changed since the checkpoint"
            )
        self.epoch, self.position, self.seed = (
            int(state["epoch"]),
            int(state["position"]),
            int(state["seed"]),
        )
        self._order = None
