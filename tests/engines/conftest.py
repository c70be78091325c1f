"""The vLLM engine of the test session (one vLLM engine per process), shared by
test_vllm.py and test_vllm_score.py; its settings are test_vllm.py's MAX_MODEL_LEN and
BUCKET_MB (kept equal here)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

MAX_MODEL_LEN = 256  # vLLM on CPU caches prompt prefixes in blocks of 128 tokens
BUCKET_MB = 0.02  # ~20 KB: the tiny model goes in ~15 buckets, q/k/v of a layer split apart


@pytest.fixture(scope="session")
def vllm_model(tiny_task, tmp_path_factory):
    """An HF folder: the tiny task's tokenizer and a ~0.1M-parameter Qwen2 with head size 32."""
    return tiny_model(
        tmp_path_factory.mktemp("vllm_model"), tiny_task["model"], max_positions=MAX_MODEL_LEN
    )


@pytest.fixture(scope="session")
def vllm_session(vllm_model):
    """The session's engine, and what starting it did to this process's RNG and threads."""
    from treadle.engines.vllm import VLLMRolloutEngine

    threads = torch.get_num_threads()
    rng = torch.random.get_rng_state()
    engine = VLLMRolloutEngine(vllm_model, max_model_len=MAX_MODEL_LEN, bucket_mb=BUCKET_MB)
    side_effects = {
        "threads_kept": torch.get_num_threads() == threads,
        "rng_kept": torch.equal(torch.random.get_rng_state(), rng),
    }
    return engine, side_effects
