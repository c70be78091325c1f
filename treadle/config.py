"""The typed run configuration: schema, YAML + command-line overrides, validation.

A run is described by one YAML file with the sections below plus `section.key=value`
overrides on the command line. Every field has a type, a default and a one-line doc (the
``description``); cross-field rules are checked at start-up, before Ray or a model is touched,
and fail with a message that says which key to change. Unknown keys are errors with the
closest valid key suggested; a key given twice in the YAML is an error (PyYAML would keep the
last), and a syntax error names the file, line and column. Every bad override, unknown key,
invalid value and broken rule found is listed, one per line of the ConfigError; numbers are
never nan or infinite. What needs files, models or registries is ``treadle.check``'s. The
fully resolved config is written to ``<trainer.output_dir>/config.yaml`` so a run directory
says exactly what ran.

The schema knows nothing of Ray or torch; it is plain pydantic.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from treadle.errors import ConfigError


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated, and
    no number may be nan or infinite (pydantic's floats accept them by default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic takes true as 1 for an int or float field; `rollout.n: true` is a mistake
        if isinstance(value, bool) and info.field_name is not None:
            kinds = _kinds(cls.model_fields[info.field_name].annotation)
            if bool not in kinds and kinds & {int, float}:
                raise ValueError(f"expected a number, not {str(value).lower()}")
        return value


def _kinds(annotation: Any) -> set[Any]:
    """The types an annotation admits at its top level (``int | None`` -> {int, NoneType})."""
    return set(get_args(annotation)) | {annotation} if get_args(annotation) else {annotation}


Key = Annotated[str, Field(min_length=1)]  # a column name, a path: never empty
Beta = Annotated[float, Field(ge=0, lt=1)]


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


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = Field("hf", description="Inference engine for generation.")
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None,
        description="Weight dtype of the rollout engine (null: model.dtype). bfloat16 generates "
        "faster on CPUs with AVX-512 BF16 and on GPUs; the train/rollout log-prob mismatch it "
        "adds is logged (rollout/logprob_diff_*) and algorithm.rollout_correction corrects for it.",
    )
    n: int = Field(4, gt=0, description="Samples per prompt (the GRPO group size).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 disables it.")
    max_new_tokens: int = Field(32, gt=0, description="Longest response in tokens.")
    ignore_eos: bool = Field(
        False,
        description="Generate max_new_tokens tokens for every response, ignoring EOS (benchmarks).",
    )
    micro_batch_size: int = Field(64, gt=0, description="hf engine: sequences per generate call.")
    weight_sync_bucket_mb: float = Field(
        64, gt=0, description="vllm engine: size of one weight-sync message, MiB."
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="vllm engine on CPU: KV cache size, GiB.")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vllm engine on CUDA: fraction of GPU memory it may take."
    )
    placement: Literal["colocated", "split"] = Field(
        "colocated",
        description="'colocated': one replica in every actor rank's process, on its devices, "
        "sleeping while the actor trains, weights synced in memory; 'split': rollout.replicas "
        "replicas in a resource pool of their own, weights broadcast over a process group.",
    )
    replicas: int | None = Field(
        None,
        gt=0,
        description="Rollout replicas (each one inference engine serving requests); null: one "
        "per actor rank when colocated (it must equal actor.world_size), 1 when split.",
    )
    tensor_parallel_size: int = Field(
        1, gt=0, description="GPUs per replica (vLLM tensor parallelism); 1 on CPU."
    )
    num_cpus: float | None = Field(
        None,
        gt=0,
        description="split: CPUs of the rollout pool, divided equally over the replicas "
        "(null: half of trainer.num_cpus); the actor's ranks get the rest.",
    )
    ray_resources: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="split: Ray custom resources each replica's bundle also asks for, to place "
        "the replicas on the nodes that have them (`ray start --resources='{\"rollout\": 2}'`).",
    )
    max_inflight_per_replica: int = Field(
        256, gt=0, description="Requests in flight per replica at most (the client waits)."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="A request not answered within this many seconds stops the run."
    )
    agent_loop: Key = Field(
        "single_turn",
        description="How a sample is generated: single_turn (one response), tools (multi-turn "
        "with rollout.tools, Hermes <tool_call> blocks), or a custom async loop given as "
        "'module:function' or 'path/to/file.py:function'.",
    )
    tools: list[str] = Field(
        default_factory=list,
        description="Tools of the tools loop: plain Python functions with type hints and a "
        "docstring, as 'module:function' or 'path/to/file.py:function'.",
    )
    max_turns: int = Field(4, gt=0, description="Model turns per trajectory at most.")
    max_tool_response_tokens: int = Field(
        256, gt=0, description="A tool result longer than this many tokens is cut."
    )
    tool_timeout_s: float = Field(
        10.0, gt=0, description="A tool call running longer becomes an error message."
    )
    max_concurrent_trajectories: int = Field(
        256, gt=0, description="Agent loops running at once (each turn a request)."
    )
    max_response_length: int | None = Field(
        None,
        gt=0,
        description="Agent loops: tokens after the prompt at most (model and tool tokens); "
        "null: max_turns * (max_new_tokens + max_tool_response_tokens).",
    )

    @field_validator("top_k")
    @classmethod
    def _top_k_on_or_off(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return value


class RewardConfig(Section):
    function: Key = Field(
        "arithmetic",
        description="Built-in reward name or a user function as 'path/to/file.py:function' "
        "('python:...' names a function given to treadle.train(reward=...)). "
        "With reward.model_path set it no longer trains: it is logged as reward/rule_mean and "
        "still scores held-out evaluation.",
    )
    overlong_buffer_len: int = Field(
        0,
        ge=0,
        description="DAPO over-long shaping: a response longer than rollout.max_new_tokens minus "
        "this many tokens loses up to overlong_penalty, linearly; 0 disables.",
    )
    overlong_penalty: float = Field(
        1.0, ge=0, description="DAPO over-long shaping: the penalty at rollout.max_new_tokens."
    )
    model_path: str | None = Field(
        None,
        description="Reward model (a value-model folder, e.g. from `treadle rm`): its score at "
        "the last token of prompt+response replaces reward.function's as the RL reward.",
    )
    micro_batch_size: int = Field(16, gt=0, description="Reward model: sequences per forward.")
    num_workers: int = Field(
        2,
        ge=0,
        description="Worker processes that call the reward function, each call under "
        "reward.timeout_s; 0: call it in the trainer's process, without a time limit. Code "
        "rewards: sandboxed programs run at once.",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="Wall-clock seconds one reward call (a code reward: one graded program) may "
        "take.",
    )


class AlgorithmConfig(Section):
    adv_estimator: str = Field("grpo", description="Advantage estimator, by registered name.")
    norm_adv_by_std: bool = Field(True, description="GRPO: divide by the group std.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor (GAE, REINFORCE++).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    gdpo_reward_keys: list[Key] = Field(
        default_factory=list,
        description="GDPO (adv_estimator=gdpo, which needs them): the reward's components to "
        "normalize each on its own within the group, in order; the reward function returns a "
        "dict of named numbers (its score is their sum) that holds these keys.",
    )
    gdpo_reward_weights: list[float] | None = Field(
        None,
        description="GDPO: the weight of each gdpo_reward_keys component in the advantage; "
        "null: 1 each.",
    )
    policy_loss: str = Field("ppo", description="Policy loss, by registered name.")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip: lower bound 1 - low.")
    clip_ratio_high: float = Field(0.2, ge=0, description="PPO clip: upper bound 1 + high.")
    clip_ratio_c: float | None = Field(
        3.0,
        gt=1,
        description="Dual-clip constant c > 1 (Ye et al., arXiv 1912.09729): a token with "
        "A < 0 loses at most -A*c however large its ratio; null: off. 3.0, verl's and the "
        "paper's value: it only binds off-policy (ratio > c), where PPO's clip leaves the loss "
        "of a negative-advantage token unbounded, and keeps 'ppo' equal to verl's 'vanilla'. "
        "Also the ppo_clip loss of bypass_mode.",
    )
    clip_cov_ratio: float = Field(
        2e-4,
        gt=0,
        le=1,
        description="clip_cov: fraction of the valid tokens (at least one) whose gradient is "
        "dropped, chosen at random among the candidates (the paper's and verl's 2e-4).",
    )
    clip_cov_lb: float = Field(
        1.0, description="clip_cov: candidates have a covariance above this (paper, verl: 1)."
    )
    clip_cov_ub: float = Field(
        5.0, description="clip_cov: candidates have a covariance below this (paper, verl: 5)."
    )
    kl_cov_ratio: float = Field(
        2e-4,
        gt=0,
        le=1,
        description="kl_cov: fraction of the valid tokens (at least one), those of largest "
        "covariance, that get the |log-ratio| penalty (verl's 2e-4; the paper's recipe uses "
        "2e-3 for 7B models).",
    )
    kl_cov_coef: float = Field(
        1.0,
        ge=0,
        description="kl_cov: weight of the |log-ratio| penalty. 1, as in the paper's recipe "
        "(ppo_kl_coef=1) and verl's function fallback; verl's PolicyLossConfig default is 0.1.",
    )
    sapo_tau_pos: float = Field(
        1.0, gt=0, description="sapo: gate temperature for A > 0 (the paper's and verl's 1.0)."
    )
    sapo_tau_neg: float = Field(
        1.05, gt=0, description="sapo: gate temperature for A <= 0 (the paper's and verl's 1.05)."
    )
    dro_beta: float | None = Field(
        None,
        gt=0,
        description="dro: weight of the 0.5 * (log pi - log pi_old)^2 penalty; required with "
        "policy_loss=dro (no default, as in verl: the paper tunes it).",
    )
    dppo_divergence_low: float = Field(
        0.2,
        gt=0,
        description="dppo_tv / dppo_kl: divergence threshold for tokens with A <= 0 (verl "
        "reads clip_ratio_low for it; 0.2 is that default).",
    )
    dppo_divergence_high: float = Field(
        0.2,
        gt=0,
        description="dppo_tv / dppo_kl: divergence threshold for tokens with A > 0 (verl "
        "reads clip_ratio_high for it; 0.2 is that default).",
    )
    dppo_is_cap: float = Field(
        20.0,
        gt=1,
        description="dppo_tv / dppo_kl: truncation of the importance ratio that weights the "
        "gradient. 20: the paper asks for a large cap (its Section 5.4) and verl's loss falls "
        "back to 20, though verl passes its clip_ratio_c (3.0) when set.",
    )
    bypass_loss_type: Literal["ppo_clip", "reinforce"] = Field(
        "ppo_clip",
        description="bypass_mode (the rollout log-probs are the old policy): 'ppo_clip' clips "
        "r = pi / pi_rollout as PPO; 'reinforce' is -w*A*log pi with truncated weights w.",
    )
    bypass_is: Literal["none", "token", "sequence"] = Field(
        "token",
        description="bypass_mode with reinforce: importance weight pi / pi_rollout per token "
        "or per sequence (product over its tokens), or none. verl's default is sequence; "
        "token has far lower variance on long responses.",
    )
    bypass_is_cap: float = Field(
        2.0, gt=0, description="bypass_mode with reinforce: truncation of the weights (verl: 2)."
    )
    loss_agg_mode: str = Field("token-mean", description="How token losses become one number.")
    loss_scale_factor: float | None = Field(
        None,
        gt=0,
        description="seq-mean-token-sum-norm: the constant each sequence's token sum is "
        "divided by; null: the micro-batch's padded response length (verl's default), which "
        "changes with the batch; set e.g. rollout.max_new_tokens for a fixed one.",
    )
    kl_coef: float = Field(0.001, ge=0, description="KL-to-reference loss weight; 0 drops ref.")
    kl_estimator: str = Field("k3", description="KL estimator, by registered name.")
    kl_reward_coef: float = Field(
        0.0,
        ge=0,
        description="KL penalty in the reward: r_t = score_t - coef * KL_t (InstructGPT); "
        "the initial coefficient when kl_target is set; 0 disables.",
    )
    kl_reward_estimator: str = Field("k1", description="KL estimator of the reward penalty.")
    kl_target: float | None = Field(
        None,
        gt=0,
        description="Adaptive KL in the reward (Ziegler et al.): steer the coefficient so the "
        "KL approaches this; null keeps kl_reward_coef fixed.",
    )
    kl_horizon: int = Field(10_000, gt=0, description="Adaptive KL: horizon, in samples.")
    filter_groups: bool = Field(
        False,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal and "
        "generate more prompts until data.batch_size groups remain.",
    )
    max_gen_rounds: int = Field(
        4,
        gt=0,
        description="Dynamic sampling: generation rounds per step at most; when they do not "
        "fill the batch it is topped up with equal-reward groups (zero advantage).",
    )
    mask_truncated: bool = Field(
        False,
        description="DAPO overlong filtering: responses cut at rollout.max_new_tokens do not "
        "count in the policy loss.",
    )
    entropy_coef: float = Field(0.0, description="Entropy bonus weight.")
    rollout_correction: Literal["none", "tis", "mis"] = Field(
        "none",
        description="Correct the gap between the policy that sampled (rollout log-probs: stale "
        "weights in async modes, another engine or dtype) and the learner's old policy, per "
        "token: 'tis' weights the policy-gradient term by min(ratio, cap) (truncated importance "
        "sampling), 'mis' by the ratio where it is at most the cap and drops tokens above it "
        "from the loss (masked importance sampling); ratio = pi_old / pi_rollout.",
    )
    rollout_correction_cap: float = Field(
        2.0, gt=1, description="The cap of algorithm.rollout_correction (tis, mis)."
    )
    plugins: list[Key] = Field(
        default_factory=list,
        description="Python modules ('my_package.estimators') or files ('path/to/file.py') "
        "imported before any registered name is resolved, by the driver and every worker: "
        "where your @register_adv_estimator (policy loss, KL estimator...) functions live. A "
        "file path is made absolute.",
    )

    @model_validator(mode="after")
    def _one_weight_per_gdpo_key(self) -> AlgorithmConfig:
        w, keys = self.gdpo_reward_weights, self.gdpo_reward_keys
        if w is not None and len(w) != len(keys):
            raise ValueError(
                f"algorithm.gdpo_reward_weights has {len(w)} weights for {len(keys)} "
                f"algorithm.gdpo_reward_keys ({keys}): give one weight per key"
            )
        if len(set(keys)) != len(keys):
            raise ValueError(f"algorithm.gdpo_reward_keys lists a key twice: {keys}")
        return self

    @field_validator("plugins")
    @classmethod
    def _absolute_plugin_files(cls, value: list[str]) -> list[str]:
        # workers import them too, and a worker's working directory may not be the driver's
        return [str(Path(p).absolute()) if p.endswith(".py") else p for p in value]


DPO_KNOBS = ("label_smoothing", "discopop_tau", "simpo_gamma", "f_divergence", "f_alpha")
"""``dpo`` settings that only some losses read (the ``knobs`` of their registration)."""


class DPOConfig(Section):
    """Preference pairs (`treadle dpo`): rows of a prompt, a chosen and a rejected response
    (`data.prompt_key`, `data.chosen_key`, `data.rejected_key`). Every loss of the DPO family
    compares the policy with the frozen initial model, except the reference-free `orpo` and
    `simpo`, for which no reference model is built. The table of losses, their papers and
    knobs: README, "Preference learning"."""

    beta: float = Field(
        0.1,
        gt=0,
        description="DPO beta: strength of the reference (IPO: tau; ORPO: lambda, the weight "
        "of the odds-ratio term; SimPO: the reward scale, 2.0-2.5 in the paper).",
    )
    loss_type: str = Field(
        "sigmoid",
        description="Preference loss, by registered name: sigmoid, ipo, hinge, robust, "
        "exo_pair, nca_pair, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, "
        "discopop, sigmoid_norm (with a reference); orpo, simpo (reference-free).",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="Label noise epsilon: sigmoid (cDPO), robust, aot, aot_unpaired, simpo; "
        "exo_pair needs it > 0 (1e-3 in the paper).",
    )
    discopop_tau: float = Field(
        0.05, gt=0, description="discopop: temperature of the log-ratio modulation."
    )
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: target reward margin gamma.")
    f_divergence: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = Field(
        "reverse_kl",
        description="f-DPO: the divergence to the reference (reverse_kl: DPO's); for "
        "sigmoid, ipo, hinge, robust, exo_pair, discopop, sigmoid_norm.",
    )
    f_alpha: float = Field(
        0.5, description="f_divergence=alpha_divergence: its alpha (1: the reverse KL)."
    )
    nll_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the chosen responses' token-mean NLL added to the loss "
        "(RPO, arXiv 2404.19733); 0: the preference loss alone (orpo includes it at 1).",
    )
    eval_task: bool = Field(
        False,
        description="Also report held-out task accuracy (greedy generation on data.val_files, "
        "scored by reward.function; the rows need data.answer_key).",
    )


class KTOConfig(Section):
    """Unpaired examples (`treadle kto`): rows of a prompt, a completion and a boolean label
    (`data.prompt_key`, `data.completion_key`, `data.label_key`; true: desirable), as TRL's
    unpaired preference format. A file of pairs (`data.chosen_key`, `data.rejected_key`)
    is read as two examples per pair, the chosen one desirable."""

    beta: float = Field(0.1, gt=0, description="KTO beta: strength of the reference.")
    loss_type: str = Field(
        "kto", description="Unpaired loss, by registered name: kto, apo_zero_unpaired."
    )
    desirable_weight: float = Field(
        1.0,
        gt=0,
        description="lambda_D, the weight of desirable examples; with unbalanced data keep "
        "lambda_D n_D / (lambda_U n_U) in [1, 4/3] (the paper).",
    )
    undesirable_weight: float = Field(
        1.0, gt=0, description="lambda_U, the weight of undesirable examples."
    )
    nll_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the desirable completions' token-mean NLL added to the loss "
        "(as dpo.nll_coef; not in TRL's KTO); 0: the KTO loss alone.",
    )
    eval_task: bool = Field(
        False,
        description="Also report held-out task accuracy (greedy generation on data.val_files, "
        "scored by reward.function; the rows need data.answer_key).",
    )


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
        "decoder, not the LM head, as peft names it) or a list of module names "
        "(q_proj, v_proj...), checked against the model at start-up.",
    )


class ActorConfig(Section):
    world_size: int = Field(1, gt=0, description="Data-parallel ranks (FSDP2 shards).")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, optimizer steps.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clipping threshold.")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each RL batch.")
    ppo_mini_batch_size: int = Field(
        64, gt=0, description="Samples (prompts x n) per optimizer step, across all ranks."
    )
    micro_batch_size: int = Field(16, gt=0, description="Samples per forward/backward per rank.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute decoder activations in backward (less memory, ~1/3 slower)."
    )
    recompute_old_log_probs: bool | None = Field(
        None,
        description="Compute the policy's log-probs before the update in a pass of their own "
        "(PPO's 'old' policy). null: only when needed (more than one optimizer step a batch, "
        "KL in the reward); otherwise the update's first forward gives them, detached: the "
        "same ratio (1) and gradient, one forward pass fewer.",
    )
    logprob_chunk_size: int = Field(
        512, gt=0, description="Label tokens per chunk when computing log-probs from hidden states."
    )
    remove_padding: bool = Field(
        True,
        description="Forward passes (actor, reference) on packed sequences: no compute on pad "
        "tokens, attention kept within each sequence; same results as the padded forward.",
    )
    pack_row_tokens: int = Field(
        256,
        gt=0,
        description="remove_padding: tokens per packed row (a longer sequence gets its own "
        "row). Attention is computed over whole rows (block-diagonal mask), so its cost per "
        "token grows with this; one long row loses to padding on CPU. Rows as long as the "
        "longest sequence are used instead when they need fewer row positions.",
    )
    mixed_precision: Literal["none", "bf16"] = Field(
        "none",
        description="bf16: decoder layers and LM-head products of actor and reference compute "
        "in bfloat16 from float32 parameters (FSDP2 MixedPrecisionPolicy); norms, softmax, "
        "log-probs, value heads and the optimizer float32. "
        "Measured on an AVX-512 BF16 CPU, SmolLM2-135M actor update: 2.2-2.8x faster.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="Form micro-batches by this many valid tokens per rank (a longer sample "
        "goes alone) instead of micro_batch_size samples; null: by micro_batch_size.",
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig,  # type: ignore[arg-type]
        description="LoRA adapters (rank > 0): the rollout gets merged weights, the reference "
        "is the actor with its adapters disabled, final_model is merged with the adapter in "
        "final_model/adapter/.",
    )


class CriticConfig(Section):
    """The critic of PPO: a value model trained toward the returns, beside the actor."""

    enable: bool | None = Field(
        None,
        description="Build a critic: null = exactly when algorithm.adv_estimator reads values "
        "(gae); true/false must agree with the estimator.",
    )
    model_path: str | None = Field(
        None,
        description="Critic start model (causal LM or value-model folder); null = model.path.",
    )
    placement: Literal["colocated", "split"] = Field(
        "colocated",
        description="'colocated': on the actor's bundles, taking turns; 'split': its own pool.",
    )
    world_size: int | None = Field(
        None, gt=0, description="Critic ranks (FSDP2 shards); null = actor.world_size."
    )
    lr: float = Field(1e-5, gt=0, description="Critic AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Critic AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Critic gradient-norm clipping threshold.")
    cliprange_value: float = Field(
        0.5, gt=0, description="Value clipping: new values stay within ±this of the old ones."
    )
    ppo_epochs: int | None = Field(
        None, gt=0, description="Passes over each RL batch; null = actor.ppo_epochs."
    )
    ppo_mini_batch_size: int | None = Field(
        None,
        gt=0,
        description="Samples per critic optimizer step, all ranks; null = actor's.",
    )
    micro_batch_size: int | None = Field(
        None, gt=0, description="Samples per forward/backward per rank; null = actor's."
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Critic warm-up: for the first N RL steps only the critic trains, the "
        "actor is not updated (verl's critic_warmup).",
    )


class PrimeConfig(Section):
    """PRIME's implicit process reward model (``algorithm.adv_estimator=prime``): a causal LM
    trained online on the outcome labels, whose log-ratio to a frozen copy rewards each token."""

    model_path: str | None = Field(
        None, description="The PRM's start (a causal LM folder); null = model.path."
    )
    ref_path: str | None = Field(
        None, description="The PRM's frozen reference; null = its start (model_path)."
    )
    beta: float = Field(
        0.05, gt=0, description="r_t = beta (log pi_prm - log pi_ref) (verl's beta_train)."
    )
    loss: Literal["ce", "dpo"] = Field(
        "ce",
        description="'ce': BCE of sigmoid(beta sum_t q_t) against the outcome; 'dpo': "
        "-log sigmoid(beta (Q - Q_opp)) against the group's samples of the other outcome "
        "(verl's detached dpo loss; costs one more PRM forward a step).",
    )
    update: Literal["before", "after"] = Field(
        "before",
        description="'before': update the PRM on the batch, then reward it with the updated "
        "PRM (a second forward, verl's default); 'after': the rewards come from the update's "
        "own forward, before its optimizer step.",
    )
    norm: Literal["batch_norm", "none"] = Field(
        "batch_norm",
        description="'batch_norm': divide the token rewards by the largest |reward to go| of "
        "the batch (verl's prime_norm); 'none': beta q as is.",
    )
    reward_gt_coef: float = Field(
        5.0, ge=0, description="Weight of the outcome reward's RLOO advantage (verl's)."
    )
    reward_dpo_coef: float = Field(
        5.0, ge=0, description="Weight of the implicit rewards' RLOO advantage (verl's)."
    )
    lr: float = Field(1e-6, gt=0, description="PRM AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="PRM AdamW weight decay.")
    grad_clip: float = Field(10.0, gt=0, description="PRM gradient-norm clipping threshold.")
    mini_batch_size: int | None = Field(
        None,
        gt=0,
        description="Samples per PRM optimizer step, all ranks (one pass over the batch, in "
        "order); null = actor.ppo_mini_batch_size.",
    )
    micro_batch_size: int | None = Field(
        None, gt=0, description="Samples per PRM forward/backward per rank; null = actor's."
    )
    placement: Literal["colocated", "split"] = Field(
        "colocated",
        description="'colocated': on the actor's bundles, taking turns; 'split': its own pool.",
    )
    world_size: int | None = Field(
        None, gt=0, description="PRM ranks (FSDP2 shards); null = actor.world_size."
    )


LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab"]


def _default_loggers() -> list[LoggerName]:
    return ["console", "jsonl"]


class TrainerConfig(Section):
    backend: Literal["ray", "local"] = Field(
        "ray", description="'ray': worker groups as Ray actors; 'local': one rank in-process."
    )
    output_dir: Key = Field("runs/default", description="Run directory (metrics, checkpoints).")
    total_steps: int = Field(10, gt=0, description="RL (or SFT) steps after which the run ends.")
    epochs: int | None = Field(None, gt=0, description="SFT: train for this many epochs instead.")
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps (0: only at the end).")
    keep_checkpoints: int = Field(2, gt=0, description="Newest checkpoints kept on disk.")
    save_optimizer: bool = Field(
        True,
        description="Checkpoints hold the optimizer state (about twice the trained weights); "
        "false: they do not, and a resume starts the optimizer afresh (with a warning).",
    )
    eval_every: int = Field(0, ge=0, description="Evaluate held-out accuracy every N steps.")
    seed: int = Field(
        0, ge=0, lt=2**32, description="Seed of data order, sampling and initialisation."
    )
    resume: bool = Field(True, description="Resume from the newest complete checkpoint.")
    num_cpus: float | None = Field(
        None,
        gt=0,
        description="CPUs the run uses (default: all of this machine, or of the cluster).",
    )
    ray_address: str | None = Field(
        None,
        description="Join this running Ray cluster ('host:port', 'auto') instead of starting "
        "one; null: the RAY_ADDRESS environment variable if set, else a new local cluster.",
    )
    threads_per_rank: int | None = Field(
        None, gt=0, description="torch threads per rank (default: cores / ranks, at least 1)."
    )
    progress: bool = Field(
        True,
        description="On a terminal, show a progress bar (false: one plain line per step, as "
        "when the output is not a terminal).",
    )
    ray_dashboard: bool = Field(
        False, description="Start Ray's dashboard (on 127.0.0.1) with the local cluster."
    )
    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync",
        description="RL: 'sync' generates, then trains, step after step; 'one_step_off' "
        "generates step t+1's samples with the weights before step t's update while step t "
        "trains; 'async' lets the replicas generate without pause into a buffer the trainer "
        "takes batches from (bounded by the 'async' section). The last two need "
        "rollout.placement=split.",
    )
    loggers: list[LoggerName] = Field(
        default_factory=_default_loggers,
        description="Where metrics go: 'console' (progress bar on a terminal, one line per "
        "step otherwise), 'jsonl' (<output_dir>/metrics.jsonl and samples.jsonl, which "
        "`treadle report` reads), "
        "'tensorboard' (<output_dir>/tensorboard/), 'wandb' (<output_dir>/wandb/, offline "
        "unless WANDB_MODE or WANDB_API_KEY is set), 'mlflow' (sqlite:///<output_dir>/"
        "mlflow.db unless MLFLOW_TRACKING_URI is set), 'swanlab' (local, <output_dir>/"
        "swanlog/, unless SWANLAB_MODE is set).",
    )
    log_samples_every: int = Field(
        10,
        ge=0,
        description="RL: every N steps (and at the last) write trainer.log_samples prompts, "
        "responses, rewards and ground truths to <output_dir>/samples.jsonl and the trackers' "
        "tables (0: never).",
    )
    log_samples: int = Field(4, ge=1, description="Samples written each time they are due.")
    verbose: bool = Field(
        False,
        description="Show Ray's, vLLM's and torch's messages on the console; otherwise they go "
        "to <output_dir>/logs/.",
    )


class AsyncConfig(Section):
    """How rollout and training overlap when ``trainer.mode`` is ``one_step_off`` or ``async``."""

    max_staleness: int = Field(
        1,
        ge=0,
        description="async: a sample may be generated by weights at most this many versions "
        "older than the learner's; generation of a step's prompts starts only within the bound "
        "and samples that fall outside it by the time they are trained are dropped (counted in "
        "async/dropped). 0 is synchronous training.",
    )
    sync_every: int = Field(
        1, gt=0, description="async: push the actor's weights to the replicas every N updates."
    )
    partial_rollout: bool = Field(
        False,
        description="async: a weight sync does not wait for requests in flight: they pause, "
        "the new weights load, and they continue (each token keeps the version that made it). "
        "Without it a sync waits until the requests in flight have finished.",
    )
    buffer_groups: int | None = Field(
        None,
        gt=0,
        description="async: finished groups the buffer holds at most before generation waits "
        "(default: (max_staleness + 1) x data.batch_size).",
    )


class Config(Section):
    """A whole run: one YAML file, sections as below."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, allow_inf_nan=False
    )

    model: ModelConfig = Field(default_factory=ModelConfig)  # type: ignore[arg-type]
    data: DataConfig = Field(default_factory=DataConfig)  # type: ignore[arg-type]
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)  # type: ignore[arg-type]
    reward: RewardConfig = Field(default_factory=RewardConfig)  # type: ignore[arg-type]
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)  # type: ignore[arg-type]
    dpo: DPOConfig = Field(default_factory=DPOConfig)  # type: ignore[arg-type]
    kto: KTOConfig = Field(default_factory=KTOConfig)  # type: ignore[arg-type]
    actor: ActorConfig = Field(default_factory=ActorConfig)  # type: ignore[arg-type]
    critic: CriticConfig = Field(default_factory=CriticConfig)  # type: ignore[arg-type]
    prime: PrimeConfig = Field(default_factory=PrimeConfig)  # type: ignore[arg-type]
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)  # type: ignore[arg-type]
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _check_old_log_probs(self) -> Config:
        a = self.actor
        if (
            a.recompute_old_log_probs is False
            and self.model_copy(
                update={"actor": a.model_copy(update={"recompute_old_log_probs": None})}
            ).needs_old_log_prob_pass()
        ):
            raise ValueError(
                "actor.recompute_old_log_probs=false needs one optimizer step a batch without "
                "KL in the reward: set it to null (automatic), or actor.ppo_epochs=1, "
                "actor.ppo_mini_batch_size = data.batch_size x rollout.n and "
                "algorithm.kl_reward_coef=0"
            )
        return self

    def needs_old_log_prob_pass(self) -> bool:
        """Whether RL computes the old log-probs before the update (``actor.recompute_...``)."""
        a = self.actor
        needed = (
            a.ppo_epochs > 1
            or a.ppo_mini_batch_size < self.data.batch_size * self.rollout.n
            or self.algorithm.kl_reward_coef > 0
        )
        return needed if a.recompute_old_log_probs is None else a.recompute_old_log_probs

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Config:
        # Every broken rule is reported (one line each), not only the first.
        problems = list(self._rules())
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _rules(self) -> Iterator[str]:
        samples = self.data.batch_size * self.rollout.n
        ws = self.actor.world_size
        if self.trainer.backend == "local" and ws != 1:
            yield (
                f"trainer.backend=local runs one rank in-process; set actor.world_size=1 "
                f"(got {ws}) or use trainer.backend=ray"
            )
        if self.data.batch_size % ws:
            yield (
                f"data.batch_size={self.data.batch_size} must be divisible by "
                f"actor.world_size={ws} so every rank gets the same number of prompts"
            )
        if self.algorithm.filter_groups and self.rollout.n < 2:
            yield (
                "algorithm.filter_groups=true needs groups: set rollout.n to 2 or more "
                "(a group of one sample always has equal rewards)"
            )
        if self.reward.overlong_buffer_len >= self.rollout.max_new_tokens:
            yield (
                f"reward.overlong_buffer_len={self.reward.overlong_buffer_len} must be smaller "
                f"than rollout.max_new_tokens={self.rollout.max_new_tokens}"
            )
        mini = self.actor.ppo_mini_batch_size
        if samples % mini:
            yield (
                f"actor.ppo_mini_batch_size={mini} must divide data.batch_size x rollout.n "
                f"= {samples}"
            )
        if mini % ws:
            yield (f"actor.ppo_mini_batch_size={mini} must be divisible by actor.world_size={ws}")
        for section, what, mini_key in (
            ("critic", "critic", "ppo_mini_batch_size"),
            ("prime", "PRM", "mini_batch_size"),
        ):
            role = getattr(self, section)
            yield from _check_side_role(
                section,
                what,
                role.world_size,
                role.placement,
                mini_key,
                getattr(role, mini_key),
                self.actor,
                samples,
                self.trainer.backend,
            )
        yield from _check_rollout(self.rollout, self.actor, self.trainer)
        yield from _check_agents(self.rollout, self.data)
        yield from _check_mode(self)

    def response_length(self) -> int:
        """Tokens after the prompt a sample may have: ``rollout.max_new_tokens`` for one turn;
        for an agent loop ``rollout.max_response_length`` or its default."""
        r = self.rollout
        if r.agent_loop == "single_turn":
            return r.max_new_tokens
        if r.max_response_length is not None:
            return r.max_response_length
        return r.max_turns * (r.max_new_tokens + r.max_tool_response_tokens)

    def rollout_replicas(self) -> int:
        """How many rollout replicas the run has (``rollout.replicas`` resolved)."""
        r = self.rollout
        if r.replicas is not None:
            return r.replicas
        return self.actor.world_size if r.placement == "colocated" else 1


