"""``TextOptions``: how a reader turns rows into tokens, one record for every reader.

The column names, the chat template and system prompt, whether text may spell special tokens,
the length limits and what to do with a row over them, the config key that messages name, and
the tools shown in prompts. ``TextOptions.from_config`` is the one adapter from a run's config:
the trainers and ``treadle check`` read files through it, so both see exactly the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from treadle.data.images import ImageProcessor, load_image_processor
from treadle.models.folders import resolve_model_path
from treadle.runtime.errors import ConfigError

if TYPE_CHECKING:
    from treadle.config import Config

Overlong = Literal["filter", "error"]


@dataclass(frozen=True)
class TextOptions:
    """How rows become tokens (defaults: the config's)."""

    prompt_key: str = "prompt"
    answer_key: str | None = "answer"  # None: prompts have no ground truth (reward models)
    response_key: str = "solution"  # SFT
    messages_key: str = "messages"  # SFT, multi-turn chat
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

    @classmethod
    def from_config(cls, cfg: Config, config_key: str, tools: Any = None) -> TextOptions:
        """The ``data`` section's settings (responses: at most ``rollout.max_new_tokens``)."""
        d = cfg.data
        # columns, template, system prompt, special tokens, prompt length: the same names
        same = {f.name for f in fields(cls)} & set(type(d).model_fields)
        return cls(
            **{name: getattr(d, name) for name in same},
            max_response_length=cfg.rollout.max_new_tokens,
            overlong=d.overlong_prompts,
            config_key=config_key,
            tools=tools,
            processor=_processor(cfg),
        )


def _processor(cfg: Config) -> ImageProcessor | None:
    """The image processor of ``model.path`` when it is a vision-language model (a path that
    does not resolve is reported by the checks of the model, not here)."""
    try:
        path = resolve_model_path(cfg.model.path, allow_download=cfg.model.allow_download)
    except ConfigError:
        return None
    return load_image_processor(path)
