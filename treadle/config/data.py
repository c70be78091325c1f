"""``data``: the files (or a library's generator), their columns and how text becomes prompts."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from treadle.config.base import Key, Section, defaults

_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")
AnswerFormat = Literal["answer_tag", "last_line", "full"]
RowSource = Literal["files", "reasoning_gym"]  # where rows come from (data, a validation set)


class GymDataset(Section):
    """One reasoning-gym dataset of the mix, named as reasoning-gym's composite dataset names
    its ``DatasetSpec``: ``name``, ``weight``, ``config``."""

    name: Key = Field(description="A reasoning-gym dataset name, e.g. basic_arithmetic.")
    weight: float = Field(1.0, gt=0, description="Relative share of the rows drawn from it.")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Its config (the fields of its config class, e.g. min_terms, max_digits); "
        "the size and seed are data.reasoning_gym's.",
    )


class ReasoningGymConfig(Section):
    """``data.source=reasoning_gym``: rows drawn from reasoning-gym's procedural datasets, as its
    ``create_dataset("composite", size=, seed=, datasets=[...])`` draws them."""

    datasets: list[GymDataset] = Field(
        default_factory=list,
        description="The datasets to mix: [{name: basic_arithmetic, weight: 1, config: {...}}].",
    )
    size: int = Field(1000, gt=0, description="Training rows drawn.")
    seed: int = Field(0, ge=0, description="Seed of the training rows.")
    val_size: int = Field(200, ge=0, description="Held-out rows drawn (0: none).")
    val_seed: int = Field(
        1_000_000,
        ge=0,
        description="Seed of the held-out rows; their random streams must not overlap the "
        "training rows' (entry i of seed s uses seeds s..s+i+len(datasets)).",
    )
    answer_format: AnswerFormat = Field(
        "answer_tag",
        description="How the model is asked to answer, which is how reward.function="
        "reasoning_gym reads the answer and how SFT targets are written: answer_tag (the "
        "last <answer>...</answer>, reasoning-gym's convention), last_line (the last non-empty "
        "line) or full (the whole response, stripped). Its instruction is the system prompt "
        "unless data.system_prompt is set.",
    )
    shots: int = Field(
        0,
        ge=0,
        le=16,
        description="Worked examples shown before each question as earlier chat turns: the "
        "question and its answer in answer_format, from the first rows of seed (the same for "
        "every question). Teaches a base model the answer format without SFT.",
    )
    reasoning: str | None = Field(
        None,
        description="A function (path/to/file.py:name or module:name) that writes the "
        "working before the answer in SFT targets and shots: called with reasoning-gym's "
        "entry (question, answer, metadata), it returns text, and the target is that text, "
        "a new line, then the answer in answer_format. Needs answer_format answer_tag or "
        "last_line. None: the answer alone.",
    )

    def streams(self, split: Literal["train", "val"]) -> range:
        """The seeds of the random streams the rows of ``split`` use (see ``val_seed``)."""
        span = len(self.datasets) + 1  # reasoning-gym seeds dataset i with seed + i + 1
        if split == "train":
            return range(self.seed, self.seed + self.size + span)
        return range(self.val_seed, self.val_seed + self.val_size + span)

    @model_validator(mode="after")
    def _seeds_apart(self) -> ReasoningGymConfig:
        _each_once(self.datasets, "data.reasoning_gym.datasets")
        if self.reasoning and self.answer_format == "full":
            raise ValueError(
                "data.reasoning_gym.reasoning writes working before the answer, but "
                "answer_format=full reads the whole response as the answer: set answer_format "
                "to last_line or answer_tag"
            )
        span = len(self.datasets) + 1
        train, val = self.streams("train"), self.streams("val")
        if self.val_size and train.start < val.stop and val.start < train.stop:
            below = self.seed - self.val_size - span
            other = f" or at most {below}" if below >= 0 else ""
            raise ValueError(
                f"data.reasoning_gym.val_seed={self.val_seed} draws held-out rows from the "
                f"random streams of the training rows (seeds {train.start}..{train.stop - 1}): "
                f"set val_seed to at least {train.stop}{other}"
            )
        return self


class GymSetConfig(ReasoningGymConfig):
    """A validation set's reasoning-gym rows: ``val_size`` rows from ``val_seed`` (its ``size``
    and ``seed`` draw nothing; the run's training rows are checked against it instead)."""

    @model_validator(mode="after")
    def _seeds_apart(self) -> GymSetConfig:
        _each_once(self.datasets, "reasoning_gym.datasets")
        return self