def _check_mode(cfg: Config) -> Iterator[str]:
    mode = cfg.trainer.mode
    if mode == "sync":
        return
    if cfg.rollout.placement != "split":
        yield (
            f"trainer.mode={mode} overlaps generation and training, which needs replicas of "
            "their own: set rollout.placement=split (and trainer.backend=ray), or "
            "trainer.mode=sync"
        )
    a = cfg.async_
    if mode == "async" and a.sync_every > a.max_staleness + 1:
        yield (
            f"async.sync_every={a.sync_every} lets the replicas fall more than "
            f"async.max_staleness={a.max_staleness} versions behind, so no sample could be "
            "trained: set sync_every to at most max_staleness + 1"
        )
    if mode == "async" and a.buffer_groups is not None and a.buffer_groups < cfg.data.batch_size:
        yield (
            f"async.buffer_groups={a.buffer_groups} cannot hold one batch of "
            f"data.batch_size={cfg.data.batch_size} groups: raise it or leave it unset"
        )


def _check_agents(rollout: RolloutConfig, data: DataConfig) -> Iterator[str]:
    if rollout.agent_loop == "single_turn" and rollout.tools:
        yield (
            "rollout.tools are called by an agent loop: set rollout.agent_loop=tools (or a "
            "loop of your own), or remove rollout.tools"
        )
    if rollout.agent_loop == "tools" and not rollout.tools:
        yield (
            "rollout.agent_loop=tools needs rollout.tools: list the tools as "
            "['module:function', ...] or ['path/to/file.py:function', ...]"
        )
    if rollout.tools and not data.apply_chat_template:
        yield (
            "rollout.tools are shown to the model through the chat template: set "
            "data.apply_chat_template=true"
        )


