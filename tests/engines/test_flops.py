"""The model FLOPs of an update (PaLM's count, as verl's MFU) and the rate metrics, by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from treadle.engines import flops
from treadle.engines.flops import matmul_params, peak_tflops, speed_metrics, update_flops


def test_a_head_width_apart_from_the_model_width():
    """Qwen3's shape: 16 query heads of 128 (2,048 wide) on a width of 1,024, 8 key/value
    heads; untied head of 151,936 words counted once, the embedding (a lookup) not at all."""
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    )
    per_layer = 2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072  # q,o; k,v; the MLP
    assert matmul_params(config) == 28 * per_layer + 151936 * 1024
    # two sequences of 100 and 300 tokens: attention's 12 x layers x 2,048 x (100² + 300²)
    got = update_flops(config, 400, 100**2 + 300**2)
    assert got == 6 * matmul_params(config) * 400 + 12 * 28 * 2048 * 100_000


def test_a_value_head_counts_one_output():
    config = AutoConfig.for_model(
        "llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    assert matmul_params(config) - matmul_params(config, head_outputs=1) == 999 * 64


def test_what_the_count_does_not_describe_has_none():
    moe = AutoConfig.for_model("mixtral", num_local_experts=4, hidden_size=64)
    assert matmul_params(moe) is None and update_flops(moe, 10, 100) is None


def test_the_rate_and_its_share_of_the_peak(monkeypatch):
    assert speed_metrics("actor", 3e12, 2.0, None) == {"perf/tflops/actor": 1.5}
    got = speed_metrics("critic", 3e12, 2.0, 150.0)
    assert got == {"perf/tflops/critic": 1.5, "perf/mfu/critic": pytest.approx(0.01)}
    assert speed_metrics("actor", 3e12, 0.0, 150.0) == {}
    assert peak_tflops(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    assert peak_tflops(torch.device("cuda", 0)) == flops.PEAK_TFLOPS["H200"] == 989.4
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA T4")
    assert peak_tflops(torch.device("cuda", 0)) is None
