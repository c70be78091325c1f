"""The transformers engine's generation: the sampled tokens' log-probs equal a teacher-forced
forward of the same sequence, no decoding step's full-vocabulary scores outlive the next step,
a batch bigger than the memory budget is generated in chunks, and a static KV cache, its
decoding step compiled or not, answers as the dynamic one."""

from __future__ import annotations

import dataclasses
import gc
import math
import weakref

import pytest
import torch
from kv_caches import answers_as_dynamic
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoConfig

from treadle.engines import inference
from treadle.engines.generation_memory import (
    chunk_size,
    generation_budget,
    kv_bytes,
    sequence_bytes,
)
from treadle.engines.inference import HFRolloutEngine, SamplingParams
from treadle.engines.sampling import GumbelSample
from treadle.models.loading import load_causal_lm, load_tokenizer


@pytest.fixture(scope="module")
def model_and_tok(tiny_task):
    path = str(tiny_task["model"])
    return load_causal_lm(path, torch.float32).eval(), load_tokenizer(path)


def prompts(tok) -> list[list[int]]:
    # different lengths: the batch is left-padded
    return [tok(t)["input_ids"] for t in ("1+2=", "13+4= ", "7 + 8 =", "20+20=40 ; 3+3=")]


@torch.no_grad()
def forward_log_probs(model, prompt: list[int], response: list[int], temperature: float):
    """log-softmax(logits / T) of one unpadded sequence at its response tokens."""
    logits = model(torch.tensor([prompt + response])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, -1)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    "params",
    [
        # the log-probs are of logits / T, not of the top-k / top-p filtered scores
        SamplingParams(n=2, temperature=0.7, top_k=8, top_p=0.9, max_new_tokens=12, seed=3),
        SamplingParams(n=1, temperature=0.0, max_new_tokens=12),  # greedy: T = 1
        SamplingParams(n=2, temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=1),
    ],
)
def test_sampled_log_probs_equal_a_teacher_forced_forward(model_and_tok, params):
    model, tok = model_and_tok
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, micro_batch_size=3)
    ps = prompts(tok)
    out = engine.generate(ps, params)
    assert len(out.token_ids) == len(ps) * params.n
    temperature = params.temperature or 1.0
    for i, (tokens, logps) in enumerate(zip(out.token_ids, out.log_probs, strict=True)):
        assert len(tokens) == len(logps) >= 1
        if params.ignore_eos:
            assert len(tokens) == params.max_new_tokens
        want = forward_log_probs(model, ps[i // params.n], tokens, temperature)
        torch.testing.assert_close(torch.tensor(logps), want, atol=2e-5, rtol=0)
    if params.temperature == 0:  # greedy: each token is the forward's most likely
        for i, tokens in enumerate(out.token_ids):
            logits = model(torch.tensor([ps[i] + tokens])).logits[0, len(ps[i]) - 1 : -1]
            assert logits.argmax(-1).tolist() == tokens


def test_a_draw_is_from_the_processed_scores_softmax():
    """GumbelSample: the argmax of the scores plus its noise is a draw from their softmax (the
    Gumbel-max trick): each id's frequency over 40,000 draws within 4 standard errors of its
    probability, and an id filtered out (-inf) never drawn."""
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0], dtype=torch.float64)
    scores = probs.log().float().expand(40_000, -1).clone()
    torch.manual_seed(0)
    drawn = GumbelSample()(None, scores).argmax(-1)
    freq = torch.bincount(drawn, minlength=6).double() / 40_000
    se = (probs * (1 - probs) / 40_000).sqrt()
    assert ((freq - probs).abs() <= 4 * se).all(), (freq, probs)
    assert freq[5] == 0 and freq[0] == pytest.approx(0.5, abs=0.02)


