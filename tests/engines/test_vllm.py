"""The vLLM rollout engine against transformers, on a tiny model, one engine per session.

vLLM's CPU attention supports head sizes of 32 and more; the session's `tiny_task` model has
16 (hidden 64, 4 heads), so these tests build a model of the same size with 2 heads of 32
from the task's tokenizer. The engine starts once (a few seconds) and every test begins from
the folder's weights.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import pytest
import torch
from tiny_models import tiny_model

from treadle.engines.inference import HFRolloutEngine, RolloutOutput, SamplingParams
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.runtime.errors import ConfigError

# The session engine's settings (vllm_model and vllm_session are in tests/engines/conftest.py,
# shared with test_vllm_score.py: one vLLM engine per process).
MAX_MODEL_LEN = 256  # vLLM on CPU caches prompt prefixes in blocks of 128 tokens
BUCKET_MB = 0.02  # ~20 KB: the tiny model goes in ~15 buckets, q/k/v of a layer split apart


@pytest.fixture
def engine(vllm_session):
    engine, _ = vllm_session
    engine.reload_from_folder()  # a test that changed the weights does not leak into the next
    return engine


@pytest.fixture(scope="session")
def tokenizer(vllm_model):
    return load_tokenizer(vllm_model)


@pytest.fixture(scope="session")
def prompts(tiny_task, tokenizer):
    """Eight chat-formatted task prompts of different lengths, as token ids."""
    with open(tiny_task["test"], encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][:8]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        for row in rows
    ]
    texts[1] = "Please answer. " + texts[1]  # lengths differ, so the HF engine pads
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def hf_engine(model, tokenizer) -> HFRolloutEngine:
    return HFRolloutEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)


def perturbed(model, seed: int, scale: float = 0.05):
    """`model` with seeded noise added to every parameter (the tied embedding included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def assert_same_greedy(a: RolloutOutput, b: RolloutOutput) -> None:
    assert a.token_ids == b.token_ids
    assert a.stop_reasons == b.stop_reasons
    for x, y in zip(a.log_probs, b.log_probs, strict=True):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-4)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


def test_start_keeps_host_rng_and_threads(vllm_session, engine, prompts):
    _, side_effects = vllm_session
    assert side_effects == {"threads_kept": True, "rng_kept": True}
    rng, threads = torch.random.get_rng_state(), torch.get_num_threads()
    engine.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=4))
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert torch.get_num_threads() == threads


def test_greedy_matches_transformers(engine, vllm_model, tokenizer, prompts):
    hf = hf_engine(load_causal_lm(vllm_model), tokenizer)
    assert_same_greedy(engine.generate(prompts, GREEDY), hf.generate(prompts, GREEDY))


def test_update_weights_matches_transformers(engine, vllm_model, tokenizer, prompts):
    # The long prompt fills a whole prefix-cache block: a stale cached prefix would show.
    prompts = [*prompts, [t for p in prompts for t in p][:150]]
    before = engine.generate(prompts, GREEDY)
    model = perturbed(load_causal_lm(vllm_model), seed=1)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = hf_engine(model, tokenizer).generate(prompts, GREEDY)
    # state_dict() holds lm_head.weight too, as the actor's full_state() does.
    engine.update_weights(model.state_dict().items())
    after = engine.generate(prompts, GREEDY)
    assert after.token_ids != before.token_ids  # the update is visible...
    assert_same_greedy(after, expected)  # ...and is exactly the new model, head included
    # A second update (back to the folder's weights) lands too.
    engine.update_weights(load_causal_lm(vllm_model).state_dict().items())
    assert_same_greedy(engine.generate(prompts, GREEDY), before)