def _each_once(datasets: list[GymDataset], key: str) -> None:
    """The rule the data section's mix and a validation set's share: each dataset named once
    (``key``: the list, as the message names it)."""
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        raise ValueError(f"{key} names a dataset twice ({names}): give each once")


class ValSetConfig(Section):
    """One named validation set of ``data.val_sets``: its rows (files, or reasoning-gym's
    held-out rows), the reward that scores it and how many of its rows are evaluated."""

    files: list[str] = Field(
        default_factory=list,
        description="Its files (JSONL, Parquet, save_to_disk folders), read with the data "
        "section's columns and templating; a data_source column reports each source apart.",
    )
    source: RowSource = Field(
        "files",
        description="Where its rows come from: files, or reasoning_gym (the held-out rows of "
        "its own reasoning_gym settings: val_size rows from val_seed).",
    )
    reasoning_gym: GymSetConfig = Field(
        default_factory=defaults(GymSetConfig),
        description="source=reasoning_gym: the datasets, val_size and val_seed of its rows.",
    )
    reward: str | None = Field(
        None,
        min_length=1,
        description="The reward function that scores it (as reward.function names one); "
        "null: reward.function.",
    )
    size: int | None = Field(None, gt=0, description="Evaluate its first N rows only.")

    def problem(self) -> str | None:
        """What is wrong with its source, if anything (the caller names the set)."""
        if self.source == "files" and not self.files:
            return "give its files (files: [held_out.jsonl]) or source: reasoning_gym"
        if self.source == "reasoning_gym":
            if self.files:
                return "source=reasoning_gym draws its own rows: remove files"
            if not self.reasoning_gym.datasets:
                return (
                    "source=reasoning_gym needs reasoning_gym.datasets, e.g. "
                    "[{name: basic_arithmetic}]"
                )
            if not self.reasoning_gym.val_size:
                return "source=reasoning_gym draws reasoning_gym.val_size rows: not 0"
        return None


VAL = "val"  # the name of the set of data.val_files (and of reasoning-gym's held-out rows)