def test_sampling_keeps_only_what_top_k_leaves(model_and_tok):
    """Temperature and top-k come before the draw: top-k 1 samples what greedy decoding picks,
    and a seed gives the same samples twice."""
    model, tok = model_and_tok
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id)
    greedy = engine.generate(prompts(tok), SamplingParams(temperature=0.0, max_new_tokens=8))
    top1 = SamplingParams(n=2, temperature=1.3, top_k=1, max_new_tokens=8, seed=5)
    sampled = engine.generate(prompts(tok), top1)
    assert sampled.token_ids == [t for t in greedy.token_ids for _ in range(2)]
    wide = SamplingParams(n=2, temperature=1.3, max_new_tokens=8, seed=5)
    assert (
        engine.generate(prompts(tok), wide).token_ids
        == engine.generate(prompts(tok), wide).token_ids
    )


class VocabWide(TorchDispatchMode):
    """Every tensor an operation makes with the vocabulary as its last dimension, held weakly:
    those still alive are the ones something keeps."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.made: dict[int, weakref.ref[torch.Tensor]] = {}  # (a WeakSet compares tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab:
                self.made[id(t)] = weakref.ref(t)
        return out

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.made.values())


def test_no_step_s_full_vocabulary_scores_outlive_the_next_step(model_and_tok):
    """At every decoding step, the tensors alive with the vocabulary as last dimension are as
    few as at the first: ``output_logits`` kept one more a step (and stacked them all)."""
    model, tok = model_and_tok
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id)
    alive: list[int] = []
    forward = model.forward
    wide = VocabWide(model.config.vocab_size)

    def counting(*args, **kwargs):
        gc.collect()  # (a tensor in a reference cycle is not kept)
        alive.append(wide.alive())
        return forward(*args, **kwargs)

    model.forward = counting
    try:  # 6 steps: one tensor kept a step would be 5 more at the last
        params = SamplingParams(n=4, max_new_tokens=6, ignore_eos=True, seed=0)
        with wide:
            out = engine.generate(prompts(tok), params)
    finally:
        del model.forward
    assert all(len(t) == 6 for t in out.token_ids)
    assert len(alive) == 6  # one forward a step
    assert alive[1] > 0 and max(alive) <= alive[1] <= 3, alive  # bounded, not growing


def test_a_batch_over_the_budget_is_generated_in_chunks(model_and_tok, monkeypatch):
    model, tok = model_and_tok
    ps = prompts(tok)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6, ignore_eos=True)
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, micro_batch_size=64)
    calls: list[int] = []
    generate = model.generate

    def counting(*args, **kwargs):
        calls.append(len(kwargs["input_ids"]))
        return generate(*args, **kwargs)

    model.generate = counting
    try:
        whole = engine.generate(ps, params)
        assert calls == [8]  # on a CPU: micro_batch_size alone
        longest = max(len(p) for p in ps)
        per = sequence_bytes(model.config, torch.float32, longest, params.max_new_tokens)
        monkeypatch.setattr(inference, "generation_budget", lambda device, u: int(3.5 * per))
        calls.clear()
        chunked = engine.generate(ps, params)
    finally:
        del model.generate
    assert calls == [3, 3, 2]
    assert chunked.token_ids == whole.token_ids  # greedy: the same answers in any chunks
    for a, b in zip(chunked.log_probs, whole.log_probs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=2, temperature=0.0, max_new_tokens=8),
        SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5),
    ],
)
def test_a_static_cache_generates_what_the_dynamic_one_does(model_and_tok, params):
    """``cache="static"``: the same tokens and log-probs (greedy, and sampled under one seed),
    from a static cache whose prompt width is rounded up to 64 columns."""
    model, tok = model_and_tok
    ps = prompts(tok)
    dynamic = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id)
    static = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, cache="static")
    seen: list[tuple[int, str | None]] = []
    generate = model.generate

    def recording(*args, **kwargs):
        seen.append((kwargs["input_ids"].shape[1], kwargs.get("cache_implementation")))
        return generate(*args, **kwargs)

    model.generate = recording
    try:
        want, got = dynamic.generate(ps, params), static.generate(ps, params)
    finally:
        del model.generate
    assert seen == [(max(len(p) for p in ps), None), (64, "static")]
    assert got.token_ids == want.token_ids
    assert got.stop_reasons == want.stop_reasons
    for a, b in zip(got.log_probs, want.log_probs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


@pytest.mark.slow  # inductor compiles the decoding step (~10 s)
def test_a_compiled_static_cache_reads_weights_updated_in_place(tiny_task):
    """What a GPU does with ``cache="static"``, forced on the CPU (transformers'
    ``CompileConfig._compile_all_devices``, meant for tests): the decoding step compiled, its
    answers are the dynamic cache's, also after the weight sync copies new weights in place (a
    compiled step that kept the old ones would answer otherwise: the weights move a lot)."""
    from transformers.generation.configuration_utils import CompileConfig

    path = str(tiny_task["model"])
    model = load_causal_lm(path, torch.float32).eval()
    config = CompileConfig()
    config._compile_all_devices = True
    model.generation_config.compile_config = config
    tok = load_tokenizer(path)
    before, after = answers_as_dynamic(model, tok, "static", scale=0.5, atol=1e-4)
    assert hasattr(model, "_compiled_call")  # it did compile
    assert before != after  # the update changed the answers


def test_an_engine_asleep_holds_its_weights_in_host_memory_and_wakes_with_the_synced_ones(
    tiny_task,
):
    """``sleep_to_host`` (on CUDA by default): asleep, every weight's data is its host copy (the
    device's let go; a tied head still the embedding); a weight sync while asleep writes into
    the copies, one while awake is copied at the next sleep; awake, the engine answers as one
    that never slept and took the same syncs."""
    path = str(tiny_task["model"])
    tok = load_tokenizer(path)
    engines = [
        HFRolloutEngine(load_causal_lm(path, torch.float32).eval(), [tok.eos_token_id], 0, **kw)
        for kw in ({"sleep_to_host": True}, {})
    ]
    slept, kept = engines
    assert slept.host is not None and kept.host is None  # (on CPU, by default: nothing moves)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=8, ignore_eos=True)
    ps = prompts(tok)
    first = kept.generate(ps, params).token_ids
    assert slept.generate(ps, params).token_ids == first
    weights = slept.host.tensors
    awake = [t.data_ptr() for t in weights]
    g = torch.Generator().manual_seed(1)
    for sync in range(3):
        new = {
            n: p.detach() + 0.5 * torch.randn(p.shape, generator=g) for n, p in kept.params.items()
        }
        if sync < 2:
            slept.sleep()
            slept.sleep()  # (twice: once)
            host = [t.data_ptr() for t in weights]
            assert host == [h.data_ptr() for h in slept.host.host]
            assert not set(host) & set(awake)
        for engine in engines:  # syncs 0 and 1 while asleep, 2 while awake
            engine.update_weights(new.items())
        slept.wake()
        slept.wake()
        awake = [t.data_ptr() for t in weights]
        assert not set(awake) & set(host)
        if slept.model.config.tie_word_embeddings:
            assert slept.model.lm_head.weight is slept.model.get_input_embeddings().weight
        answers = kept.generate(ps, params).token_ids
        assert slept.generate(ps, params).token_ids == answers != first
    slept.sleep()  # after a sync while awake: the copies take the new weights
    slept.wake()
    assert slept.generate(ps, params).token_ids == answers


def test_the_engine_sleeps_to_host_on_cuda_but_not_with_a_static_cache(tiny_task, monkeypatch):
    path = str(tiny_task["model"])
    model = load_causal_lm(path, torch.float32).eval()
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: cuda))
    caches = ("dynamic", "paged", "static")
    engines = [HFRolloutEngine(model, [0], 0, cache=c) for c in caches]
    assert [e.host is not None for e in engines] == [True, True, False]


def test_rollout_cache_implementation_reaches_the_engine(tiny_task):
    from treadle.config import load_config
    from treadle.serving.replica import make_engine

    path = str(tiny_task["model"])
    for cache in ("dynamic", "static", "paged"):
        cfg = load_config(None, [f"model.path={path}", f"rollout.cache_implementation={cache}"])
        engine = make_engine(cfg, path, torch.device("cpu"))
        assert isinstance(engine, HFRolloutEngine)
        assert engine.cache == cache


def test_sequence_bytes_of_the_1_4b_workload_by_hand():
    """Qwen2.5-1.5B's shape (28 layers, 2 key/value heads of 128, hidden 1536, MLP 8960) with
    SmolLM2's vocabulary (49,152), bf16, 64 prompt + 256 new tokens."""
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=49152,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
    )
    assert kv_bytes(config, torch.bfloat16) == 2 * 28 * 2 * 128 * 2  # K and V of a token
    kv = 2 * 28 * 2 * 128 * (64 + 256) * 2  # K and V, layers, heads, head size, tokens, bytes
    scores = 4 * 49152 * 4  # four float32 copies of a step's scores
    prefill = 64 * (4 * 1536 + 3 * 8960) * 2
    assert sequence_bytes(config, torch.bfloat16, 64, 256) == kv + scores + prefill == 14_188_544
    # 256 sequences (32 prompts x 8) need 3.4 GiB: one call within 40 GiB, 29 a call in 0.4
    assert chunk_size(40 << 30, kv + scores + prefill, 256) == 256
    assert chunk_size(400 << 20, kv + scores + prefill, 256) == math.floor((400 << 20) / 14_188_544)
    assert chunk_size(1, 10, 64) == 1  # one sequence at least: too big fails in torch, named
    assert chunk_size(None, 10, 64) == 64  # a CPU: micro_batch_size alone


