"""The value head: a value model as an FSDP2 root, one scalar per response position.

Used by the critic (values for GAE) and by reward models (the score at a response's last
token). The model is a ``*ForTokenClassification`` with one label (:func:`load_value_model`);
this root runs its decoder through :func:`~treadle.engines.heads.response_hidden`, the same
forward the log-prob head uses (packed, without padding, when ``row_tokens`` is set), and
applies the ``score`` head directly (no classifier dropout) on the valid positions only, in
float32 out (0 on padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treadle.engines.heads import HeadRoot
from treadle.engines.packing import scatter_labels


class ValueHead(HeadRoot):
    """The FSDP2 root of a value model: ``values[b, t]`` is V(state before response token t)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_labels: int,
        label_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[B, num_labels]`` float32 values; 0 where the position is padding (or outside
        ``label_mask``, which narrows the positions computed). ``lm``: a transformers
        ``*ForTokenClassification`` with ``num_labels=1``."""
        hidden, where = self.hidden(input_ids, attention_mask, num_labels, label_mask)
        score = self.lm.score
        return scatter_labels(score(hidden.to(score.weight.dtype)).squeeze(-1).float(), where)


def last_token_values(
    head: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """``[B]``: the value at each row's last valid token (a reward model's score of the row).

    ``head`` is a :class:`ValueHead` (FSDP2 root), which reads the state *before* each valid
    label. So a dummy token is made valid right after each row's last token (in a column
    appended for rows that end at the edge): the label slot it fills reads the state at the
    last token, which causal attention keeps blind to the dummy. Only that slot is computed.
    Works for left-padded prompts followed by right-padded responses.
    """
    batch, length = input_ids.shape
    rows = torch.arange(batch, device=input_ids.device)
    positions = torch.arange(length, device=input_ids.device)
    last = (attention_mask.bool() * positions).argmax(-1)
    ids = F.pad(input_ids, (0, 1))
    mask = F.pad(attention_mask, (0, 1))
    mask[rows, last + 1] = 1
    label_mask = torch.zeros_like(mask)
    label_mask[rows, last + 1] = 1
    values = head(ids, mask, length, label_mask[:, 1:])  # label column c + 1 reads state c
    return values[rows, last]
