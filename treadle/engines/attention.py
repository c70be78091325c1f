"""transformers' ``sdpa`` attention, with the CPU's bfloat16 backward done in float32.

On CPU, torch's fused attention kernel is slower in bfloat16 than in float32 once a backward
pass follows: SmolLM2-135M's shapes (17 rows of 146 positions, 9 query and 3 key/value heads
of 64), forward and backward, 2 threads on an AMX CPU: 42.6 ms in bfloat16, 22.9 ms in
float32. Under bf16 mixed precision that kernel was a fifth of the actor's update; casting the
query, keys and values to float32 for it took one update of 32 samples of 146 tokens from
10.6 to 8.7 s. A forward without gradients (reference and old-policy
log-probs, generation) stays in bfloat16, where the kernel is faster (4 against 6 ms).
The float32 path is at least as exact; only the compute precision of attention changes, and
the result is cast back to the caller's dtype.

:func:`use_cpu_float32_backward` installs it as ``sdpa`` in transformers' attention registry
(the documented way to override an implementation); the training engine calls it, once per
process is enough. On other devices and dtypes it is transformers' own function, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sdpa_attention_forward``; a bfloat16 query on CPU that needs gradients runs it in
    float32 (an additive mask cast along), the output cast back to bfloat16."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "cpu" or query.dtype != torch.bfloat16 or not query.requires_grad:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), attention_mask, **kwargs
    )
    return out.to(query.dtype), weights


def use_cpu_float32_backward() -> None:
    """Make :func:`sdpa_attention` transformers' ``sdpa`` attention in this process."""
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa", sdpa_attention)
