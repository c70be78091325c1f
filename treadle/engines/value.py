"""The value head: a value model as an FSDP2 root, one scalar per response position.

Used by the critic (values for GAE) and by reward models (the score at a response's last
token). The model is a ``*ForTokenClassification`` with one label (:func:`load_value_model`);
this root runs its decoder through :func:`response_hidden`, the same forward the log-prob head
uses (packed, without padding, when ``row_tokens`` is set), and applies the ``score`` head
directly (no classifier dropout) on the valid positions only, in float32 out (0 on padding).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from treadle.engines.fsdp import response_hidden
from treadle.engines.packing import scatter_labels


class ValueHead(nn.Module):
    """The FSDP2 root of a value model: ``values[b, t]`` is V(state before response token t)."""

    def __init__(self, lm: nn.Module, row_tokens: int | None = None) -> None:
        super().__init__()
        self.lm: Any = lm  # a transformers *ForTokenClassification with num_labels=1
        self.row_tokens = row_tokens  # set: packed forward, no compute on padding

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_labels: int
    ) -> torch.Tensor:
        """``[B, num_labels]`` float32 values; 0 where the position is padding."""
        hidden, where = response_hidden(
            self.lm, input_ids, attention_mask, num_labels, row_tokens=self.row_tokens
        )
        score = self.lm.score
        return scatter_labels(score(hidden.to(score.weight.dtype)).squeeze(-1).float(), where)
