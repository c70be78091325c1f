"""The student's logits at a teacher's top-k ids (GKD): the LM head's chunked function against
the naive gather, what autograd keeps of it, and the head's ``topk_ids`` request on the tiny
model against its plain forward."""

from __future__ import annotations

import pytest
import torch
from test_packing import joined, uneven_batch

from treadle.engines.heads import LogProbHead, LogProbRequest
from treadle.engines.lm_head import LMHead, linear_topk_logits
from treadle.engines.packing import label_positions
from treadle.models.loading import load_causal_lm

K = 4


def inputs(n=13, hidden=8, vocab=17, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype).requires_grad_()
    ids = torch.rand(n, vocab, generator=g).argsort(-1)[:, :K]  # K distinct ids a row
    return h, w, ids


def naive(h, w, ids, temperature):
    return ((h @ w.t()) / temperature).gather(-1, ids)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_values_and_gradients_equal_the_naive_gather(chunk):
    h, w, ids = inputs()
    a = torch.randn(13, K, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for fn in (
        lambda: linear_topk_logits(h, ids, LMHead(w, 0.7, chunk)),
        lambda: naive(h, w, ids, 0.7),
    ):
        z = fn()
        results.append((z, *torch.autograd.grad((a * z).sum(), (h, w))))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_gradcheck_in_float64():
    h, w, ids = inputs(n=7)
    assert torch.autograd.gradcheck(
        lambda h, w: linear_topk_logits(h, ids, LMHead(w, 0.7, 3)), (h, w)
    )


def _saved_for_backward(fn) -> list[torch.Tensor]:
    """The tensors autograd saves for backward while ``fn`` runs (a checkpointed region's
    inputs, not what it computes)."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_only_the_inputs_are_kept_for_backward():
    """The naive gather keeps each chunk's [chunk, V] logits (``gather`` saves its input); the
    chunked function keeps its inputs (views of the hidden states, the weight, the ids) and
    nothing it computed: no [chunk, V] block, no [chunk, K, H] rows."""
    h, w, ids = inputs(n=6, hidden=6, vocab=1000, dtype=torch.float32)
    storages = {x.untyped_storage().data_ptr() for x in (h, w, ids)}
    naive_saved = _saved_for_backward(lambda: naive(h, w, ids, 1.0))
    assert any(t.shape == (6, 1000) for t in naive_saved)  # the check sees what it looks for
    saved = _saved_for_backward(lambda: linear_topk_logits(h, ids, LMHead(w, 1.0, 2)))
    assert saved, "the checkpointed chunks save their inputs"
    # (torch 2.11's checkpoint also saves empty tensors, which hold no memory)
    held = [t for t in saved if t.numel()]
    assert all(t.untyped_storage().data_ptr() in storages for t in held), [t.shape for t in held]


def test_no_rows_give_an_empty_result_on_the_graph():
    h, w, _ = inputs(n=0)
    z = linear_topk_logits(h, torch.zeros(0, K, dtype=torch.long), LMHead(w, 1.0, 4))
    assert z.shape == (0, K) and z.requires_grad
    z.sum().backward()
    assert w.grad is not None and not w.grad.any()


def test_bfloat16_compute_dtype_leaves_the_products_in_float32():
    h, w, ids = inputs(n=9, hidden=16, vocab=50, dtype=torch.float32)
    z = linear_topk_logits(h, ids, LMHead(w, 1.0, 4, torch.bfloat16))
    assert z.dtype == torch.float32
    torch.testing.assert_close(z, naive(h, w, ids, 1.0), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- the head


def _tiny_head(tiny_task, row_tokens):
    lm = load_causal_lm(tiny_task["model"]).double()
    return LogProbHead(lm, chunk_size=4, row_tokens=row_tokens)


@pytest.mark.parametrize("row_tokens", [None, 16])
def test_head_topk_logits_are_the_models_logits_at_the_ids(tiny_task, row_tokens):
    """``topk_logits`` [N, K] in row-major order of the labels are the plain forward's logits
    / T at the ids; the log-probs and entropy come back as without ``topk_ids``; backward
    through them gives the naive gather's gradients (float64)."""
    batch = uneven_batch(vocab=100)
    ids, mask = joined(batch)
    r, t = 8, 0.7
    where = label_positions(mask, r)
    g = torch.Generator().manual_seed(2)
    topk_ids = torch.rand(ids.shape[0], r, 100, generator=g).argsort(-1)[..., :K]
    weights = torch.randn(int(where.sum()), K, generator=g, dtype=torch.float64)

    head = _tiny_head(tiny_task, row_tokens)
    out = head(LogProbRequest(ids, mask, r, t, topk_ids=topk_ids))
    assert out.topk_logits is not None and out.topk_logits.shape == (int(where.sum()), K)
    (weights * out.topk_logits).sum().backward()
    got_grads = {n: p.grad.clone() for n, p in head.lm.named_parameters()}
    with torch.no_grad():
        plain = head(LogProbRequest(ids, mask, r, t))
    torch.testing.assert_close(out.log_probs.detach(), plain.log_probs, atol=1e-12, rtol=0)
    torch.testing.assert_close(out.entropy.detach(), plain.entropy, atol=1e-12, rtol=0)

    head.lm.zero_grad()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = head.lm(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    want = (logits[:, -r - 1 : -1] / t).gather(-1, topk_ids)[where]
    torch.testing.assert_close(out.topk_logits.detach(), want.detach(), atol=1e-10, rtol=1e-10)
    (weights * want).sum().backward()
    for name, p in head.lm.named_parameters():
        torch.testing.assert_close(got_grads[name], p.grad, atol=1e-10, rtol=1e-8, msg=name)
    head_weight = head.lm.get_output_embeddings().weight  # tied: the embedding's name
    name = next(n for n, p in head.lm.named_parameters() if p is head_weight)
    assert got_grads[name].abs().sum() > 0


def test_a_request_checks_its_topk_ids():
    ids, mask = joined(uneven_batch(vocab=100))
    with pytest.raises(ValueError, match=r"\[B, num_labels, K\]"):
        LogProbRequest(ids, mask, 8, topk_ids=torch.zeros(ids.shape[0], 7, K, dtype=torch.long))
    with pytest.raises(ValueError, match="neither sum_pi_squared nor full_vocab"):
        LogProbRequest(
            ids,
            mask,
            8,
            full_vocab=True,
            topk_ids=torch.zeros(ids.shape[0], 8, K, dtype=torch.long),
        )
