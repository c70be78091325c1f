"""What every reader returns (``Rows``), its length limits and right-padding."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from treadle.data.options import Overlong
from treadle.runtime.errors import DataError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("treadle.data")

R = TypeVar("R")


@dataclass
@dataclass
class Rows(Generic[R]):
    """Tokenized rows of one kind. `pad_id` is the tokenizer's pad token (its EOS when it has
    none); `n_filtered` counts the examples dropped for their length."""

    rows: list[R]
    pad_id: int
    n_filtered: int = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> R:
        return self.rows[index]


def keep(where: str, length: int, limit: int, overlong: Overlong, limit_name: str) -> bool:
    if length <= limit:
        return True
    if overlong == "error":
        raise DataError(
            f"{where} {length} tokens, longer than {limit_name}={limit}: raise the limit "
            "or set data.overlong_prompts=filter to drop such rows"
        )
    return False


def kept(
    rows: list[R], total: int, pad_id: int, config_key: str, filtered: str, empty: str
) -> Rows[R]:
    """The rows left within the length limits: how many were dropped is logged (``filtered``
    says which), and none left is DataError (``empty`` says why)."""
    n_filtered = total - len(rows)
    if n_filtered:
        logger.warning("%s: filtered %d of %d %s", config_key, n_filtered, total, filtered)
    if not rows:
        raise DataError(f"{config_key}: {empty}")
    return Rows(rows=rows, pad_id=pad_id, n_filtered=n_filtered)


def kept_within(
    rows: list[R], total: int, pad_id: int, config_key: str, limit: str, what: str
) -> Rows[R]:
    """:func:`kept` under one length limit (``limit``: ``"max_length=512"``), rows of ``what``
    (``"example"``) longer than it dropped."""
    over, empty = f"rows longer than {limit} tokens", f"every {what} is longer than {limit}"
    return kept(rows, total, pad_id, config_key, over, empty)


def right_padded(
    seqs: Sequence[Sequence[int]], pad_id: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` ``[len(seqs), width]`` (default: the longest), each row RIGHT-padded."""
    import torch

    width = max(len(seq) for seq in seqs) if width is None else width
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[i, : len(seq)] = 1
    return ids, mask
