"""Scoring with the transformers engine (a teacher's log-probs of given tokens): equal to a hand
forward pass of the model, one sequence at a time, unpadded: the log-softmax of its logits in
float32 gathered at each token, and the top-k equal to ``torch.topk`` of the same.

Micro-batches of 3 over 7 sequences of different lengths and starts exercise the right
padding, the logits kept from the first scored position, and the return order.
"""

from __future__ import annotations

import pytest
import torch

from treadle.engines.inference import HFRolloutEngine, Scored
from treadle.models.loading import load_causal_lm, load_tokenizer


@pytest.fixture(scope="module")
def model_and_tok(tiny_task):
    path = str(tiny_task["model"])
    return load_causal_lm(path, torch.float32).eval(), load_tokenizer(path)


def _sequences(tok) -> tuple[list[list[int]], list[int]]:
    texts = [f"{i}+{2 * i}={3 * i} " * (1 + i % 3) for i in range(7)]
    seqs = [tok(t)["input_ids"] for t in texts]
    starts = [1, 3, len(seqs[2]) - 1, 2, len(seqs[4]), 5, 1]  # one empty (start == len)
    return seqs, starts


@torch.no_grad()
def _by_hand(model, seq: list[int], start: int, k: int) -> Scored:
    logits = model(torch.tensor([seq])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[start - 1 : len(seq) - 1]
    chosen = lp.gather(-1, torch.tensor(seq[start:])[:, None]).squeeze(-1)
    values, ids = lp.topk(k, -1) if k else (torch.empty(len(chosen), 0), torch.empty(0))
    return Scored(
        chosen.tolist(),
        ids.tolist() if k else [[] for _ in chosen],
        values.tolist() if k else [[] for _ in chosen],
    )


@pytest.mark.parametrize("top_k", [0, 5])
def test_hf_score_equals_a_hand_forward_pass(model_and_tok, top_k):
    model, tok = model_and_tok
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, micro_batch_size=3)
    seqs, starts = _sequences(tok)
    scored = engine.score(seqs, starts, top_k)
    assert len(scored) == len(seqs)
    for seq, start, got in zip(seqs, starts, scored, strict=True):
        want = _by_hand(model, seq, start, top_k)
        assert len(got.log_probs) == len(seq) - start
        torch.testing.assert_close(
            torch.tensor(got.log_probs), torch.tensor(want.log_probs), atol=1e-5, rtol=0
        )
        assert got.topk_ids == want.topk_ids
        if top_k:
            torch.testing.assert_close(
                torch.tensor(got.topk_log_probs),
                torch.tensor(want.topk_log_probs),
                atol=1e-5,
                rtol=0,
            )
        else:
            assert got.topk_log_probs == [[] for _ in range(len(seq) - start)]


def test_hf_score_refuses_a_start_outside_the_sequence(model_and_tok):
    model, tok = model_and_tok
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id)
    with pytest.raises(ValueError, match="sequence 1 has 3 tokens and start 0"):
        engine.score([[1, 2, 3], [4, 5, 6]], [1, 0], 2)
    with pytest.raises(ValueError, match="start 4"):
        engine.score([[1, 2, 3]], [4], 2)
