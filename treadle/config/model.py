"""``model``: the model that is trained (and rolls out)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from treadle.config.base import Section


class ModelConfig(Section):
    path: str = Field("", description="Local Hugging Face model folder (config.json + weights).")
    tokenizer_path: str | None = Field(None, description="Tokenizer folder; defaults to path.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Parameter dtype of the trained model and the rollout engine."
    )
    allow_download: bool = Field(
        False,
        description="Let a path that is not a local folder be fetched from the Hugging Face "
        "hub as a model id; off: it is an error.",
    )