class DataConfig(Section):
    source: RowSource = Field(
        "files",
        description="Where rows come from: files (data.train_files, data.val_files) or "
        "reasoning_gym (data.reasoning_gym: its procedural datasets, unchanged).",
    )
    reasoning_gym: ReasoningGymConfig = Field(
        default_factory=defaults(ReasoningGymConfig),
        description="data.source=reasoning_gym: the datasets, sizes and seeds.",
    )
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
    text_key: Key = Field(
        "text",
        description="SFT: column of plain text to learn whole (TRL's language-modeling rows: "
        "loss on every token, then the EOS), for a row with neither a prompt nor messages.",
    )
    images_key: Key = Field(
        "images",
        description="Column of a row's pictures (file paths relative to the data file, or "
        "bytes), for a vision-language model.path; its processor turns them into image tokens.",
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
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Variables every rendering of the policy's chat template gets (prompts, "
        "SFT and preference rows, agent turns, the endpoint), as verl's "
        "data.apply_chat_template_kwargs and TRL's chat_template_kwargs: {enable_thinking: "
        "false} opens Qwen3's turns with an empty thinking block. Each must be a variable the "
        "template reads.",
    )
    batch_size: int = Field(16, gt=0, description="Prompts per RL step (SFT: samples per step).")
    shuffle: bool = Field(True, description="Shuffle the data every epoch.")
    sampler: Literal["uniform", "pass_rate"] = Field(
        "uniform",
        description="RL: how a step's prompts are drawn: uniform (each epoch in a shuffled "
        "order) or pass_rate (a curriculum: by each prompt's recent pass rate in the groups the "
        "run made, weight max(p(1-p), floor) so those being learned come most; "
        "data.pass_rate_*).",
    )
    pass_rate_threshold: float = Field(
        1.0,
        description="data.sampler=pass_rate: a response passes when its score is at least "
        "this (1.0: as eval/<set>/accuracy counts a right answer).",
    )
    pass_rate_ema: float = Field(
        0.5,
        gt=0,
        le=1,
        description="data.sampler=pass_rate: the newest group's weight in a prompt's pass "
        "rate, a moving average over the times it was drawn (1: the latest group alone).",
    )
    pass_rate_unseen: float = Field(
        0.25,
        gt=0,
        description="data.sampler=pass_rate: the weight of a prompt not drawn yet (0.25: as "
        "much as the best-learning prompt, p = 1/2).",
    )
    pass_rate_floor: float = Field(
        0.05,
        gt=0,
        description="data.sampler=pass_rate: the weight of a prompt never solved (p = 0), "
        "so the policy comes back to it; the floor falls linearly to pass_rate_solved at p = 1.",
    )
    pass_rate_solved: float = Field(
        0.01,
        gt=0,
        description="data.sampler=pass_rate: the weight of a prompt always solved (p = 1), "
        "drawn now and then so that forgetting shows.",
    )
    val_size: int | None = Field(
        None, gt=0, description="Evaluate on the first N held-out rows only."
    )
    val_sets: dict[str, ValSetConfig] = Field(
        default_factory=dict,
        description="Named validation sets, each evaluated and reported apart "
        "(eval/<name>/<metric>): {name: {files | source, reward, size}}. data.val_files (or "
        "reasoning-gym's held-out rows) is the set named val.",
    )
    allow_special_tokens: bool = Field(
        False,
        description="Let text in the data files that spells a special token (e.g. <|im_end|>, "
        "</s>) become that token; off: it is tokenized as the plain text it is.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.source == "reasoning_gym":
            if self.train_files or self.val_files:
                raise ValueError(
                    "data.source=reasoning_gym draws its own rows: remove data.train_files and "
                    "data.val_files, or set data.source=files"
                )
            if not self.reasoning_gym.datasets:
                raise ValueError(
                    "data.source=reasoning_gym needs data.reasoning_gym.datasets, e.g. "
                    "[{name: basic_arithmetic, config: {max_terms: 3}}]"
                )
        for name, spec in self.val_sets.items():
            if not _SET_NAME.fullmatch(name):
                raise ValueError(
                    f"data.val_sets.{name}: a set's name is letters, digits, '_', '-' or '.' "
                    "(it names metrics: eval/<name>/accuracy)"
                )
            if (problem := spec.problem()) is not None:
                raise ValueError(f"data.val_sets.{name}: {problem}")
            if spec.source == self.source == "reasoning_gym":
                train, held = self.reasoning_gym.streams("train"), spec.reasoning_gym.streams("val")
                if train.start < held.stop and held.start < train.stop:
                    raise ValueError(
                        f"data.val_sets.{name}.reasoning_gym.val_seed="
                        f"{spec.reasoning_gym.val_seed} draws rows from the random streams of "
                        f"the training rows (seeds {train.start}..{train.stop - 1}): set it to "
                        f"at least {train.stop}"
                    )
        if VAL in self.val_sets and self.has_val:
            held_out = "data.val_files" if self.source == "files" else "data.reasoning_gym.val_size"
            raise ValueError(
                f"data.val_sets.{VAL}: the name val is the set of {held_out}; give this set "
                f"another name, or remove {held_out}"
            )
        return self

    @property
    def set_names(self) -> list[str]:
        """The names of every validation set: ``val`` first when there is one."""
        return ([VAL] if self.has_val else []) + [n for n in self.val_sets if n != VAL]

    @property
    def has_val(self) -> bool:
        """Whether the run has held-out prompts (files, or reasoning-gym's held-out rows)."""
        if self.source == "reasoning_gym":
            return self.reasoning_gym.val_size > 0
        return bool(self.val_files)
