"""``TextOptions``: how a reader turns rows into tokens, one record for every reader.

The column names, the chat template and system prompt, whether text may spell special tokens,
the length limits and what to do with a row over them, the config key that messages name, and
the tools shown in prompts. The data layer reads these options and never the run's config:
:mod:`treadle.trainers.datasets` is the one adapter that makes them from it, and the trainers
and ``treadle check`` read files through it, so both see exactly the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from treadle.data.images import ImageProcessor

Overlong = Literal["filter", "error"]


@dataclass(frozen=True)
class TextOptions:
    """How rows become tokens (defaults: the config's)."""

    prompt_key: str = "prompt"
    answer_key: str | None = "answer"  # None: prompts have no ground truth (reward models)
    response_key: str = "solution"  # SFT
    messages_key: str = "messages"  # SFT, multi-turn chat
    text_key: str = "text"  # SFT, plain text learned whole
    images_key: str = "images"  # a row's pictures (vision-language models)
    chosen_key: str = "chosen"  # pairs
    rejected_key: str = "rejected"
    completion_key: str = "completion"  # unpaired examples
    label_key: str = "label"
    max_prompt_length: int = 128
    max_response_length: int = 32  # pairs and unpaired examples: a response with its EOS
    max_length: int | None = None  # SFT: a whole example; None: prompt + response limits
    overlong: Overlong = "filter"  # a row over a limit is dropped (counted) or an error
    apply_chat_template: bool = True
    system_prompt: str | None = None
    allow_special_tokens: bool = False
    config_key: str = "data.train_files"  # named by every message about a row
    tools: list[dict[str, Any]] | None = None  # JSON schemas shown to the model in prompts
    processor: ImageProcessor | None = None  # a vision-language model's: rows with images

    @property
    def sft_max_length(self) -> int:
        if self.max_length is not None:
            return self.max_length
        return self.max_prompt_length + self.max_response_length
