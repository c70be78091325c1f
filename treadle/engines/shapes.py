"""What the engines read of a model's config: its language model's part and its attention's
head counts and width (the model FLOPs of :mod:`treadle.engines.flops`, the KV cache's bytes of
:mod:`treadle.engines.generation_memory`)."""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    """The language model's part of a model's config (a vision-language model's text part)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def heads(text: Any) -> tuple[int, int, int]:
    """``(query heads, key/value heads, head width)`` of a language model's config ``text``:
    the width where the config gives one apart from hidden size / heads (Qwen3), key/value heads
    where it groups them."""
    query = text.num_attention_heads
    width = getattr(text, "head_dim", None) or text.hidden_size // query
    return query, getattr(text, "num_key_value_heads", None) or query, width