def test_a_partial_rollout_goes_on_with_the_new_weights(engine, vllm_model, tokenizer, prompts):
    """Greedy requests paused after a few engine steps by an update to other weights: the tokens
    before the pause are the old model's, the rest the new model's continuation of the prompt
    and those tokens, each tagged with its version."""
    import asyncio

    from treadle.serving.server import Request, RolloutServer

    server = RolloutServer(engine, "rollout replica 0", version=0)
    new_model = perturbed(load_causal_lm(vllm_model), seed=2)

    async def update_after_steps() -> None:
        for _ in range(4):
            await asyncio.sleep(0)  # the pump steps once per turn of the loop
        server.update_weights(new_model.state_dict().items(), 1, interrupt=True)

    async def both():
        batch = server.generate([Request(f"p{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)])
        responses, _ = await asyncio.gather(batch, update_after_steps())
        return responses

    responses = asyncio.run(both())
    old = hf_engine(load_causal_lm(vllm_model), tokenizer).generate(prompts, GREEDY)
    new = hf_engine(new_model, tokenizer)
    resumed = 0
    for prompt, r, before in zip(prompts, responses, old.token_ids, strict=True):
        k = r.versions().count(0)
        assert r.versions() == [0] * k + [1] * (len(r.token_ids) - k)
        assert r.token_ids[:k] == before[:k]
        if k < len(r.token_ids):
            resumed += 1
            rest = dataclasses.replace(GREEDY, max_new_tokens=GREEDY.max_new_tokens - k)
            expected = new.generate([prompt + r.token_ids[:k]], rest).token_ids[0]
            assert r.token_ids[k:] == expected and r.weight_version == 0
    assert resumed >= len(prompts) // 2  # most were paused mid-way
    assert server.version == 1 and server.in_flight == 0


def test_update_weights_needs_the_full_state(engine, vllm_model, prompts):
    state = [(n, t) for n, t in load_causal_lm(vllm_model).state_dict().items() if "mlp" not in n]
    with pytest.raises(ValueError, match=r"left .* vLLM parameters unset"):
        engine.update_weights(state)


def test_sampled_log_probs_match_forward_pass(engine, vllm_model, prompts):
    temperature = 0.7
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=16, seed=3)
    out = engine.generate(prompts[:4], params)
    model = load_causal_lm(vllm_model)
    worst = 0.0
    for i, (tokens, logps) in enumerate(zip(out.token_ids, out.log_probs, strict=True)):
        prompt = prompts[i // params.n]
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits / temperature, -1).gather(
            -1, torch.tensor(tokens).unsqueeze(-1)
        )
        worst = max(worst, (expected.squeeze(-1) - torch.tensor(logps)).abs().max().item())
    assert worst < 1e-4


def test_samples_lengths_and_stops(engine, vllm_model, tokenizer, prompts):
    # n samples per prompt, prompt-major; reproducible from the seed.
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)
    out = engine.generate(prompts[:4], params)
    assert len(out.token_ids) == len(out.log_probs) == len(out.stop_reasons) == 12
    for tokens, logps, reason in zip(out.token_ids, out.log_probs, out.stop_reasons, strict=True):
        assert len(tokens) == len(logps)
        assert reason == "length" and len(tokens) == 8  # a random model rarely emits EOS
        assert all(lp <= 0 for lp in logps)
    groups = [out.token_ids[i : i + 3] for i in range(0, 12, 3)]
    assert all(len({tuple(s) for s in g}) > 1 for g in groups)  # the samples differ
    assert engine.generate(prompts[:4], params).token_ids == out.token_ids
    other_seed = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=6)
    assert engine.generate(prompts[:4], other_seed).token_ids != out.token_ids

    # Greedy with n=2: both samples of a prompt are its greedy answer, in prompt order.
    greedy = engine.generate(prompts[:3], SamplingParams(n=2, temperature=0.0, max_new_tokens=6))
    single = engine.generate(prompts[:3], SamplingParams(temperature=0.0, max_new_tokens=6))
    assert greedy.token_ids == [t for t in single.token_ids for _ in range(2)]

    # A stop token ends the response and is its last token.
    stop = single.token_ids[0][2]
    cut = engine.generate(prompts[:1], SamplingParams(temperature=0.0, stop_token_ids=(stop,)))
    first = single.token_ids[0].index(stop)
    assert cut.token_ids == [single.token_ids[0][: first + 1]]
    assert cut.stop_reasons == ["stop"]


