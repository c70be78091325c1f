"""``actor`` and its ``lora`` sub-section: the trained policy's optimizer and batching."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from treadle.config.base import Beta, Key, Section, defaults
from treadle.models.folders import lora_head_refused

LrScheduleName = Literal["constant", "linear", "cosine"]
"""What the lr does after the warm-up (:class:`~treadle.engines.schedule.LrSchedule`)."""


class LoraConfig(Section):
    """LoRA adapters on the actor (peft): only they train and are checkpointed."""

    rank: int = Field(
        0, ge=0, description="Adapter rank r; 0: off (full fine-tuning of every parameter)."
    )
    alpha: float = Field(
        16.0, gt=0, description="Scale numerator: the update is alpha / rank * B @ A."
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapters' input, in training forwards."
    )
    target_modules: str | list[Key] = Field(
        "all-linear",
        description="Modules that get adapters: 'all-linear' (every linear layer of the "
        "decoder, as peft names it; of a mixture of experts, not its experts, whose fused "
        "weights are not linear layers) or a list of module names (q_proj, v_proj...), checked "
        "against the model at start-up. Never the LM head: treadle computes log-probs from its "
        "weight, past an adapter.",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and "lm_head" in value:
            raise ValueError(lora_head_refused("lm_head"))
        if isinstance(value, str) and value != "all-linear":
            raise ValueError(f"{value!r} is neither 'all-linear' nor a list of module names")
        if isinstance(value, list) and not value:
            raise ValueError("an empty list gives no layer an adapter: list module names, or "
                             "'all-linear'")  # fmt: skip
        return value


class ActorConfig(Section):
    """The trained policy: its ranks and their layout (data, tensor or sequence parallel: see
    [parallelism.md](parallelism.md)), optimizer, batching and forward passes."""

    world_size: int = Field(
        1,
        gt=0,
        description="Training ranks: data-parallel (FSDP2 shards) x tensor_parallel_size x "
        "sequence_parallel_size.",
    )
    tensor_parallel_size: int = Field(
        1,
        gt=0,
        description="Ranks that split each decoder layer's attention and MLP (DTensor, "
        "column/row-wise), composed with FSDP2 on a data x tensor mesh; must divide "
        "world_size and the model's heads, key/value heads and intermediate size.",
    )
    sequence_parallel_size: int = Field(
        1,
        gt=0,
        description="Ranks that split each packed row's tokens (Ulysses: all-to-all over "
        "attention heads, verl's ulysses_sequence_parallel_size); needs remove_padding; "
        "must divide world_size and the model's heads and key/value heads.",
    )
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, optimizer steps.")
    lr_schedule: LrScheduleName = Field(
        "constant",
        description="The lr after the warm-up: constant, or a linear or half-cosine decay "
        "from lr to lr x min_lr_ratio at the run's last optimizer step (then it stays there). "
        "treadle counts the optimizer steps: RL, (trainer.total_steps - critic.warmup_steps) "
        "x ppo_epochs x ceil(data.batch_size x rollout.n / ppo_mini_batch_size) (the nominal "
        "batch: agents or filters that change a step's rows change its steps, and steps past "
        "the count stay at the floor); sft, dpo, kto, rm: one a step, trainer.total_steps or "
        "trainer.epochs x the steps of an epoch.",
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="A decaying lr_schedule ends at lr x this (verl's min_lr_ratio).",
    )
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clipping threshold.")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each RL batch.")
    ppo_mini_batch_size: int = Field(
        64, gt=0, description="Samples (prompts x n) per optimizer step, across all ranks."
    )
    micro_batch_size: int = Field(
        16, gt=0, description="Samples per forward/backward per data-parallel rank."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute decoder activations in backward (less memory, ~1/3 slower)."
    )
    offload_params: bool = Field(
        False,
        description="Weights in host memory while they wait, back on the device for each "
        "use (verl's param_offload), for every training engine: the actor's from its weight "
        "sync to the next step's first pass over it (the rollout generates with the memory), "
        "the reference's, a critic's and a reward model's between their passes. On a GPU it "
        "frees their size (float32: 4 bytes a parameter) at the cost of a copy each way over "
        "the host link; on a CPU nothing moves.",
    )
    offload_optimizer: bool = Field(
        False,
        description="AdamW's moments (8 bytes a trained parameter) in host memory except "
        "during the optimizer step (verl's optimizer_offload), for every trained engine: "
        "forwards, backwards and generation run without them.",
    )
    defer_gradient_sync: bool = Field(
        True,
        description="Reduce-scatter the gradients across data-parallel ranks once an "
        "optimizer step, after its last micro-batch (one collective; until then each rank "
        "holds the whole model's gradients, in float32 with float32 weights or mixed "
        "precision). false: after every micro-batch, "
        "gradients sharded throughout (the memory to train a model near the GPUs' size; "
        "verl's use_no_sync_for_gradient_accumulation=false). Every training engine's.",
    )
    recompute_old_log_probs: bool | None = Field(
        None,
        description="Compute the policy's log-probs before the update in a pass of their own "
        "(PPO's 'old' policy). null: only when needed (more than one optimizer step a batch, "
        "KL in the reward); otherwise the update's first forward gives them, detached: the "
        "same ratio (1) and gradient, one forward pass fewer.",
    )
    skip_zero_advantage: bool = Field(
        True,
        description="Leave out of the actor's update the rows whose advantages are all zero "
        "(a GRPO group whose rewards are all equal): where the policy loss is a multiple of "
        "the advantage (ppo, gspo, cispo, gpg, sapo, geo_mean, dppo, bypass_mode) and there is "
        "no KL loss (algorithm.kl_coef=0) nor entropy bonus, such a row adds exactly nothing "
        "to the loss or its gradient; the loss keeps its denominators (the whole mini-batch's "
        "tokens and rows), so the update is the same, with fewer forward and backward passes. "
        "actor/entropy and the rollout mismatch are then measured on the rows the update "
        "computes; actor/rows_skipped is the fraction left out.",
    )
    logprob_chunk_size: int = Field(
        512, gt=0, description="Label tokens per chunk when computing log-probs from hidden states."
    )
    remove_padding: bool = Field(
        True,
        description="Forward passes (actor, reference) on packed sequences: no compute on pad "
        "tokens, attention kept within each sequence; same results as the padded forward. "
        "Not for a model with layers that carry a state along the sequence (a convolution or "
        "a linear attention: LFM2, Qwen3-Next, Qwen3.5, Mamba hybrids; sequence_parallel_size "
        "must be 1 there) nor one whose attention mask ignores packed sequences (gpt-oss, "
        "Falcon, OPT, BLOOM...): those run padded.",
    )
    pack_row_tokens: int = Field(
        256,
        gt=0,
        description="remove_padding: at most this many tokens per packed row (a longer "
        "sequence gets its own row). Attention is computed over whole rows (block-diagonal "
        "mask), so its cost per token grows with the width; one long row loses to padding on "
        "CPU. Narrower rows, down to the longest sequence, are used when cheaper: each row "
        "position weighted by 3 x hidden size + the width. (Sequence parallel attends within "
        "each sequence alone: there the width costs no attention.)",
    )
    share_prompts: bool = Field(
        True,
        description="remove_padding: rows with the same prompt (a GRPO group's samples, "
        "told by their prompt tokens) have it computed once in the packed forwards of actor, "
        "reference and critic: the prompt, then each response attending to it and to its own "
        "earlier tokens (an explicit attention mask); their micro-batches keep a group "
        "together. Same log-probs and gradients within float rounding. Not with "
        "sequence_parallel_size > 1, pictures, a sliding window or an attention other than "
        "sdpa and eager (they keep the unshared layout).",
    )
    mixed_precision: Literal["none", "bf16", "auto"] = Field(
        "none",
        description="bf16: decoder layers and LM-head products of actor and reference compute "
        "in bfloat16 from float32 parameters (FSDP2 MixedPrecisionPolicy); norms, softmax, "
        "log-probs, value heads and the optimizer float32. "
        "Measured on an AVX-512 BF16 CPU, SmolLM2-135M actor update: 2.2-2.8x faster; on a CPU "
        "without native bfloat16 (AVX2 only) torch emulates it, ~25x slower. auto: bf16 where "
        "it is native (a CUDA GPU with bf16, a CPU with AVX-512 BF16 or AMX), else none.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="Form micro-batches by this many valid tokens per rank (a longer sample "
        "goes alone) instead of micro_batch_size samples; null: by micro_batch_size.",
    )

    def shares_prompts(self) -> bool:
        """Whether packed forwards compute a shared prompt once (share_prompts, which needs
        remove_padding)."""
        return self.remove_padding and self.share_prompts

    def dp_size(self) -> int:
        """Data-parallel ranks: world_size / (tensor_parallel_size x sequence_parallel_size)
        (rounded down; the config rules refuse a remainder)."""
        return max(self.world_size // (self.tensor_parallel_size * self.sequence_parallel_size), 1)

    lora: LoraConfig = Field(
        default_factory=defaults(LoraConfig),
        description="LoRA adapters (rank > 0): the rollout gets merged weights, the reference "
        "is the actor with its adapters disabled, final_model is merged with the adapter in "
        "final_model/adapter/.",
    )
