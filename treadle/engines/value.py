"""The value head: a value model as an FSDP2 root, one scalar per response position.

Used by the critic (values for GAE) and by reward models (the score at a response's last
token). The model is a ``*ForTokenClassification`` with one label (:func:`load_value_model`);
this root runs its decoder through :func:`response_hidden`, the same forward the log-prob head
uses, and applies the ``score`` head directly (no classifier dropout), in float32 out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from treadle.engines.fsdp import response_hidden


class ValueHead(nn.Module):
    """The FSDP2 root of a value model: ``values[b, t]`` is V(state before response token t)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm: Any = lm  # a transformers *ForTokenClassification with num_labels=1

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_labels: int
    ) -> torch.Tensor:
        hidden = response_hidden(self.lm, input_ids, attention_mask, num_labels)
        return self.lm.score(hidden).squeeze(-1).float()


def last_token_values(
    head: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """``[B]``: the value at each row's last valid token (a reward model's score of the row).

    ``head`` is a :class:`ValueHead` (FSDP2 root). It reads the state *before* each label
    position, so one masked column is appended: then ``values[:, j]`` is the state at token j,
    and the last token of the row (the response's EOS) is scored having seen the whole text.
    Works for left-padded prompts followed by right-padded responses.
    """
    batch, length = input_ids.shape
    pad = torch.zeros(batch, 1, dtype=input_ids.dtype, device=input_ids.device)
    values = head(
        torch.cat([input_ids, pad], 1),
        torch.cat([attention_mask, torch.zeros_like(pad, dtype=attention_mask.dtype)], 1),
        length,
    )
    positions = torch.arange(length, device=input_ids.device)
    last = (attention_mask.bool() * positions).argmax(-1)
    return values[torch.arange(batch, device=values.device), last]