def test_sampling_with_chunked_prefill_is_reproducible(engine):
    """48 prompts of 100 tokens overflow vLLM's 4,096-token step: some prefills are split.

    (Per-request seeds crashed vLLM on CPU exactly here.)"""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 290, (100,), generator=g).tolist() for _ in range(48)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=3, seed=1)
    out = engine.generate(prompts, params)
    assert len(out.token_ids) == 96 and all(len(t) == 3 for t in out.token_ids)
    assert engine.generate(prompts, params).token_ids == out.token_ids


def test_stops_at_eos(engine, vllm_model, tokenizer):
    """Make EOS the greedy first token of one prompt; both engines stop there, EOS kept."""
    eos = tokenizer.eos_token_id
    prompt = tokenizer("What is 7+5?", add_special_tokens=False)["input_ids"]  # holds no EOS
    model = load_causal_lm(vllm_model)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
        top = int(logits.argmax())
        assert logits[top] > 0
        embed = model.model.embed_tokens.weight  # tied: also the LM head
        embed[eos] = 2 * embed[top]  # EOS's logit becomes twice the top one
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    expected = hf_engine(model, tokenizer).generate([prompt], params)
    engine.update_weights(model.state_dict().items())
    out = engine.generate([prompt], params)
    assert out.token_ids == expected.token_ids == [[eos]]
    assert out.stop_reasons == expected.stop_reasons == ["stop"]


def test_ignore_eos_runs_every_response_to_max_new_tokens(engine, vllm_model, tokenizer):
    """With EOS the greedy first token, ignore_eos makes both engines generate on past it."""
    eos = tokenizer.eos_token_id
    prompt = tokenizer("What is 7+5?", add_special_tokens=False)["input_ids"]
    model = load_causal_lm(vllm_model)
    with torch.no_grad():
        top = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
        model.model.embed_tokens.weight[eos] = 2 * model.model.embed_tokens.weight[top]
    engine.update_weights(model.state_dict().items())
    hf = hf_engine(model, tokenizer)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    expected = hf.generate([prompt], greedy)
    out = engine.generate([prompt], greedy)
    assert out.token_ids[0][0] == eos and len(out.token_ids[0]) == 8
    assert out.stop_reasons == expected.stop_reasons == ["length"]
    assert_same_greedy(out, expected)
    sampled = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=1, ignore_eos=True)
    for result in (engine.generate([prompt] * 2, sampled), hf.generate([prompt] * 2, sampled)):
        assert [len(t) for t in result.token_ids] == [8] * 6
        assert result.stop_reasons == ["length"] * 6
    # Without it both stop at EOS (see test_stops_at_eos); an explicit stop token still stops.
    assert engine.generate([prompt], dataclasses.replace(greedy, ignore_eos=False)).token_ids == [
        [eos]
    ]
    stop = out.token_ids[0][3]
    cut = dataclasses.replace(greedy, stop_token_ids=(stop,))
    first = out.token_ids[0].index(stop)
    for result in (engine.generate([prompt], cut), hf.generate([prompt], cut)):
        assert result.token_ids == [out.token_ids[0][: first + 1]]
        assert result.stop_reasons == ["stop"]