def _check_rollout(
    rollout: RolloutConfig, actor: ActorConfig, trainer: TrainerConfig
) -> Iterator[str]:
    if rollout.placement == "colocated":
        if rollout.replicas is not None and rollout.replicas != actor.world_size:
            yield (
                f"rollout.replicas={rollout.replicas} must equal actor.world_size="
                f"{actor.world_size} when rollout.placement=colocated (one replica in each "
                "actor rank's process); set rollout.placement=split or drop rollout.replicas"
            )
        if rollout.num_cpus is not None or rollout.ray_resources:
            yield (
                "rollout.num_cpus and rollout.ray_resources shape the rollout pool of "
                "rollout.placement=split; colocated replicas use the actor's bundles: drop "
                "them or set rollout.placement=split"
            )
        return
    if trainer.backend == "local":
        yield (
            "trainer.backend=local runs one rank in-process; set rollout.placement=colocated "
            "or use trainer.backend=ray"
        )
    cpus = trainer.num_cpus
    if cpus is not None and rollout.num_cpus is not None and rollout.num_cpus >= cpus:
        yield (
            f"rollout.num_cpus={rollout.num_cpus} leaves nothing of trainer.num_cpus={cpus} "
            "for the actor: give the rollout pool fewer CPUs or the run more"
        )


