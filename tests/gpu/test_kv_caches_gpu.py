"""The hf engine's static and paged KV caches on the GPU (``rollout.cache_implementation``):
there transformers compiles the static cache's decoding step (CUDA graphs), and runs the paged
one on CUDA kernels of its own, and the answers are still the dynamic cache's, before and after
the weights change in place (a compiled step must read the new weights)."""

from __future__ import annotations

import pytest
import torch
from command_runs import argv
from gpu_runs import GPU, PRECISIONS
from kv_caches import answers_as_dynamic

from treadle.cli import main
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.tracking.tracker import read_metrics

pytestmark = GPU


@pytest.mark.parametrize("cache", ["static", "paged"])
def test_a_cache_answers_as_the_dynamic_one_after_a_weight_update(tiny_task, cache):
    path = str(tiny_task["model"])
    model = load_causal_lm(path, torch.float32).cuda().eval()
    answers_as_dynamic(model, load_tokenizer(path), cache, scale=0.05, atol=2e-3)
    if cache == "static":
        assert hasattr(model, "_compiled_call")  # transformers compiled the decoding step


def test_grpo_trains_two_steps_on_the_paged_cache(tiny_task, tmp_path, capsys):
    """The rollout on transformers' continuous batching in bf16 (the bench's setting), the
    update in bf16 mixed: the rollout's log-probs agree with the actor's (the mismatch metric
    is small). (The bench trains on the static cache.)"""
    out = tmp_path / "run"
    extra = (*PRECISIONS["bf16_mixed"], "rollout.cache_implementation=paged")
    code = main(argv("grpo", tiny_task, out, *extra, steps=2))
    assert code == 0, capsys.readouterr().err[-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["perf/max_memory_allocated_gib"] > 0
        gaps = {k: v for k, v in m.items() if "logprob_diff" in k and k.endswith("mean")}
        assert gaps and all(abs(v) < 0.1 for v in gaps.values()), gaps
