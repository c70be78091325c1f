"""The model FLOPs of a training update and a GPU's peak: the MFU verl logs (``perf/mfu/actor``).

A forward and backward over a sequence of ``s`` tokens costs PaLM's count (Chowdhery et al.
2022, appendix B; verl's ``FlopsCounter``): 6 x the parameters that multiply (each decoder
layer's projections and MLP, and the LM head once, tied or not; the embedding is a lookup) x
``s``, plus attention's scores and weighted sum, 12 x layers x the query width x ``s``².
Norms, biases and the softmax are left out, and so is what gradient checkpointing computes
again: these are the FLOPs the model needs, not the ones the device ran. A value model's head
(one output) counts as a vocabulary of 1. As in verl, the head counts on every token, though
treadle's computes logits at the response tokens only, and LoRA counts as full training.

A training engine's :class:`UpdateRate` counts the rows of every forward of its ``train_step``
that builds a graph, so each PPO epoch counts, and a prompt several rows share
(``actor.share_prompts``) counts once a row, as in verl.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from time import perf_counter
from typing import Any

import torch
from torch import nn

from treadle.engines.heads import LogProbHead, LogProbRequest
from treadle.engines.shapes import heads, text_config

# bf16 dense tensor-core TFLOP/s (no sparsity), by a part of the name CUDA gives the device
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "L40S": 362.1}


def matmul_params(config: Any, head_outputs: int | None = None) -> int | None:
    """Parameters that multiply a token's activations: per layer the query, key, value and
    output projections and the gated MLP's three matrices, plus the head (``head_outputs``
    wide, default the vocabulary). None for a shape this count does not describe (a mixture
    of experts, or a config without these sizes)."""
    text = text_config(config)
    experts = ("num_local_experts", "num_experts", "n_routed_experts")
    if any(getattr(text, key, None) for key in experts):
        return None
    try:
        h, layers, mlp = text.hidden_size, text.num_hidden_layers, text.intermediate_size
        vocab = text.vocab_size if head_outputs is None else head_outputs
        query, kv_heads, width = heads(text)
    except AttributeError:
        return None
    q, kv = query * width, kv_heads * width
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * mlp
    return int(layers * per_layer + vocab * h)


def update_flops(
    config: Any, tokens: float, squares: float, head_outputs: int | None = None
) -> float | None:
    """A forward and backward over sequences of ``tokens`` tokens in all, ``squares`` the sum
    of their squared lengths (see the module docstring); None where :func:`matmul_params` is."""
    params = matmul_params(config, head_outputs)
    if params is None:
        return None
    text = text_config(config)
    query, _, width = heads(text)
    return 6.0 * params * tokens + 12.0 * text.num_hidden_layers * query * width * squares


def peak_tflops(device: torch.device) -> float | None:
    """The bf16 dense TFLOP/s of a GPU named in :data:`PEAK_TFLOPS`; None on a CPU or another
    GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def speed_metrics(role: str, flops: float, seconds: float, peak: float | None) -> dict[str, float]:
    """``perf/tflops/<role>``: model TFLOP/s this device reached over ``seconds``; and where
    its ``peak`` is known, ``perf/mfu/<role>``, that rate's share of it."""
    if seconds <= 0:
        return {}
    rate = flops / seconds / 1e12
    out = {f"perf/tflops/{role}": rate}
    if peak:
        out[f"perf/mfu/{role}"] = rate / peak
    return out


class UpdateRate:
    """A training engine's model FLOP rate: a forward pre-hook on its FSDP2 ``root`` counts
    the rows of every forward that builds a graph while :meth:`measure` runs (their tokens and
    the sum of their squared lengths, kept on the device, read once at the end); ``section``
    names the role where the step's prefix does not; ``row_split``: the ranks of a tensor- or
    sequence-parallel group, which split each row's work (each rank counts its share)."""

    def __init__(self, root: nn.Module, section: str, row_split: int) -> None:
        self.root: Any = root
        self.section, self.row_split = section, row_split
        self._work: list[torch.Tensor] | None = None  # [tokens, Σ length²] a forward
        root.register_forward_pre_hook(self._count, with_kwargs=True)

    @contextlib.contextmanager
    def measure(self, prefix: str) -> Iterator[dict[str, float]]:
        """Yields a dict that holds, once the block is done, ``perf/tflops/<role>`` and, on a
        GPU of known peak, ``perf/mfu/<role>`` (the role: ``prefix`` without its slash, else
        the section), of the forwards the block ran over its time."""
        speed: dict[str, float] = {}
        self._work, start = [], perf_counter()
        try:
            yield speed
        finally:
            work, self._work = self._work, None
        speed.update(self._speed(prefix.rstrip("/") or self.section, work, perf_counter() - start))

    def _count(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A forward that builds a graph: its rows' token count and squared lengths' sum."""
        if self._work is None or not torch.is_grad_enabled():
            return
        request = args[0] if args else None
        mask: torch.Tensor | None
        if isinstance(request, LogProbRequest):
            mask = request.attention_mask
        else:  # a value head's (input_ids, attention_mask, num_labels)
            mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        if mask is None:
            return
        lengths = mask.long().sum(-1)
        self._work.append(torch.stack([lengths.sum(), (lengths * lengths).sum()]))

    def _speed(self, role: str, work: list[torch.Tensor], seconds: float) -> dict[str, float]:
        """The rate of ``work`` over ``seconds`` on this rank (its share of a split row)."""
        if not work:
            return {}
        tokens, squares = torch.stack(work).sum(0).tolist()
        head = None if isinstance(self.root, LogProbHead) else 1  # a value head: 1 output
        flops = update_flops(self.root.lm.config, tokens, squares, head)
        if flops is None:
            return {}
        device = next(self.root.parameters()).device
        return speed_metrics(role, flops / self.row_split, seconds, peak_tflops(device))
