"""The fused chunked LM head: log-probs and entropy against the naive computation."""

from __future__ import annotations

import pytest
import torch

from treadle.engines.lm_head import LMHead, linear_log_probs, linear_token_stats


def naive(h, w, y, temperature):
    logp = torch.log_softmax((h @ w.t()).float() / temperature, -1)
    return logp.gather(-1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def inputs(n=13, hidden=8, vocab=17, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=g)
    return h, w, y


def test_gradcheck_both_outputs_in_float64():
    h, w, y = inputs(dtype=torch.float64)
    # 13 tokens in chunks of 4: the last chunk is short.
    assert torch.autograd.gradcheck(lambda h, w: linear_log_probs(h, y, LMHead(w, 0.7, 4)), (h, w))


@pytest.mark.parametrize("use", ["logp", "entropy", "both"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_values_and_gradients_equal_the_naive_head(use, chunk):
    h, w, y = inputs()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(13, generator=g), torch.randn(13, generator=g)
    results = []
    for fn in (lambda: linear_log_probs(h, y, LMHead(w, 0.7, chunk)), lambda: naive(h, w, y, 0.7)):
        logp, ent = fn()
        loss = {"logp": (a * logp).sum(), "entropy": (b * ent).sum()}.get(use)
        if loss is None:
            loss = (a * logp).sum() + (b * ent).sum()
        gh, gw = torch.autograd.grad(loss, (h, w))
        results.append((logp, ent, gh, gw))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_hand_computed_uniform_case():
    # Zero weights: every token has probability 1/V, so log p = -ln V and entropy = ln V.
    h = torch.randn(3, 4)
    w = torch.zeros(5, 4)
    logp, ent = linear_log_probs(h, torch.tensor([0, 2, 4]), LMHead(w, 1.0, 2))
    torch.testing.assert_close(logp, torch.full((3,), -torch.log(torch.tensor(5.0)).item()))
    torch.testing.assert_close(ent, torch.full((3,), torch.log(torch.tensor(5.0)).item()))


def test_nothing_of_vocabulary_size_is_kept_for_backward():
    h, w, y = inputs(n=6, hidden=4, vocab=1000)
    logp, _ = linear_log_probs(h, y, LMHead(w, 1.0, 2))
    saved = logp.grad_fn.saved_tensors
    # hidden, weight, labels, and two numbers a token: no [tokens, vocab] tensor.
    assert max(t.numel() for t in saved) == w.numel()
    assert all(t.shape[-1] != 1000 for t in saved)


def test_bfloat16_products_stay_close_and_outputs_float32():
    h, w, y = inputs(n=32, hidden=64, vocab=300)
    logp, ent = linear_log_probs(h, y, LMHead(w, 1.0, 8, torch.bfloat16))
    assert logp.dtype == ent.dtype == torch.float32
    want_logp, want_ent = naive(h, w, y, 1.0)
    torch.testing.assert_close(logp, want_logp, atol=0.3, rtol=0.05)
    torch.testing.assert_close(ent, want_ent, atol=0.3, rtol=0.05)
    logp.sum().backward()
    assert h.grad.dtype == w.grad.dtype == torch.float32
    assert torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_token_stats_add_the_sum_of_squared_probabilities(chunk):
    h, w, y = inputs(dtype=torch.float64, seed=3)
    logp, ent, squares = linear_token_stats(h, y, LMHead(w, 0.7, chunk))
    want_logp, want_ent = naive(h.detach(), w.detach(), y, 0.7)
    probs = torch.softmax((h @ w.t()).detach() / 0.7, -1)
    torch.testing.assert_close(logp, want_logp.double(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, want_ent.double(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(squares, (probs**2).sum(-1), atol=1e-12, rtol=1e-12)
    assert not squares.requires_grad
    # uniform over V: Σ p² = 1/V; no tokens: empty results
    _, _, uniform = linear_token_stats(
        torch.randn(3, 4), torch.tensor([0, 1, 2]), LMHead(torch.zeros(5, 4))
    )
    torch.testing.assert_close(uniform, torch.full((3,), 0.2))
    assert linear_token_stats(h[:0], y[:0], LMHead(w))[2].shape == (0,)


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_full_vocab_term_is_the_exact_kl_with_its_gradient(chunk):
    """``full_vocab_term`` with the exact KL estimator, chunked and checkpointed, against the
    naive ``[N, V]`` computation: values and gradients (hidden and head) in float64."""
    from treadle.algorithms.kl import kl_full
    from treadle.engines.lm_head import full_log_softmax, full_vocab_term

    h, w, _ = inputs(dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    ref_h = torch.randn(13, 8, generator=g, dtype=torch.float64)
    ref = full_log_softmax(ref_h, LMHead(w.detach(), 0.7, chunk))
    assert_close = torch.testing.assert_close
    assert_close(ref, torch.log_softmax(ref_h @ w.detach().t() / 0.7, -1))
    a = torch.randn(13, generator=g, dtype=torch.float64)
    got = full_vocab_term(h, LMHead(w, 0.7, chunk), ref, kl_full)
    want = kl_full(torch.log_softmax(h @ w.t() / 0.7, -1), ref)
    assert (want > 0).all()
    assert_close(got, want)
    grads = [torch.autograd.grad((a * x).sum(), (h, w)) for x in (got, want)]
    assert_close(grads[0], grads[1])
    assert full_log_softmax(h[:0], LMHead(w, 1.0, chunk)).shape == (0, 17)
