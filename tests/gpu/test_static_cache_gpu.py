"""The hf engine's static KV cache on the GPU (``rollout.cache_implementation=static``): there
transformers compiles the decoding step, and the answers are still the dynamic cache's, before
and after the weights change in place (a compiled step must read the new weights)."""

from __future__ import annotations

import torch
from gpu_runs import GPU

from treadle.engines.inference import HFRolloutEngine, SamplingParams
from treadle.models.loading import load_causal_lm, load_tokenizer

pytestmark = GPU


def test_a_static_cache_answers_as_the_dynamic_one_after_a_weight_update(tiny_task):
    path = str(tiny_task["model"])
    tok = load_tokenizer(path)
    model = load_causal_lm(path, torch.float32).cuda().eval()
    ps = [tok(t)["input_ids"] for t in ("1+2=", "13+4= ", "7 + 8 =", "20+20=40 ; 3+3=")]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=8, ignore_eos=True)
    engines = {
        c: HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, cache=c)
        for c in ("dynamic", "static")
    }
    for update in range(2):
        if update:  # new weights, copied in place as the weight sync does
            g = torch.Generator().manual_seed(1)
            engines["dynamic"].update_weights(
                (n, p.detach().cpu() + 0.05 * torch.randn(p.shape, generator=g))
                for n, p in model.named_parameters()
            )
        want = engines["dynamic"].generate(ps, params)
        for _ in range(2):  # the second call runs the compiled step
            got = engines["static"].generate(ps, params)
            assert got.token_ids == want.token_ids, update
            for a, b in zip(got.log_probs, want.log_probs, strict=True):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-3, rtol=0)
