"""Device memory of a generation in the transformers engine (:mod:`treadle.engines.inference`):
what one sequence takes, what ``rollout.gpu_memory_utilization`` leaves on CUDA, how many
sequences a ``generate`` call takes, and the size of transformers' paged cache
(``rollout.cache_implementation=paged``)."""

from __future__ import annotations

from typing import Any

import torch

PAGE = 256  # tokens a block of transformers' paged cache holds (its default)
PREFILL = {False: 2048, True: 8192}  # prompt tokens a paged forward takes, on a CPU / CUDA


def kv_bytes(config: Any, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in a KV cache, over all layers. ``config``: the
    model's (its text part for a vision-language one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def sequence_bytes(config: Any, dtype: torch.dtype, prompt: int, new: int) -> int:
    """Device memory one sequence takes while it is generated: its KV cache over ``prompt +
    new`` positions, a decoding step's full-vocabulary scores (the float32 logits, the
    processed scores, the sampling probabilities and the log-softmax
    :class:`~treadle.engines.sampling.SampledLogProbs` keeps: 4 copies) and its prompt's
    forward (a decoder layer's activations at every prompt position, kept one layer at a
    time). ``config``: the model's (its text part for a vision-language
    one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
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


def paged_size(
    per_token: int,
    device: torch.device,
    longest: int,
    new: int,
    together: int,
    utilization: float,
) -> dict[str, Any]:
    """The size of transformers' paged cache for sequences of at most ``longest`` prompt and
    ``new`` generated tokens, ``together`` of them decoded at a time, ``per_token`` bytes a
    token (:func:`kv_bytes`): pages of :data:`PAGE` tokens for ``together`` whole sequences,
    their prompts prefilled :data:`PREFILL` tokens a forward (a whole prompt if longer). On
    CUDA, within what ``utilization`` leaves (:func:`generation_budget`), given as the share of
    the free memory transformers sizes its cache and batch from; where those pages would take
    more than it, transformers fills it instead (the sequences then wait for pages). On a CPU
    (where transformers would take 90% of the machine's memory) the pages alone."""
    cuda = device.type == "cuda"
    pages = {
        "num_blocks": together * -(-(longest + new) // PAGE),
        "max_batch_tokens": min(together * longest, max(PREFILL[cuda], longest)),
    }
    if not cuda:
        return pages
    torch.cuda.empty_cache()  # transformers counts torch's cached blocks as taken
    budget = generation_budget(device, utilization) or 0
    free = torch.cuda.mem_get_info(device)[0]
    share = {"max_memory_percent": max(min(budget / max(free, 1), 1.0), 1e-6)}
    if pages["num_blocks"] * PAGE * per_token <= budget:
        return {**share, **pages}
    return share