def test_the_budget_is_only_on_cuda():
    assert generation_budget(torch.device("cpu"), 0.5) is None


@pytest.mark.parametrize("cache", ["dynamic", "paged"])
def test_the_hf_engine_stops_where_the_model_s_generation_config_says(tiny_task, tmp_path, cache):
    """Gemma's instruct models end a turn with ``<end_of_turn>``, not their tokenizer's EOS:
    their generation_config.json lists both, and vLLM and transformers' ``generate`` stop at
    either. A folder whose generation config also names the token a seeded sample reaches at
    its k-th step ends there, through the engine a run builds (it ran to its length)."""
    import json
    import shutil

    from treadle.config import load_config
    from treadle.serving.replica import make_engine

    folder = tmp_path / "model"
    shutil.copytree(tiny_task["model"], folder)
    cfg = load_config(None, [f"model.path={folder}", f"rollout.cache_implementation={cache}"])
    prompt = load_tokenizer(folder)("3 + 4 =")["input_ids"]
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    tokens = make_engine(cfg, str(folder), torch.device("cpu")).generate([prompt], sampled)
    free = tokens.token_ids[0]
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])  # a first occurrence
    config_file = folder / "generation_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token_id"] = [config["eos_token_id"], free[k]]
    config_file.write_text(json.dumps(config))
    out = make_engine(cfg, str(folder), torch.device("cpu")).generate([prompt], sampled)
    assert (tokens.stop_reasons, len(free)) == (["length"], 12)
    assert out.token_ids[0] == free[: k + 1] and out.stop_reasons == ["stop"]


