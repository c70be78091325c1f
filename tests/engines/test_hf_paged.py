"""The transformers engine on its paged KV cache (``rollout.cache_implementation=paged``,
transformers' continuous batching): what it samples and the log-probs it returns against a
teacher-forced forward, greedy answers and stops as the dynamic cache's, weights updated in
place, and the cache's size."""

from __future__ import annotations

import pytest
import torch
from kv_caches import answers_as_dynamic
from test_hf_generate import forward_log_probs, prompts

from treadle.engines import paged
from treadle.engines.inference import HFRolloutEngine, SamplingParams
from treadle.engines.paged import paged_manager, paged_size
from treadle.models.loading import load_causal_lm, load_tokenizer


@pytest.fixture(scope="module")
def model_and_tok(tiny_task):
    path = str(tiny_task["model"])
    return load_causal_lm(path, torch.float32).eval(), load_tokenizer(path)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=1, temperature=0.0, max_new_tokens=12),  # greedy: T = 1
        SamplingParams(n=3, temperature=0.7, max_new_tokens=10, ignore_eos=True, seed=1),
    ],
)
def test_paged_log_probs_equal_a_teacher_forced_forward(model_and_tok, params):
    """Three sequences decoded together at most (``micro_batch_size``): the others wait for a
    finished one's place."""
    model, tok = model_and_tok
    engine = HFRolloutEngine(
        model, [tok.eos_token_id], tok.pad_token_id, micro_batch_size=3, cache="paged"
    )
    ps = prompts(tok)
    out = engine.generate(ps, params)
    assert len(out.token_ids) == len(ps) * params.n
    for i, (tokens, logps) in enumerate(zip(out.token_ids, out.log_probs, strict=True)):
        assert len(tokens) == len(logps) >= 1
        if params.ignore_eos:
            assert len(tokens) == params.max_new_tokens
        want = forward_log_probs(model, ps[i // params.n], tokens, params.temperature or 1.0)
        torch.testing.assert_close(torch.tensor(logps), want, atol=2e-5, rtol=0)
    if params.temperature == 0:
        dynamic = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id)
        want_out = dynamic.generate(ps, params)
        assert out.token_ids == want_out.token_ids
        assert out.stop_reasons == want_out.stop_reasons
    else:  # a seed repeats its draws; another draws others
        assert engine.generate(ps, params).token_ids == out.token_ids
        other = engine.generate(ps, SamplingParams(**{**params.__dict__, "seed": 2}))
        assert other.token_ids != out.token_ids


def test_paged_log_probs_under_top_k_are_the_truncated_distribution_s(model_and_tok):
    """As vLLM's processed log-probs: every token is among the forward's 5 most likely, and its
    log-prob is the log-softmax over those 5 of logits / T."""
    model, tok = model_and_tok
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, cache="paged")
    ps = prompts(tok)
    params = SamplingParams(n=2, temperature=0.7, top_k=5, max_new_tokens=8, seed=3)
    out = engine.generate(ps, params)
    for i, (tokens, logps) in enumerate(zip(out.token_ids, out.log_probs, strict=True)):
        prompt = ps[i // 2]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        top = (logits.float() / 0.7).topk(5, -1)
        kept = torch.log_softmax(top.values, -1)
        hit = top.indices == torch.tensor(tokens)[:, None]
        assert hit.any(-1).all()
        torch.testing.assert_close(torch.tensor(logps), kept[hit], atol=2e-5, rtol=0)


def test_a_stop_token_ends_a_paged_sequence_as_a_dynamic_one(model_and_tok):
    model, tok = model_and_tok
    ps = prompts(tok)
    engines = [
        HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, cache=c)
        for c in ("dynamic", "paged")
    ]
    free = engines[0].generate(ps, SamplingParams(temperature=0.0, max_new_tokens=8))
    stop = free.token_ids[0][2]  # the first answer's third token
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,))
    want, got = (e.generate(ps, params) for e in engines)
    assert got.token_ids == want.token_ids
    assert got.stop_reasons == want.stop_reasons
    assert got.token_ids[0] == free.token_ids[0][: free.token_ids[0].index(stop) + 1]
    assert got.stop_reasons[0] == "stop"


def test_a_paged_cache_reads_weights_updated_in_place(tiny_task):
    path = str(tiny_task["model"])
    model = load_causal_lm(path, torch.float32).eval()
    before, after = answers_as_dynamic(model, load_tokenizer(path), "paged", 0.5, atol=2e-5)
    assert before != after  # the update changed the answers


def test_the_sequences_of_the_pages_are_decoded_together(model_and_tok):
    """8 sequences of one page each, ``micro_batch_size`` 8: one forward a token, every
    sequence in it (transformers' 15% safety margin, kept, makes 5.17 decode 7 of them, then the
    last one alone: 16 forwards)."""
    model, tok = model_and_tok
    engine = HFRolloutEngine(
        model, [tok.eos_token_id], tok.pad_token_id, micro_batch_size=8, cache="paged"
    )
    forwards: list[int] = []
    forward = model.forward

    def counting(*args, **kwargs):
        forwards.append(1)
        return forward(*args, **kwargs)

    model.forward = counting
    try:
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=1)
        out = engine.generate(prompts(tok), params)
    finally:
        del model.forward
    assert [len(t) for t in out.token_ids] == [8] * 8
    assert len(forwards) == 8


