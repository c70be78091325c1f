"""The tests' tiny models: the built-in task's model family (`build_tiny_model`) at test size,
one helper for every test that builds one (a module, not a conftest fixture, so that fixtures
and tests both import it as they import tiny_runs)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from treadle.tasks.arithmetic import ModelShape

# The tiny task's model shape (tests/conftest.py's `tiny_task`): head size 32 (64 / 2 heads),
# the smallest vLLM's CPU attention runs.
TINY_SHAPE = ModelShape(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128
)


def tiny_model(out: str | Path, tokenizer_from: str | Path, seed: int = 0, **changes: Any) -> Path:
    """A tiny model of `TINY_SHAPE` (128 positions) with the tokenizer of the model folder
    ``tokenizer_from``, saved to ``out``; ``changes`` replace any of `ModelShape`'s fields."""
    from treadle.models.loading import load_tokenizer
    from treadle.tasks.arithmetic import build_tiny_model

    shape = replace(TINY_SHAPE, **{"max_positions": 128, **changes})
    tokenizer = load_tokenizer(tokenizer_from)  # a fast tokenizer, typed as their base class
    return build_tiny_model(tokenizer, out, shape, seed=seed)  # type: ignore[arg-type]


def random_lm(arch: str = "llama", attn: str = "sdpa", **changes: Any) -> Any:
    """An in-memory causal LM of ``arch`` (llama, qwen2, gemma2, cohere or granite) with random
    weights (seed 0): 2 layers of 4 heads (2 key/value heads) of 8, a vocabulary of 64,
    float32; ``changes``: more config keys."""
    import torch
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "gemma2": "Gemma2", "cohere": "Cohere"}
    name["granite"] = "Granite"
    config_cls = getattr(transformers, f"{name[arch]}Config")
    model_cls = getattr(transformers, f"{name[arch]}ForCausalLM")
    config = config_cls(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
        **changes,
    )
    torch.manual_seed(0)
    return model_cls(config).float()