def _check_side_role(
    section: str,
    what: str,
    world_size: int | None,
    placement: str,
    mini_key: str,
    mini_batch_size: int | None,
    actor: ActorConfig,
    samples: int,
    backend: str,
) -> Iterator[str]:
    """The placement and batch rules of a role beside the actor (the critic, PRIME's PRM)."""
    ws = world_size or actor.world_size
    if placement == "colocated" and ws != actor.world_size:
        yield (
            f"{section}.world_size={ws} must equal actor.world_size={actor.world_size} when "
            f"{section}.placement=colocated (it shares the actor's bundles); set "
            f"{section}.placement=split or drop {section}.world_size"
        )
    if backend == "local" and placement == "split":
        yield (
            f"trainer.backend=local runs one rank in-process; set {section}.placement=colocated "
            "or use trainer.backend=ray"
        )
    mini = mini_batch_size or actor.ppo_mini_batch_size
    same_as_actor = mini_batch_size is None and ws == actor.world_size
    if not same_as_actor and (samples % mini or mini % ws):  # else the actor's rule says it
        yield (
            f"{section}.{mini_key}={mini} must divide data.batch_size x rollout.n = "
            f"{samples} and be divisible by the {what}'s world size {ws}"
        )


# ----------------------------------------------------------------------------- loading


