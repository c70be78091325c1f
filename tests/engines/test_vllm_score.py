"""Scoring with the vLLM engine (prompt log-probs) against the transformers engine, on the
session's engine (tests/engines/conftest.py; one vLLM engine per process).

- float32: the per-token log-probs and the top-k (ids and log-probs) equal the transformers
  engine's raw log-softmax, although the engine runs with ``logprobs_mode="processed_logprobs"``
  (prompt tokens skip the sampling processors).
- Scoring while generation requests are in flight in the same engine (the rollout server's
  pump between two steps) leaves them correct: the greedy responses equal those generated
  without the scoring, and nothing of the scoring leaks into ``step``.
"""

from __future__ import annotations

import pytest
import torch

from treadle.engines.inference import HFRolloutEngine, SamplingParams
from treadle.models.loading import load_causal_lm, load_tokenizer


@pytest.fixture
def engine(vllm_session):
    engine, _ = vllm_session
    engine.reload_from_folder()  # a test of test_vllm.py may have changed the weights
    return engine


@pytest.fixture(scope="module")
def hf(vllm_model):
    tok = load_tokenizer(vllm_model)
    model = load_causal_lm(vllm_model, torch.float32)
    return HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, micro_batch_size=4), tok


def _sequences(tok) -> tuple[list[list[int]], list[int]]:
    texts = [f"{i}+{3 * i}={4 * i}, then {i}*2={2 * i}. " * (1 + i % 4) for i in range(10)]
    seqs = [tok(t)["input_ids"] for t in texts]
    starts = [max(1, len(s) // 3) for s in seqs]
    starts[3] = len(seqs[3])  # nothing to score
    return seqs, starts


@pytest.mark.parametrize("top_k", [0, 5])
def test_vllm_score_equals_the_transformers_engine(engine, hf, top_k):
    hf_engine, tok = hf
    seqs, starts = _sequences(tok)
    got = engine.score(seqs, starts, top_k)
    want = hf_engine.score(seqs, starts, top_k)
    for g, w, seq, start in zip(got, want, seqs, starts, strict=True):
        assert len(g.log_probs) == len(seq) - start
        torch.testing.assert_close(
            torch.tensor(g.log_probs), torch.tensor(w.log_probs), atol=1e-4, rtol=0
        )
        assert len(g.topk_ids) == len(g.log_probs)
        if top_k:
            torch.testing.assert_close(
                torch.tensor(g.topk_log_probs), torch.tensor(w.topk_log_probs), atol=1e-4, rtol=0
            )
            assert g.topk_ids == w.topk_ids  # (float32: no near-ties on this model)
        else:
            assert g.topk_ids == [[] for _ in g.log_probs]


def test_vllm_score_between_steps_keeps_generation_in_flight(engine, hf):
    _, tok = hf
    seqs, starts = _sequences(tok)
    prompts = [s[:12] for s in seqs[:4]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)

    def generate(score_midway: bool) -> dict[str, tuple[list[int], list[float]]]:
        for i, p in enumerate(prompts):
            engine.add_request(f"g{i}", p, greedy)
        done = {}
        steps = 0
        while len(done) < len(prompts):
            for f in engine.step():
                done[f.request_id] = (f.token_ids, f.log_probs)
            steps += 1
            if score_midway and steps in (2, 5):
                scored = engine.score(seqs, starts, 3)
                assert len(scored) == len(seqs)
        return done

    plain = generate(False)
    mixed = generate(True)
    assert plain.keys() == mixed.keys() == {f"g{i}" for i in range(4)}
    for rid in plain:
        assert mixed[rid][0] == plain[rid][0]
        torch.testing.assert_close(
            torch.tensor(mixed[rid][1]), torch.tensor(plain[rid][1]), atol=1e-4, rtol=0
        )
    assert engine.step() == []  # nothing left over, nothing of the scoring