def test_the_engine_stops_where_the_chat_template_closes_a_turn(tiny_task, tmp_path):
    """A base model's EOS and generation config may say ``<|endoftext|>`` while the chat
    template it is trained with closes a turn with ``<|im_end|>`` (Qwen2.5's base models): a
    response stops there too. A tokenizer whose template closes a turn with the token a seeded
    sample reaches at its k-th step ends the response there."""
    import shutil

    from treadle.config import load_config
    from treadle.data.templating import end_of_turn
    from treadle.models.loading import save_tokenizer
    from treadle.serving.replica import make_engine

    folder = tmp_path / "model"
    shutil.copytree(tiny_task["model"], folder)
    cfg = load_config(None, [f"model.path={folder}"])
    tok = load_tokenizer(folder)
    prompt = tok("3 + 4 =")["input_ids"]
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    free = make_engine(cfg, str(folder), torch.device("cpu")).generate([prompt], sampled)
    ids = free.token_ids[0]
    pad = tok.pad_token_id
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i] and ids[i] != pad)
    token = tok.convert_ids_to_tokens(ids[k])
    tok.add_special_tokens({"additional_special_tokens": [token]})  # its id stays
    tok.chat_template = "{% for m in messages %}{{ m['content'] + '" + token + "' }}{% endfor %}"
    assert end_of_turn(tok) == (ids[k], token) and tok.eos_token_id != ids[k]
    save_tokenizer(tok, folder)
    out = make_engine(cfg, str(folder), torch.device("cpu")).generate([prompt], sampled)
    assert out.token_ids[0] == ids[: k + 1] and out.stop_reasons == ["stop"]
    ignoring = dataclasses.replace(sampled, ignore_eos=True)
    again = make_engine(cfg, str(folder), torch.device("cpu")).generate([prompt], ignoring)
    assert again.token_ids[0] == ids  # (rollout.ignore_eos: every response to its length)
    raw = load_config(None, [f"model.path={folder}", "data.apply_chat_template=false"])
    plain = make_engine(raw, str(folder), torch.device("cpu")).generate([prompt], sampled)
    assert plain.token_ids[0] == ids  # prompts without the template: their turns are not its


