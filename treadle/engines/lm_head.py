"""Log-probs and entropy of chosen tokens straight from hidden states, chunk by chunk.

The naive way, ``log_softmax(hidden @ W.T)`` then ``gather``, holds float32 logits of
``[tokens, vocab]`` (SmolLM2: 49,152 x 4 bytes = 192 KiB a token), and autograd keeps several
more tensors of that size for backward (the division by the temperature, the log-softmax, the
gather's dense gradient, the entropy's softmax). :func:`linear_log_probs` is one autograd
function that never holds more than a chunk of ``[chunk, vocab]`` at a time, in forward or
backward:

- forward, per chunk: ``z = h W^T / T``; ``lse = logsumexp(z)``; ``logp[y] = z[y] - lse``;
  ``H = -sum_v p_v log p_v`` with ``p = exp(z - lse)``. Saved for backward: the inputs and
  ``lse`` and ``H`` (one number a token), nothing of vocabulary size;
- backward, per chunk: the logits are recomputed (one more ``h W^T``: the price of not storing
  them) and the gradient with respect to ``z`` is written in place, in one expression::

      dL/dz_v = g_logp (1[v = y] - p_v)  -  g_H p_v (log p_v + H)

  then ``dL/dh = (dL/dz / T) W`` and ``dL/dW += (dL/dz / T)^T h``.

:func:`linear_token_stats` gives the same two numbers and ``Σ_v p_v²`` of each token's
distribution, without gradients (the old-policy pass of the optimal token baseline).

:func:`linear_topk_logits` gives the logits of K given ids a token (a teacher's top-k, for
GKD), differentiable: K dot products with the head's rows at those ids, never a ``[chunk, V]``
block (``(h W^T).gather(ids)`` would keep one a chunk for backward: ``gather`` saves its input).

Same results as the naive computation (tests compare values and gradients); measured on
SmolLM2-135M it removes most of the time the LM head spent outside its matrix products
(``bench/train_step.py``). ``compute_dtype`` (bfloat16 under mixed precision) runs the three
matrix products in that dtype, as autocast would; softmax and sums stay float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _logits(
    h: torch.Tensor, w: torch.Tensor, temperature: float, softcap: float | None = None
) -> torch.Tensor:
    z = (h.to(w.dtype) @ w.t()).to(torch.promote_types(w.dtype, torch.float32))
    if softcap is not None:  # the model's own final logit soft-capping (Gemma 2): c tanh(z / c)
        z = z.div_(softcap).tanh_().mul_(softcap)
    return z.div_(temperature) if temperature != 1.0 else z


def _chunk_stats(
    z: torch.Tensor, labels: torch.Tensor, sum_squares: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(log p(labels), entropy, logsumexp, Σ_v p_v² or None)`` of the logits ``z``, which
    are overwritten (with ``log p``)."""
    m = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels[:, None])[:, 0] - m
    z.sub_(m[:, None])  # log p
    p = z.exp()
    squares = p.square().sum(-1) if sum_squares else None
    return logp, -p.mul_(z).sum(-1), m, squares


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        chunk_size: int,
        compute_dtype: torch.dtype | None,
        softcap: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        w = weight.to(compute_dtype) if compute_dtype is not None else weight
        n = hidden.shape[0]
        acc = torch.promote_types(w.dtype, torch.float32)  # float64 only for float64 inputs
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for s in range(0, n, chunk_size):
            z = _logits(hidden[s : s + chunk_size], w, temperature, softcap)
            sl = slice(s, s + chunk_size)
            logp[sl], entropy[sl], lse[sl], _ = _chunk_stats(z, labels[sl], sum_squares=False)
        # The cast weight is kept (not cast again in backward): half the float32 head's size.
        ctx.save_for_backward(hidden, w, labels, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.weight_dtype = temperature, chunk_size, weight.dtype
        ctx.softcap = softcap
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        if g_logp is None and g_entropy is None:
            return None, None, None, None, None, None, None
        hidden, w, labels, lse, entropy = ctx.saved_tensors
        t, chunk, cap = ctx.temperature, ctx.chunk_size, ctx.softcap
        gl = None if g_logp is None else g_logp[:, None] / t  # d/dlogits = d/dz / T
        ge = None if g_entropy is None else g_entropy[:, None] / t
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = torch.promote_types(ctx.weight_dtype, torch.float32)
        grad_w = torch.zeros_like(w, dtype=acc) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], chunk):
            h, sl = hidden[s : s + chunk], slice(s, s + chunk)
            z = _logits(h, w, t, cap)
            # soft-capped: d(c tanh(u / c))/du = 1 - tanh², tanh = z T / c
            slope = None if cap is None else z.mul(t / cap).square_().neg_().add_(1.0)
            logp_all = z.sub_(lse[sl, None])
            p = logp_all.exp()
            # grad = -p (g_logp + g_H (log p + H)) + g_logp 1[v = y], all over T.
            if ge is not None:
                coef = logp_all.add_(entropy[sl, None]).mul_(ge[sl])
                grad = p.mul_(coef if gl is None else coef.add_(gl[sl])).neg_()
            else:
                assert gl is not None
                grad = p.mul_(-gl[sl])
            if gl is not None:
                grad.scatter_add_(-1, labels[sl, None], gl[sl])
            if slope is not None:
                grad.mul_(slope)
            grad = grad.to(w.dtype)
            if grad_h is not None:
                grad_h[s : s + chunk] = grad @ w
            if grad_w is not None and grad_w.dtype == grad.dtype:
                grad_w.addmm_(grad.t(), h.to(w.dtype))
            elif grad_w is not None:
                grad_w += grad.t() @ h.to(w.dtype)
        grad_w = grad_w.to(ctx.weight_dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None


@dataclass(frozen=True)
class LMHead:
    """The LM head as the functions below use it: its weight ``[V, H]``, the temperature the
    logits are divided by, how many label tokens a chunk holds, the dtype of its matrix
    products (``None``: the weight's own; bfloat16 under mixed precision), and the model's
    final logit soft-capping (Gemma 2's ``final_logit_softcapping``: ``c tanh(z / c)`` before
    the temperature; ``None``: none)."""

    weight: torch.Tensor
    temperature: float = 1.0
    chunk_size: int = 512
    compute_dtype: torch.dtype | None = None
    softcap: float | None = None

    def cast(self) -> torch.Tensor:
        """The weight in ``compute_dtype`` (a differentiable cast)."""
        return self.weight.to(self.compute_dtype) if self.compute_dtype is not None else self.weight

    def chunks(self, n: int) -> range:
        """The first row of each chunk of ``n`` rows."""
        return range(0, n, self.chunk_size)


def linear_log_probs(
    hidden: torch.Tensor, labels: torch.Tensor, head: LMHead
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(labels), entropy)`` of ``softmax(hidden @ weight.T / temperature)``, float32.

    ``hidden [N, H]``, ``head.weight [V, H]``, ``labels [N]``. Peak memory holds one
    ``[chunk_size, V]`` float32 block (two in backward), whatever ``N``; both outputs
    differentiate with respect to ``hidden`` and the weight.
    """
    out: tuple[torch.Tensor, torch.Tensor] = _LinearLogProbs.apply(
        hidden,
        head.weight,
        labels,
        head.temperature,
        head.chunk_size,
        head.compute_dtype,
        head.softcap,
    )
    return out


@torch.no_grad()
def linear_token_stats(
    hidden: torch.Tensor, labels: torch.Tensor, head: LMHead
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log p(labels), entropy, Σ_v p_v²)`` as :func:`linear_log_probs` computes the first two,
    without gradients; ``Σ_v p_v²`` (the optimal token baseline's input) costs one more pass
    over each ``[chunk_size, V]`` block of probabilities."""
    w, size = head.cast(), head.chunk_size
    out = [hidden.new_empty(0, dtype=torch.float32)] * 3
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for s in head.chunks(hidden.shape[0]):
        z = _logits(hidden[s : s + size], w, head.temperature, head.softcap)
        logp, entropy, _, squares = _chunk_stats(z, labels[s : s + size], sum_squares=True)
        assert squares is not None
        parts.append((logp, entropy, squares))
    out = [torch.cat(column) for column in zip(*parts, strict=True)] if parts else out
    return out[0], out[1], out[2]


def full_log_softmax(hidden: torch.Tensor, head: LMHead) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T / temperature)`` ``[N, V]``, float32, chunk by chunk.

    The whole distribution, for a term that needs it (the exact KL to a reference): it holds
    ``N x V`` floats (SmolLM2: 192 KiB a token), so call it without gradients, on a
    micro-batch."""
    w, size = head.cast(), head.chunk_size
    parts = [
        torch.log_softmax(_logits(hidden[s : s + size], w, head.temperature, head.softcap), dim=-1)
        for s in head.chunks(hidden.shape[0])
    ]
    if not parts:
        return hidden.new_zeros(
            0, head.weight.shape[0], dtype=torch.promote_types(w.dtype, torch.float32)
        )
    return torch.cat(parts)


def full_vocab_term(
    hidden: torch.Tensor,
    head: LMHead,
    other: torch.Tensor,
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``fn(log_softmax(hidden @ weight.T / T), other)`` per position ``[N]``, differentiable.

    ``other [N, V]`` is another distribution at the same positions (a reference's
    :func:`full_log_softmax`, a constant). Each chunk is recomputed in backward
    (activation checkpointing), so autograd holds one ``[chunk, V]`` block at a time."""
    w, size = head.cast(), head.chunk_size

    def chunk_term(h: torch.Tensor, w_: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return fn(torch.log_softmax(_logits(h, w_, head.temperature, head.softcap), dim=-1), o)

    parts = [
        checkpoint(chunk_term, hidden[s : s + size], w, other[s : s + size], use_reentrant=False)
        for s in head.chunks(hidden.shape[0])
    ]
    return torch.cat(parts)


def linear_topk_logits(hidden: torch.Tensor, ids: torch.Tensor, head: LMHead) -> torch.Tensor:
    """``(hidden @ weight.T / temperature).gather(-1, ids)`` ``[N, K]``, differentiable, without
    the ``[N, V]`` logits.

    ``hidden [N, H]``, ``ids [N, K]`` (long): each row's logits at its own K ids, from the head's
    rows at those ids (``embedding(ids, weight) @ h``: K dot products a token, against V for the
    whole row). Each chunk is recomputed in backward (activation checkpointing), so autograd
    keeps only the inputs (``hidden``, the weight, the ids), not the ``[chunk, K, H]`` rows; its
    backward adds each chunk's ``[V, H]`` gradient of the weight, as a matrix product's would.
    The products run in float32 (float64 for a float64 weight), whatever ``compute_dtype``:
    they are cheap, and bfloat16 would round logits of ~20 by ~0.1. ``N = 0`` gives ``[0, K]``
    on the autograd graph (backward then still reaches the decoder)."""
    acc = torch.promote_types(head.weight.dtype, torch.float32)

    def chunk_logits(h: torch.Tensor, w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(i, w).to(acc)  # [n, K, H]: the head's rows at the ids
        z = torch.bmm(rows, h.to(acc)[:, :, None])[..., 0]
        if head.softcap is not None:
            z = torch.tanh(z / head.softcap) * head.softcap
        return z / head.temperature if head.temperature != 1.0 else z

    size = head.chunk_size
    parts = [
        checkpoint(
            chunk_logits, hidden[s : s + size], head.weight, ids[s : s + size], use_reentrant=False
        )
        for s in range(0, max(hidden.shape[0], 1), size)  # one empty chunk when N = 0
    ]
    return torch.cat(parts)
