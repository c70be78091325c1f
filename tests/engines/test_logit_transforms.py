"""The chunked LM head does what the model's own forward does to ``hidden @ W.T``: Gemma 2's
final logit soft-capping, Cohere's logit scale, Granite's logits scaling (a Llama for the
plain case). The rollout (vLLM, the transformers engine) samples from the model's logits, so a
head that skipped them trained on other log-probs than the ones sampled, in silence.
Log-probs, entropy, a teacher's top-k logits and the gradients of a weighted sum of them,
against the model's forward (``.logits``)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_lm

from treadle.engines.heads import LogProbHead, LogProbRequest, logit_transform

# the transforms, large enough to show (Gemma 2's attention soft-capping off: sdpa drops it)
CASES = {
    "llama": {},
    "gemma2": {"final_logit_softcapping": 2.0, "attn_logit_softcapping": None, "head_dim": 8},
    "cohere": {"logit_scale": 0.5},
    "granite": {"logits_scaling": 4.0},
}


@pytest.mark.parametrize("arch", list(CASES))
def test_the_head_s_log_probs_are_the_model_s(arch):
    lm = random_lm(arch, **CASES[arch])
    scale, softcap = logit_transform(lm.config)
    assert (scale, softcap) == {
        "llama": (1.0, None),
        "gemma2": (1.0, 2.0),
        "cohere": (0.5, None),
        "granite": (0.25, None),
    }[arch]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    topk = torch.randint(0, 64, (3, 5, 4), generator=g)
    t, weights = 0.7, torch.randn(3, 5, generator=g)

    def ours() -> tuple[torch.Tensor, ...]:
        out = LogProbHead(lm, chunk_size=4)(LogProbRequest(ids, mask, 5, t, topk_ids=topk))
        return out.log_probs, out.entropy, out.topk_logits.view(3, 5, 4)

    def theirs() -> tuple[torch.Tensor, ...]:
        z = lm(input_ids=ids).logits[:, -6:-1] / t
        logp = torch.log_softmax(z, -1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, ids[:, -5:, None])[..., 0], entropy, z.gather(-1, topk)

    results = []
    for run in (ours, theirs):
        lm.zero_grad()
        logp, entropy, top = run()
        ((logp + 0.3 * entropy) * weights).sum().add(top.sum() * 0.01).backward()
        grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
        results.append((logp.detach(), entropy.detach(), top.detach(), grads))
    (logp, entropy, top, grads), (want_logp, want_entropy, want_top, want_grads) = results
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(top, want_top, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_gemma_2_loads_with_the_attention_that_soft_caps_its_scores(tmp_path):
    """Gemma 2 also soft-caps its attention scores (``attn_logit_softcapping``), which
    transformers' sdpa attention, its default, drops and vLLM applies: ``load_causal_lm``
    (every model treadle loads) loads it with eager attention, whose logits are the model's
    (here with a soft-cap of 1 and large scores, where it shows)."""
    from treadle.models.loading import load_causal_lm

    lm = random_lm("gemma2", attn="eager", attn_logit_softcapping=1.0, head_dim=8)
    with torch.no_grad():
        for layer in lm.model.layers:
            layer.self_attn.q_proj.weight.mul_(40.0)
            layer.self_attn.k_proj.weight.mul_(40.0)
    lm.save_pretrained(tmp_path)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = lm(ids).logits
        loaded = load_causal_lm(tmp_path)
        got = loaded(ids).logits
        dropped = load_causal_lm(tmp_path, attn_implementation="sdpa")(ids).logits
    assert loaded.config._attn_implementation == "eager"
    torch.testing.assert_close(got, want)
    assert (dropped - want).abs().max() > 0.1  # what sdpa gives: the soft-cap left out


def test_the_paged_cache_refuses_a_model_that_soft_caps_attention_scores(tiny_task, tmp_path):
    """transformers' paged attention has no soft-cap either."""
    from treadle.config import load_config
    from treadle.models.loading import load_tokenizer, save_tokenizer
    from treadle.runtime.errors import ConfigError
    from treadle.serving.replica import make_engine

    lm = random_lm("gemma2", attn_logit_softcapping=50.0, head_dim=8)
    lm.save_pretrained(tmp_path)
    save_tokenizer(load_tokenizer(tiny_task["model"]), tmp_path)
    cfg = load_config(None, [f"model.path={tmp_path}", "rollout.cache_implementation=paged"])
    with pytest.raises(ConfigError, match=r"^rollout\.cache_implementation=paged: transformers'"):
        make_engine(cfg, str(tmp_path), torch.device("cpu"))


def test_sequence_parallel_refuses_a_model_that_soft_caps_attention_scores():
    """Sequence parallel's attention (torch's sdpa on each sequence) has no soft-cap."""
    from treadle.config.rules import parallel_model_problems

    gemma = {"num_attention_heads": 8, "num_key_value_heads": 4, "attn_logit_softcapping": 50.0}
    assert list(parallel_model_problems("critic", 1, 2, gemma)) == [
        "critic.sequence_parallel_size=2: the model soft-caps its attention scores "
        "(attn_logit_softcapping=50.0, as Gemma 2), which sequence parallel's attention does "
        "not: set it to 1"
    ]
    assert list(parallel_model_problems("critic", 2, 1, gemma)) == []
    assert (
        list(parallel_model_problems("critic", 1, 2, {**gemma, "attn_logit_softcapping": None}))
        == []
    )
