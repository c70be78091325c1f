"""Device memory of a generation in the transformers engine (:mod:`treadle.engines.inference`):
what one sequence takes, what ``rollout.gpu_memory_utilization`` leaves on CUDA, and how many
sequences a ``generate`` call takes (the paged cache's size: :mod:`treadle.engines.paged`)."""

from __future__ import annotations

from typing import Any

import torch

from treadle.engines.shapes import heads, text_config


def kv_bytes(config: Any, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in a KV cache, over all layers. ``config``: the
    model's (its text part for a vision-language one)."""
    text = text_config(config)
    _, kv_heads, width = heads(text)
    return 2 * text.num_hidden_layers * kv_heads * width * dtype.itemsize


def sequence_bytes(config: Any, dtype: torch.dtype, prompt: int, new: int) -> int:
    """Device memory one sequence takes while it is generated: its KV cache over ``prompt +
    new`` positions, a decoding step's full-vocabulary scores (the float32 logits, the
    processed scores, the sampling probabilities and the log-softmax
    :class:`~treadle.engines.sampling.SampledLogProbs` keeps: 4 copies) and its prompt's
    forward (a decoder layer's activations at every prompt position, kept one layer at a
    time). ``config``: the model's (its text part for a vision-language one)."""
    text = text_config(config)
    width = dtype.itemsize
    kv = kv_bytes(config, dtype) * (prompt + new)
    scores = 4 * text.vocab_size * 4
    intermediate = getattr(text, "intermediate_size", 4 * text.hidden_size)
    prefill = prompt * (4 * text.hidden_size + 3 * intermediate) * width
    return int(kv + scores + prefill)


def generation_budget(device: torch.device, utilization: float) -> int | None:
    """Bytes a ``generate`` call may take on ``device``: ``utilization`` of its memory less what
    this process's tensors hold, and no more than the driver reports free (plus what torch's
    cache holds unused); None on a CPU (no bound but ``micro_batch_size``)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    cached = torch.cuda.memory_reserved(device) - allocated
    return max(0, min(int(utilization * total) - allocated, free + cached))


def chunk_size(budget: int | None, per_sequence: int, most: int) -> int:
    """Sequences a ``generate`` call takes: ``most`` (``micro_batch_size``), fewer when the
    ``budget`` holds fewer (at least one: a single sequence that does not fit fails in torch,
    with its allocation's size)."""
    if budget is None:
        return most
    return max(1, min(most, budget // max(per_sequence, 1)))