def load_config(
    path: str | Path | Mapping[str, Any] | None, overrides: Sequence[str] = ()
) -> Config:
    """Read a YAML file (or take a mapping of sections, as the YAML would hold them), apply
    ``a.b=value`` overrides and validate everything.

    Raises one ConfigError whose message has a line per problem: a YAML syntax error or a
    duplicate key (file, line, column) stops at once; bad overrides, unknown keys and invalid
    values are all listed.
    """
    if isinstance(path, Mapping):
        raw: dict[str, Any] = copy.deepcopy(dict(path))
    else:
        raw = {} if path is None else _read_yaml(Path(path))
    problems: list[str] = []
    for item in overrides:
        try:
            _apply_override(raw, item)
        except ConfigError as e:
            problems.append(str(e))
    problems += _check_keys(raw, Config, prefix="")
    if problems:
        raise ConfigError("\n".join(problems))
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_describe_validation_error(e)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader whose mappings refuse a key given twice (PyYAML keeps the last silently)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: later keys override it
            continue
        key = loader.construct_object(key_node)  # type: ignore[no-untyped-call]
        line = key_node.start_mark.line + 1
        if isinstance(key, str) and key in seen:
            raise ConfigError(
                f"line {line}: key '{key}' is given twice (first on line {seen[key]}); "
                "YAML would keep only the last: remove one"
            )
        if isinstance(key, str):
            seen[key] = line
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _unique_mapping,  # type: ignore[arg-type]
)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = " ".join(str(x) for x in (e.context, e.problem) if x)
        raise ConfigError(f"{path}:{where}: YAML syntax error: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML error: {e}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return loaded or {}


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not key.strip() or not all(p.strip() for p in parts):
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    try:  # YAML parsing gives numbers, booleans, null and lists their types ("[a.jsonl]").
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(
            f"override {item!r}: the value is not valid YAML ({problem}); quote it"
        ) from None
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = parsed


def _check_keys(raw: dict[str, Any], model: type[BaseModel], prefix: str) -> list[str]:
    """Every unknown key (with the closest valid one) and every section that is no mapping."""
    fields = {f.alias or name: f for name, f in model.model_fields.items()}
    problems = []
    for key, value in raw.items():
        if key not in fields:
            valid = list(fields)
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            where = f"section '{prefix[:-1]}'" if prefix else "the config"
            problems.append(
                f"unknown key '{prefix}{key}' in {where}{hint} (valid: {', '.join(valid)})"
            )
            continue
        sub = fields[key].annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            if not isinstance(value, dict):
                problems.append(f"'{prefix}{key}' is a section: give it a mapping of keys")
                continue
            problems += _check_keys(value, sub, prefix=f"{prefix}{key}.")
    return problems


def _describe_validation_error(e: ValidationError) -> str:
    """One line per invalid value: the key, what is wrong, the value given."""
    lines = []
    for err in e.errors():
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])[1:]
        if err["type"] == "value_error" and (not key or isinstance(err.get("input"), dict)):
            # a cross-field rule (of the config or a section): its message names the keys
            lines += str(err["msg"]).removeprefix("Value error, ").splitlines()
            continue
        msg = str(err["msg"]).removeprefix("Value error, ")
        given = repr(err.get("input"))
        given = given if len(given) <= 60 else given[:57] + "..."
        lines.append(f"{key}: {msg[:1].lower()}{msg[1:]} (got {given})")
    return "\n".join(lines)


def dump_config(config: Config, path: str | Path) -> None:
    """Write the fully resolved config as YAML (every field, defaults included)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = config.model_dump(mode="json", by_alias=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