def test_the_template_s_end_of_turn_stops_only_where_the_generation_config_lists_one_eos():
    """Qwen2.5's base models (one EOS, <|endoftext|>; turns closed by <|im_end|>) get it; a
    model that lists several stops (Gemma, Phi-3, gpt-oss) keeps its own list."""
    from treadle.serving.replica import turn_stop

    turn = (5, "<|im_end|>")
    assert turn_stop(2, turn, None) == 5 and turn_stop(2, turn, 2) == 5
    assert turn_stop(2, turn, [2]) == 5 and turn_stop(2, turn, [2, 9]) is None
    assert turn_stop(2, turn, [5]) is None and turn_stop(5, turn, None) is None
    assert turn_stop(2, None, None) is None


@pytest.mark.parametrize(
    ("eos", "config_eos", "stops"),
    [(2, None, [2]), (2, 2, [2]), (2, [7, 2, 9], [2, 7, 9]), (None, 7, [7]), (None, None, [])],
)
def test_stop_token_ids_are_the_tokenizer_s_eos_then_the_generation_config_s(
    eos, config_eos, stops
):
    from types import SimpleNamespace

    from treadle.engines.inference import stop_token_ids

    assert stop_token_ids(eos, SimpleNamespace(eos_token_id=config_eos)) == stops
    assert stop_token_ids(eos, None) == ([eos] if eos is not None else [])
    # then the template's end of turn, once
    assert stop_token_ids(eos, SimpleNamespace(eos_token_id=config_eos), 5) == [*stops, 5]
    assert stop_token_ids(eos, SimpleNamespace(eos_token_id=config_eos), 7) == (
        stops if 7 in stops else [*stops, 7]
    )


@pytest.mark.slow  # imports vLLM (~7 s)
def test_a_vllm_request_stops_at_the_template_s_end_of_turn_unless_it_ignores_eos():
    from treadle.engines.vllm import VLLMRolloutEngine

    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # its requests' settings alone
    engine.turn_stops = [7]
    kwargs = engine._sampling_kwargs(SamplingParams(stop_token_ids=(3,)))
    assert kwargs["stop_token_ids"] == [3, 7]
    kwargs = engine._sampling_kwargs(SamplingParams(stop_token_ids=(3,), ignore_eos=True))
    assert (kwargs["stop_token_ids"], kwargs["ignore_eos"]) == ([3], True)
