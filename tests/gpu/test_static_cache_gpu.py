"""The hf engine's static KV cache on the GPU (``rollout.cache_implementation=static``): there
transformers compiles the decoding step, and the answers are still the dynamic cache's, before
and after the weights change in place (a compiled step must read the new weights)."""

from __future__ import annotations

import torch
from gpu_runs import GPU
from static_cache import static_answers_as_dynamic

from treadle.models.loading import load_causal_lm, load_tokenizer

pytestmark = GPU


def test_a_static_cache_answers_as_the_dynamic_one_after_a_weight_update(tiny_task):
    path = str(tiny_task["model"])
    model = load_causal_lm(path, torch.float32).cuda().eval()
    static_answers_as_dynamic(model, load_tokenizer(path), scale=0.05, atol=2e-3)
