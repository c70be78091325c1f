"""``data``: the files, their columns and how text becomes prompts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from treadle.config.base import Key, Section


class DataConfig(Section):
    train_files: list[str] = Field(
        default_factory=list,
        description="Training files: JSONL, Parquet, or folders written by Dataset.save_to_disk.",
    )
    val_files: list[str] = Field(
        default_factory=list, description="Held-out files for eval (the same kinds)."
    )
    prompt_key: Key = Field("prompt", description="Column holding the prompt text.")
    answer_key: Key = Field("answer", description="Column holding the ground truth.")
    response_key: Key = Field("solution", description="Column holding SFT target responses.")
    messages_key: Key = Field(
        "messages", description="SFT: column of multi-turn chat messages (loss on assistant turns)."
    )
    chosen_key: Key = Field("chosen", description="DPO/RM: column holding the preferred response.")
    rejected_key: Key = Field(
        "rejected", description="DPO/RM: column holding the dispreferred response."
    )
    completion_key: Key = Field(
        "completion", description="KTO: column holding an unpaired example's completion."
    )
    label_key: Key = Field(
        "label", description="KTO: column holding whether the completion is desirable (bool)."
    )
    max_prompt_length: int = Field(128, gt=0, description="Longest prompt in tokens.")
    overlong_prompts: Literal["filter", "error"] = Field(
        "filter", description="What to do with a prompt over max_prompt_length."
    )
    apply_chat_template: bool = Field(True, description="Render prompts with the chat template.")
    system_prompt: str | None = Field(None, description="Optional system message for prompts.")
    batch_size: int = Field(16, gt=0, description="Prompts per RL step (SFT: samples per step).")
    shuffle: bool = Field(True, description="Shuffle the data every epoch.")
    val_size: int | None = Field(
        None, gt=0, description="Evaluate on the first N held-out rows only."
    )
    allow_special_tokens: bool = Field(
        False,
        description="Let text in the data files that spells a special token (e.g. <|im_end|>, "
        "</s>) become that token; off: it is tokenized as the plain text it is.",
    )