def test_one_engine_per_process(vllm_session, vllm_model, tmp_path, prompts):
    from treadle.engines.vllm import VLLMRolloutEngine

    engine, _ = vllm_session
    engine.update_weights(perturbed(load_causal_lm(vllm_model), seed=2).state_dict().items())
    changed = engine.generate(prompts, GREEDY)
    # The same folder and settings: a handle on the same engine, holding the folder's weights.
    again = VLLMRolloutEngine(vllm_model, max_model_len=MAX_MODEL_LEN)
    assert again.llm is engine.llm
    assert again.generate(prompts, GREEDY).token_ids != changed.token_ids
    with pytest.raises(ConfigError, match="only one vLLM engine"):
        VLLMRolloutEngine(vllm_model, max_model_len=MAX_MODEL_LEN // 2)


def test_not_a_model_folder(tmp_path):
    from treadle.engines.vllm import VLLMRolloutEngine

    with pytest.raises(ConfigError, match=r"is not a model folder: no config\.json"):
        VLLMRolloutEngine(tmp_path, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(ConfigError, match="does not exist"):
        VLLMRolloutEngine(tmp_path / "missing", max_model_len=MAX_MODEL_LEN)


@pytest.mark.slow  # imports vLLM (~15 s), as the engine does before it refuses the model
def test_unsupported_head_size_is_a_config_error(tiny_task, tmp_path):
    from treadle.engines.vllm.slot import _check_cpu_head_size

    narrow = tmp_path / "head16"  # 64 / 4 heads: below vLLM's CPU minimum of 32
    tiny_model(
        narrow,
        tiny_task["model"],
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_positions=256,
    )
    with pytest.raises(ConfigError, match=r"head size 16 .* rollout.engine=hf works"):
        _check_cpu_head_size(str(narrow))


def test_vllm_starts_beside_a_frozen_heap_and_a_failed_start_thaws_it():
    """vLLM's start collects the whole heap five times, then freezes it (`_heap_frozen`): it
    starts with every object already there frozen, so those collections pass them by, and a
    start that fails leaves the collector as it found it."""
    import gc

    from treadle.engines.vllm.slot import _heap_frozen

    was_frozen = gc.get_freeze_count() > 0  # by the session's engine, if it ran already
    gc.unfreeze()
    here = [[]]  # a container: the collector tracks it
    try:
        with _heap_frozen():
            assert gc.get_freeze_count() > 0
            assert not any(o is here for o in gc.get_objects())
            made = [[]]
            assert any(o is made for o in gc.get_objects())
        assert gc.get_freeze_count() > 0  # started: frozen, as vLLM leaves it
        gc.unfreeze()
        with pytest.raises(ConfigError, match="did not start"), _heap_frozen():
            raise ConfigError("did not start")
        assert gc.get_freeze_count() == 0
        assert any(o is here for o in gc.get_objects())
    finally:
        if was_frozen:
            gc.freeze()


def test_start_failures_are_config_errors(vllm_session, vllm_model, monkeypatch):
    from treadle.engines import vllm
    from treadle.engines.vllm import slot

    monkeypatch.setattr(slot, "_LIVE", None)  # as if no engine ran in this process
    with pytest.raises(ConfigError, match=r"did not start .* rollout.engine=hf works"):
        vllm.VLLMRolloutEngine(vllm_model, max_model_len=10**6)  # > the model's 256
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ConfigError, match=r"vLLM is not importable .* rollout.engine=hf works"):
        vllm.VLLMRolloutEngine(vllm_model, max_model_len=MAX_MODEL_LEN)


def test_a_json_schema_holds_the_response_to_it(engine, tokenizer, prompts):
    """Structured output (a forced tool choice's schema at the endpoint): the tiny random model,
    sampled, answers JSON of the schema; its tokens and log-probs come back as usual."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=1.0, max_new_tokens=120, seed=3)
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(f"json{i}", prompt, params, json_schema=json.dumps(schema))
    done: dict[str, Any] = {}
    while len(done) < 3:
        done.update((f.request_id, f) for f in engine.step())
    for f in done.values():
        text = tokenizer.decode(f.token_ids, skip_special_tokens=True)
        assert len(f.log_probs) == len(f.token_ids)
        if f.stop_reason == "stop":  # (a whitespace run may reach the budget first)
            value = json.loads(text)
            assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
            assert value["n"] in (1, 2, 3)
        else:
            assert text.lstrip().startswith("{")
    assert any(f.stop_reason == "stop" for f in done.values())


def test_the_rollout_server_hands_a_requests_schema_to_the_engine(engine, tokenizer, prompts):
    """The endpoint's forced tool choice goes to the engine as the request's json_schema
    (the endpoint's side: tests/rollout/test_endpoint_tool_choice.py; a tools prompt does not
    fit this engine's 256 tokens with the tiny tokenizer)."""
    from treadle.serving import LocalReplica, Request, RolloutClient, RolloutServer

    schema = json.dumps({"enum": ["yes", "no"]})
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=5)
    client = RolloutClient([LocalReplica(RolloutServer(engine, "vllm"))])
    try:
        requests = [
            Request(f"s{i}", tuple(p), params, json_schema=schema)
            for i, p in enumerate(prompts[:4])
        ]
        responses = client.generate(requests)
    finally:
        client.close()
    texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in responses]
    assert all(json.loads(t) in ("yes", "no") for t in texts), texts
