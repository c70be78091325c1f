"""The hf engine's static and paged KV caches against its dynamic one, before and after the
weights are copied in place as the weight sync does: checked on the CPU (the static cache's
decoding step compiled by force, ``tests/engines/test_hf_generate.py``) and on a GPU, CUDA
graphs and all (``tests/gpu/test_kv_caches_gpu.py``)."""

from __future__ import annotations

import torch

from treadle.engines.inference import Cache, HFRolloutEngine, SamplingParams


def answers_as_dynamic(
    model, tok, cache: Cache, scale: float, atol: float
) -> list[list[list[int]]]:
    """Greedy answers of the dynamic cache and of ``cache`` to four prompts (twice from a static
    cache: its second call runs the compiled step), before and after ``scale`` x noise is added
    to every weight in place; the dynamic cache's answers, before and after. (A paged cache's
    manager is made anew at each call; the dynamic cache's call after one finds the model's
    attention setting restored.)"""
    ps = [tok(t)["input_ids"] for t in ("1+2=", "13+4= ", "7 + 8 =", "20+20=40 ; 3+3=")]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=8, ignore_eos=True)
    engines = {
        c: HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, cache=c)
        for c in ("dynamic", cache)
    }
    answers = []
    for update in range(2):
        if update:
            g = torch.Generator().manual_seed(1)
            engines["dynamic"].update_weights(  # (both engines share the model)
                (n, p.detach().cpu() + scale * torch.randn(p.shape, generator=g))
                for n, p in model.named_parameters()
            )
        want = engines["dynamic"].generate(ps, params)
        for _ in range(2 if cache == "static" else 1):
            got = engines[cache].generate(ps, params)
            assert got.token_ids == want.token_ids, update
            for a, b in zip(got.log_probs, want.log_probs, strict=True):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=atol, rtol=0)
        answers.append(want.token_ids)
    return answers
