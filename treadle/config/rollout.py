"""``rollout``: the inference engine, sampling, replicas and agent loops."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from treadle.config.base import (
    Key,
    Placement,
    Section,
    defaults,
    gpu_memory_field,
    kv_cache_field,
)
from treadle.config.endpoint import EndpointConfig


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = Field("hf", description="Inference engine for generation.")
    dtype: Literal["float32", "bfloat16", "auto"] | None = Field(
        None,
        description="Weight dtype of the rollout engine (null: model.dtype; auto: bfloat16 where "
        "it is native, as actor.mixed_precision=auto, else model.dtype). bfloat16 generates "
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
    micro_batch_size: int = Field(
        64,
        gt=0,
        description="hf engine: sequences per generate call at most (on CUDA fewer when "
        "gpu_memory_utilization leaves room for fewer).",
    )
    cache_implementation: Literal["dynamic", "static", "paged"] = Field(
        "dynamic",
        description="hf engine: generate's KV cache. static preallocates it (the prompt width "
        "rounded up to 64, plus max_new_tokens); on a GPU transformers then compiles the "
        "decoding step (torch.compile, CUDA graphs), again for a new batch size or cache length. "
        "paged: transformers' continuous batching on a paged cache (fast with flash-attn "
        "installed; without it its attention spans every sequence in flight); text prompts "
        "only, attention layers only (not Qwen3.5's linear attention nor LFM2's convolutions), "
        "and with top_k/top_p its log-probs are of the truncated distribution (as vLLM's).",
    )
    weight_sync_bucket_mb: float = Field(
        64, gt=0, description="vllm engine: size of one weight-sync message, MiB."
    )
    kv_cache_gib: float = kv_cache_field()
    gpu_memory_utilization: float = gpu_memory_field(0.5)
    placement: Placement = Field(
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
        600.0,
        gt=0,
        description="A request not answered within this many seconds stops the run (split "
        "replicas: restarts its replica, see max_restarts).",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Split rollout (and teacher) replicas that die or do not answer within "
        "request_timeout_s are restarted, at most this many times in a run, with the current "
        "weights; their requests are sent again. 0: the first such failure stops the run. A "
        "colocated replica or a dead training rank always stops it.",
    )
    endpoint: EndpointConfig = Field(
        default_factory=defaults(EndpointConfig),
        description="The OpenAI-compatible endpoint (agents written against the OpenAI API, "
        "`treadle serve`).",
    )
    tool_parser: Key = Field(
        "hermes",
        description="The parser of tool calls in the model's text, for the endpoint and the "
        "tools loop: hermes (<tool_call> blocks; treadle's own, no vLLM needed) or another of "
        "vLLM's registered names (llama3_json, mistral, qwen3_xml, ...; `treadle check` lists "
        "them).",
    )
    reasoning_parser: str | None = Field(
        None,
        min_length=1,
        description="The endpoint's parser of reasoning (`reasoning_content`), by vLLM's "
        "registered name (deepseek_r1, qwen3, ...); null: the text is all content.",
    )
    agent_loop: Key = Field(
        "single_turn",
        description="How a sample is generated: single_turn (one response), tools (multi-turn "
        "with rollout.tools, calls parsed by rollout.tool_parser), env (episodes of the text "
        "environment rollout.env), a custom async loop given as 'module:function' or "
        "'path/to/file.py:function', or a black-box agent written against the OpenAI API as "
        "'openai:module:function' or 'openai:path/to/file.py:function'.",
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

    agent_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A custom or black-box agent's run (all its turns) taking longer fails: it "
        "is dropped and counted in agent/errors.",
    )
    max_agent_error_frac: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Agent runs that fail (raise, time out, return junk) are dropped with a "
        "warning; more than this fraction of a batch's runs failing stops the run.",
    )
    env: str | None = Field(
        None,
        min_length=1,
        description="agent_loop=env: the environment factory, 'module:make_env' or "
        "'path/to/file.py:make_env', called with the data row; it returns an object with "
        "gymnasium's reset()/step(action) and text observations (its first observation is the "
        "prompt, within data.max_prompt_length; the sum of its rewards the reward; later "
        "observations are cut to max_tool_response_tokens).",
    )

    @field_validator("top_k")
    @classmethod
    def _top_k_on_or_off(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return value
