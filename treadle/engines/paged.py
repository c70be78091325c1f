"""The transformers engine on transformers' continuous batching, a paged KV cache
(``rollout.cache_implementation=paged``; :class:`~treadle.engines.inference.HFRolloutEngine`):
sequences are scheduled one by one, and a finished one's pages go to a waiting one. With flash
attention (flash-attn installed) transformers runs it on varlen kernels and CUDA graphs;
without, on sdpa with a mask over every sequence in flight (a decoding step attends from each
of B sequences to all B sequences' tokens: B times the work), no graphs."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from treadle.engines.generation_memory import generation_budget, kv_bytes

PAGE = 256  # tokens a block of transformers' paged cache holds (its default)
PREFILL = {False: 2048, True: 8192}  # prompt tokens a paged forward takes, on a CPU / CUDA


class Sampling(Protocol):
    """What the paged cache reads of a :class:`~treadle.engines.inference.SamplingParams`."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def seed(self) -> int: ...


def generate_paged(
    model: Any,
    prompts: list[list[int]],
    params: Sampling,
    stops: list[int],
    pad: int,
    micro_batch_size: int,
    utilization: float,
) -> list[tuple[list[int], list[float]]]:
    """transformers' continuous batching on its paged KV cache: each sequence is scheduled
    on its own, prompts and decoding steps of different sequences share a forward, and a
    finished sequence's pages go to a waiting one. Every request is queued before the
    manager's thread starts (``generate_batch`` queues them while it runs, so its first
    batches, and the draws, would follow thread timing): the same seed draws the same
    tokens. Its log-probs are those of the processed scores (``return_logprobs``):
    ``log_softmax(logits / T)`` without top-k/top-p, the truncated distribution's with
    them, as vLLM's (``top_logprobs``: none). Returns each prompt's tokens (a token of
    ``stops`` ends one; none: only its length) and their log-probs, from pages for
    ``micro_batch_size`` sequences at a time within ``utilization`` (:func:`paged_manager`)."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    if not prompts:
        return []
    config = generation_config(params, stops, pad)
    hints = WorkloadHints(max(map(len, prompts)), params.max_new_tokens, len(prompts))
    attention = model.config._attn_implementation  # the manager switches it to paged
    manager = None
    try:
        manager = paged_manager(
            model, config, prompts, params, hints, micro_batch_size, utilization
        )
        ids = manager.add_requests(inputs=prompts, max_new_tokens=params.max_new_tokens)
        manager.start()
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                break  # its thread ended (transformers logged why)
    finally:
        if manager is not None:
            manager.stop(block=True, timeout=30)
            manager.destroy()
        if model.config._attn_implementation != attention:  # (a manager never started)
            model.set_attn_implementation(attention)
    failed = [r.error for r in results.values() if r.error is not None]
    if len(results) < len(ids) or failed:
        raise RuntimeError(
            f"the paged KV cache's generation (transformers' continuous batching) returned "
            f"{len(results) - len(failed)} of {len(ids)} sequences"
            + (f": {failed[0]}" if failed else "; transformers logged why")
        )
    for rid, prompt in zip(ids, prompts, strict=True):
        if results[rid].prompt_ids != prompt:
            raise RuntimeError(f"continuous batching answered {rid} for another prompt")
    return [(results[rid].generated_tokens, results[rid].logprobs) for rid in ids]


def generation_config(params: Sampling, stops: list[int], pad: int) -> Any:
    """transformers' ``GenerationConfig`` of ``params``: its draw (greedy at temperature 0),
    ``stops`` ending a sequence (none: only its length)."""
    from transformers import GenerationConfig

    greedy = params.temperature == 0
    return GenerationConfig(
        do_sample=not greedy,
        temperature=None if greedy else params.temperature,
        top_k=params.top_k if params.top_k > 0 and not greedy else None,
        top_p=params.top_p if params.top_p < 1 and not greedy else None,
        max_new_tokens=params.max_new_tokens,
        eos_token_id=stops or -1,  # -1: nothing ends a sequence but its length
        pad_token_id=pad,
    )


def paged_manager(
    model: Any,
    config: Any,
    prompts: list[list[int]],
    params: Sampling,
    hints: Any,
    micro_batch_size: int,
    utilization: float,
) -> Any:
    """transformers' continuous-batching manager, warmed up (its cache made; its CUDA graphs
    captured, where it captures them): log-probs returned, ``params.seed`` seeding the draws,
    at most ``micro_batch_size`` sequences decoded together, the cache sized by
    :func:`paged_size`. Pages for exactly those sequences come with no safety margin
    (transformers holds back 15% of the pages from new prompts otherwise, and the last
    sequences would wait for a second round); where transformers finds they do not fit with
    its batch's activations (a ``MemoryError`` as the warm-up makes the cache), it sizes the
    cache itself to the budget."""
    from transformers.generation import ContinuousBatchingConfig
    from transformers.utils import is_flash_attn_2_available

    param = next(model.parameters())
    if param.dtype == torch.float32 and is_flash_attn_2_available():
        raise ValueError(
            "rollout.cache_implementation=paged: transformers switches a paged cache to "
            "flash attention (installed here), which does not take float32: set "
            "rollout.dtype=bfloat16"
        )
    together = min(len(prompts), micro_batch_size)
    size = paged_size(
        kv_bytes(model.config, param.dtype),
        param.device,
        max(len(p) for p in prompts),
        params.max_new_tokens,
        together,
        utilization,
    )
    common: dict[str, Any] = {
        "return_logprobs": True,
        "seed": params.seed,
        "max_requests_per_batch": together,
        # (no tensor-parallel rollout model here: leave NCCL's environment alone)
        "disable_nccl_graph_mixing": False,
    }
    pages = {**size, "safety_margin": 0.0} if "num_blocks" in size else size
    try:
        return warmed_manager(model, config, ContinuousBatchingConfig(**common, **pages), hints)
    except MemoryError:
        if "num_blocks" not in size or "max_memory_percent" not in size:  # (a CPU's: none)
            raise
        share = ContinuousBatchingConfig(**common, max_memory_percent=size["max_memory_percent"])
        return warmed_manager(model, config, share, hints)


def warmed_manager(model: Any, config: Any, batching: Any, hints: Any) -> Any:
    """A continuous-batching manager of ``batching``, warmed up (a failed one destroyed)."""
    manager = model.init_continuous_batching(config, batching, hints)
    try:
        if not manager.warmed_up:
            manager.warmup()
    except BaseException:
        manager.destroy()
        raise
    return manager


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
