"""DAPO's dynamic sampling (``algorithm.filter_groups``, arXiv 2503.14476), one
:class:`GroupFilter` per batch, the same for every source.

Both sources hand their scored groups to it: groups whose rewards are all equal are dropped and
more are generated (or taken), at most ``algorithm.max_gen_rounds`` batches' worth; if that does
not fill the batch, dropped groups top it up (their advantage is zero under a group baseline).
Choices: a group is the rows of one ``uid`` (``rollout.n``, fewer where agent runs failed, more
where a session split), so groups are counted by prompt, never by rows; groups dropped as stale
before scoring and groups whose every run failed count against the budget; the batch is cut at
whole groups.
"""

from __future__ import annotations

import math

from treadle.algorithms.shaping import varied_groups
from treadle.config import Config
from treadle.data import pad_prompts
from treadle.protocol import Batch


class GroupFilter:
    """DAPO's dynamic sampling for one batch (see the module docstring); without
    ``algorithm.filter_groups`` it keeps every group."""

    def __init__(self, cfg: Config) -> None:
        alg = cfg.algorithm
        self.on, self.want = alg.filter_groups, cfg.data.batch_size
        self.budget = alg.max_gen_rounds * self.want if self.on else math.inf  # groups to look at
        self.kept: list[Batch] = []
        self.dropped: list[Batch] = []
        self.kept_groups = self.examined = 0

    def missing(self) -> int:
        """Groups still wanted."""
        return self.want - self.kept_groups

    def done(self) -> bool:
        return self.kept_groups >= self.want or self.examined >= self.budget

    def add(self, batch: Batch | None, stale: int = 0, failed: int = 0) -> None:
        """Scored groups (consecutive rows of one ``uid``: ``rollout.n``, fewer where agent
        runs failed, more where a session split); ``stale``: groups looked at and dropped
        before scoring, ``failed``: groups whose every run failed (both count against the
        budget)."""
        groups = len(set(batch["uid"])) if batch is not None else 0
        self.examined += groups + stale + failed
        if batch is None:
            return
        if not self.on:
            self.kept.append(batch)
            self.kept_groups += groups
            return
        varied = varied_groups(batch["token_level_scores"].sum(-1), list(batch["uid"]))
        self.kept.append(batch.select(varied.numpy()))
        self.dropped.append(batch.select((~varied).numpy()))
        self.kept_groups += len(set(batch.select(varied.numpy())["uid"]))

    def batch(self, m: dict[str, float]) -> Batch:
        """The first ``data.batch_size`` groups, kept ones first; ``rollout/kept_group_frac``."""
        if self.on:
            m["rollout/kept_group_frac"] = self.kept_groups / max(self.examined, 1)
        parts = [b for b in self.kept + self.dropped if len(b)]
        batch = pad_prompts(parts)
        return batch.slice(0, _rows_of_groups(list(batch["uid"]), self.want))


def _rows_of_groups(uids: list[str], groups: int) -> int:
    """How many leading rows the first ``groups`` groups (runs of one uid) take."""
    seen: set[str] = set()
    for i, uid in enumerate(uids):
        if uid not in seen and len(seen) == groups:
            return i
        seen.add(uid)
    return len(uids)