def test_pages_transformers_finds_too_big_leave_it_the_budget(model_and_tok, monkeypatch):
    """On CUDA, where the pages and transformers' activations do not fit the budget
    (``MemoryError`` from its own count, as its warm-up makes the cache: transformers 5.17 and
    5.19), the failed manager is destroyed and the cache sized by transformers to the budget."""
    model, tok = model_and_tok
    pages = {"num_blocks": 8, "max_batch_tokens": 64}
    monkeypatch.setattr(paged, "paged_size", lambda *a: {"max_memory_percent": 0.4, **pages})
    seen, made = [], []

    class Manager:
        def __init__(self, cb):
            self.cb, self.warmed_up, self.destroyed = cb, False, False

        def warmup(self):
            if self.cb.num_blocks is not None:
                raise MemoryError("Memory footprint 9 is more than available memory 8")
            self.warmed_up = True

        def destroy(self):
            self.destroyed = True

    def init(config, cb, hints):
        seen.append((cb.num_blocks, cb.max_memory_percent, cb.safety_margin))
        made.append(Manager(cb))
        return made[-1]

    monkeypatch.setattr(model, "init_continuous_batching", init, raising=False)
    got = paged_manager(model, None, prompts(tok), SamplingParams(), None, 64, 0.5)
    assert got is made[1] and got.warmed_up and not got.destroyed and made[0].destroyed
    assert seen[0] == (8, 0.4, 0.0) and seen[1][:2] == (None, 0.4)
    # on a CPU (no share of a budget) transformers' error is the answer
    monkeypatch.setattr(paged, "paged_size", lambda *a: pages)
    with pytest.raises(MemoryError, match="more than available"):
        paged_manager(model, None, prompts(tok), SamplingParams(), None, 64, 0.5)


def test_transformers_own_memory_error_leads_to_the_budget_s_cache(model_and_tok, monkeypatch):
    """The same with transformers' real count: pages it finds too many for the memory (here
    2% of the machine's) raise as its warm-up makes the cache, and the sequences are then
    generated from the cache transformers sizes to that share."""
    model, tok = model_and_tok
    many = {"max_memory_percent": 0.02, "num_blocks": 10**9, "max_batch_tokens": 64}
    monkeypatch.setattr(paged, "paged_size", lambda *a: many)
    seen = []
    init = model.init_continuous_batching

    def counted(config, cb, hints):
        seen.append(cb.num_blocks)
        return init(config, cb, hints)

    monkeypatch.setattr(model, "init_continuous_batching", counted)
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, cache="paged")
    out = engine.generate(prompts(tok)[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert seen == [10**9, None] and [len(t) for t in out.token_ids] == [4, 4]
    assert model.config._attn_implementation == "sdpa"


def test_pictures_are_refused_by_name(model_and_tok):
    model, tok = model_and_tok
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, cache="paged")
    with pytest.raises(ValueError, match=r"cache_implementation=paged generates from text"):
        engine.generate([[1, 2]], SamplingParams(), [torch.zeros(1, 3, 8, 8)])


def test_paged_size_by_hand(monkeypatch):
    cpu, per = torch.device("cpu"), 1000  # bytes a token
    # 40 + 300 tokens take 2 pages of 256; 8 sequences at a time; their prompts in a forward
    assert paged_size(per, cpu, 40, 300, 8, 0.5) == {"num_blocks": 16, "max_batch_tokens": 320}
    # 64 prompts of 100: 2,048 prompt tokens a forward; a 3,000-token prompt whole
    assert paged_size(per, cpu, 100, 20, 64, 0.5)["max_batch_tokens"] == 2048
    assert paged_size(per, cpu, 3000, 20, 8, 0.5) == {"num_blocks": 96, "max_batch_tokens": 3000}
    # CUDA: 0.5 of 100 GiB less 30 held (20 GiB budget) is 0.4 of the 50 GiB free
    gib, cuda = 1 << 30, torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (50 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * gib)
    got = paged_size(per, cuda, 40, 300, 8, 0.5)
    share = {"max_memory_percent": pytest.approx(0.4)}
    assert got == {**share, "num_blocks": 16, "max_batch_tokens": 320}
    # 64 prompts of 200: 8,192 prompt tokens a forward on CUDA
    assert paged_size(per, cuda, 200, 20, 64, 0.5)["max_batch_tokens"] == 8192
    # pages over the budget (16 x 256 tokens of 5.5 MB: 21 GiB): transformers fills it
    assert paged_size(5_500_000, cuda, 40, 300, 8, 0.5) == share
    # nothing left: the smallest share, which transformers refuses by its sizes
    monkeypatch.setattr(paged, "generation_budget", lambda device, u: 0)
    assert paged_size(per, cuda, 40, 300, 8, 0.5) == {"max_memory_percent": 1e-6}


def test_a_failed_call_leaves_the_model_s_attention_as_it_was(model_and_tok, monkeypatch):
    """A manager that fails before its thread starts does not restore the attention it
    switched (5.17 switches sdpa to paged sdpa as it is made; its ``stop`` then returns early):
    the engine does. The stand-in switches it to eager."""
    model, tok = model_and_tok
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, cache="paged")
    before = model.config._attn_implementation
    from transformers.generation.continuous_batching import continuous_api

    def refuse(self, *args, **kwargs):
        self.model.set_attn_implementation("eager")
        raise RuntimeError("the queue is closed")

    monkeypatch.setattr(continuous_api.ContinuousBatchingManager, "add_requests", refuse)
    with pytest.raises(RuntimeError, match="the queue is closed"):
        engine.generate(prompts(tok), SamplingParams(max_new_tokens=4))
    assert model.config._attn_implementation == before == "sdpa"
