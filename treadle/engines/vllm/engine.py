""":class:`VLLMRolloutEngine`: the handle on the process's vLLM engine that the rollout calls.

Batch ``generate`` (the synchronous case), the request queue the rollout server steps
(``add_request``, ``step``, ``abort``), ``score`` (the teacher's), weight updates and sleep,
over the one engine of the process (:mod:`.slot`). Choices:

- **Seeding.** On CPU vLLM's sampler (its V1 model runner) draws its noise from the global
  torch RNG (one draw per batch row and step) unless a request carries its own `seed`.
  Per-request seeds crash vLLM 0.32 on CPU as soon as a seeded request's prefill is split over
  two steps (chunked prefill, e.g. 128 prompts of 40 tokens against the 4,096-token step
  budget): it rewinds the request's generator with `set_offset`, which CPU generators lack. So
  on CPU `generate` runs with the torch RNG forked and seeded with `params.seed`. On CUDA vLLM
  0.32 runs its V2 model runner (the default wherever Triton is), which hashes each request's
  noise from the request's seed and the token's position, and draws a seed from numpy's
  global RNG for a request without one (`v1/worker/gpu/sample/states.py`): in the model
  runner's process, which is vLLM's worker process when `rollout.tensor_parallel_size > 1`.
  So under V2 every request carries a seed of its own: `generate` draws one per prompt from
  the RNG seeded with `params.seed` (vLLM gives a prompt's `n` samples `seed + index`), and
  :meth:`~VLLMRolloutEngine.add_request` one from the global torch RNG, which the rollout
  server seeds (:mod:`treadle.serving.server`). Either way a rollout is reproducible from
  `params.seed` (same prompts, same engine), and the caller's random streams do not move.
  Where CUDA runs the V1 runner (`VLLM_USE_V2_MODEL_RUNNER=0`, a feature V2 lacks) requests
  carry no seed, as on CPU (V1 samples seeded requests one by one): it draws from the torch
  RNG as on CPU, seeded here, which its worker processes under tensor parallelism are not. On
  CPU the draws follow the engine's steps, which depend on what the
  prefix cache holds (a cached prefix is not prefilled again), so `generate` starts from an
  empty prefix cache, as every rollout after a weight update does anyway.
- **Log-probs of the policy that trains.** `logprobs_mode="processed_logprobs"` returns
  `log_softmax(logits / T)` of each sampled token (`log_softmax(logits)` when greedy), as
  `HFRolloutEngine` does. With top-p < 1 or top-k > 0 vLLM renormalises over the kept tokens
  before taking the log-softmax, so there the values are of the truncated distribution and
  differ from `HFRolloutEngine`'s (logged once).
- **Weight updates in buckets.** ``update_weights`` packs the named tensors into buckets of
  ~``bucket_mb`` (:func:`~treadle.engines.weights.weight_buckets`), one held at a time, and
  loads them as one in-place reload (why one: :mod:`.worker`); a tied model's
  ``lm_head.weight`` is not sent. A failed or partial update leaves the engine refusing to
  generate until a full one succeeds.
- **Pictures** (a vision-language model's ``pixel_values``) go to vLLM with the prompt's ids
  exactly as treadle's processor made them, as processed input
  (:mod:`treadle.engines.vllm.pictures`); vLLM's vision tower computes their features. A
  weight update covers the vision tower and connector like any layer and clears vLLM's
  encoder cache (vision features computed with the old weights) with its prefix cache.
- **Sleep mode** (free the weights and KV cache while training runs) is used on CUDA (level 1;
  a weight update while asleep wakes the engine for the copy and puts it back to sleep).
  vLLM does not support it on CPU: `sleep`/`wake` are no-ops there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from treadle.engines.inference import (
    Finished,
    RolloutOutput,
    SamplingParams,
    Scored,
    check_one_sample,
    check_score_args,
)
from treadle.engines.vllm.outputs import score_in_queue, stop_reason, take_output
from treadle.engines.vllm.pictures import PictureLayout, picture_prompt
from treadle.engines.vllm.slot import (
    EngineSettings,
    awake,
    engine_for,
    forget_old_outputs,
    put_to_sleep,
    reload_folder,
    wake_up,
)
from treadle.engines.weights import weight_buckets
from treadle.models.loading import resolve_model_path
from treadle.runtime.errors import ConfigError

logger = logging.getLogger("treadle")


class VLLMRolloutEngine:
    """Rollouts with vLLM in this process; one engine per process, shared by every handle.

    `dtype` is the engine's weight dtype ("float32" or "bfloat16"); `seed` is vLLM's engine
    seed (sampling seeds come from `SamplingParams.seed`); `max_model_len` bounds prompt plus
    response tokens; `bucket_mb` is the size of one weight-sync message; `kv_cache_gib` sizes
    the KV cache on CPU (`VLLM_CPU_KVCACHE_SPACE`, if set, wins); `gpu_memory_utilization` is
    the fraction of GPU memory vLLM may take on CUDA; responses stop at `end_of_turn` too (the
    chat template's; vLLM stops at the EOS and the generation config's itself). Extra keyword
    arguments go to `vllm.LLM` (for example `max_num_seqs`)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int,
        bucket_mb: float = 64,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        allow_download: bool = False,
        end_of_turn: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        path = resolve_model_path(model_path, key="model.path", allow_download=allow_download)
        if bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be positive, got {bucket_mb}")
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ConfigError(f"rollout dtype: '{dtype}' is not a torch dtype")
        settings = EngineSettings(
            model_path=str(Path(path).resolve()) if Path(path).is_dir() else path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            kv_cache_gib=kv_cache_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            extra=tuple(sorted(engine_kwargs.items())),
        )
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.dtype = torch_dtype
        self.turn_stops = [end_of_turn] if end_of_turn is not None else []
        self._live = engine_for(settings)

    @property
    def llm(self) -> Any:
        """The `vllm.LLM` behind this handle (shared by every handle in the process)."""
        return self._live.llm

    @property
    def start_seconds(self) -> float:
        """How long starting the process's engine took (the same for every handle)."""
        return self._live.start_seconds

    # ------------------------------------------------------------------ generate

    def _check_weights(self) -> None:
        if not self._live.weights_ok:
            raise RuntimeError(
                "the vLLM engine's weights are incomplete: the last weight update failed or did "
                "not cover every parameter; call update_weights again with the full state"
            )

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        pixel_values: torch.Tensor | None = None,
        json_schema: str | None = None,  # the response follows it: vLLM's structured output
    ) -> None:
        """Queue one request (one sample); `step` runs it with everything else in flight.
        ``pixel_values`` ``[images, 3, H, W]``: a vision-language prompt's pictures, their image
        tokens already in ``prompt`` (given to vLLM as they are:
        :mod:`treadle.engines.vllm.pictures`)."""
        from vllm.inputs import TokensPrompt

        check_one_sample(params)
        self._check_weights()
        self._warn_truncated_logprobs(params)
        from vllm.sampling_params import RequestOutputKind

        seed = _request_seeds(1)[0] if self._live.seeds_requests else None  # see "Seeding"
        request_params = _held_to(self._request_params(params, seed), json_schema)
        request_params.output_kind = RequestOutputKind.DELTA  # each step: the new tokens only
        if pixel_values is None:
            engine_prompt = TokensPrompt(prompt_token_ids=list(prompt))
        else:
            engine_prompt = picture_prompt(list(prompt), pixel_values, self._picture_layout())
        self.llm.llm_engine.add_request(request_id, engine_prompt, request_params)
        self._live.so_far[request_id] = ([], [])

    def _picture_layout(self) -> PictureLayout:
        live = self._live
        if live.pictures is None:
            live.pictures = PictureLayout.of(live.llm.llm_engine.model_config.hf_config)
        return live.pictures

    def step(self) -> list[Finished]:
        """One engine step over every request in flight; the requests it finished (and those
        that finished while :meth:`score` stepped the engine)."""
        live = self._live
        done, live.stash = live.stash, []
        if live.so_far:
            for result in live.llm.llm_engine.step():
                take_output(live, result, done)
        return done

    def abort(self, request_id: str) -> tuple[list[int], list[float]]:
        """Abort a request in flight; the tokens and log-probs it had."""
        live = self._live
        kept = next((f for f in live.stash if f.request_id == request_id), None)
        if kept is not None:  # it finished during a score: take it back
            live.stash.remove(kept)
            return kept.token_ids, kept.log_probs
        self.llm.llm_engine.abort_request([request_id])
        return live.so_far.pop(request_id, ([], []))

    def score(self, sequences: list[list[int]], starts: list[int], top_k: int) -> list[Scored]:
        """The log-probs of each sequence's tokens from ``start`` on and the ``top_k`` most
        likely ids there (prompt log-probs: see :mod:`.outputs`), safe with generation
        requests in flight."""
        check_score_args(sequences, starts, top_k)
        self._check_weights()
        return score_in_queue(self._live, sequences, starts, top_k)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        self._check_weights()
        out = RolloutOutput()
        if not prompts:
            return out
        self._warn_truncated_logprobs(params)
        from vllm.inputs import TokensPrompt

        # vLLM refuses n > 1 when greedy: sample once and repeat (the samples are equal).
        copies = params.n if params.temperature == 0 else 1
        request = dataclasses.replace(params, n=params.n // copies)
        self.llm.reset_prefix_cache()  # reproducible steps: see "Seeding" in the module doc
        with _seeded_rng(params.seed):
            each = (  # one seed a prompt under CUDA's V2 runner: see "Seeding"
                [self._request_params(request, s) for s in _request_seeds(len(prompts))]
                if self._live.seeds_requests
                else self._request_params(request)
            )
            results = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], each, use_tqdm=False
            )
        for result in results:
            for sample in sorted(result.outputs, key=lambda c: c.index):
                tokens = list(sample.token_ids)
                logps = [step[t].logprob for step, t in zip(sample.logprobs, tokens, strict=True)]
                reason = stop_reason(sample.finish_reason)
                for _ in range(copies):
                    out.token_ids.append(list(tokens))
                    out.log_probs.append(list(logps))
                    out.stop_reasons.append(reason)
        return out

    def _request_params(self, params: SamplingParams, seed: int | None = None) -> Any:
        """vLLM's sampling parameters of a request (``seed``: its own, under V2 on CUDA)."""
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(**self._sampling_kwargs(params), seed=seed)

    def _sampling_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """Keyword arguments of `vllm.SamplingParams` but the seed (a subclass may add some)."""
        return {
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else 0,
            "max_tokens": params.max_new_tokens,
            "stop_token_ids": [
                *params.stop_token_ids,
                *([] if params.ignore_eos else self.turn_stops),
            ],
            "ignore_eos": params.ignore_eos,
            "logprobs": 0,  # the sampled token's log-prob only
            "detokenize": False,
        }

    def _warn_truncated_logprobs(self, params: SamplingParams) -> None:
        truncated = params.temperature > 0 and (params.top_p < 1 or params.top_k > 0)
        if truncated and "logprobs" not in self._live.warned:
            self._live.warned.add("logprobs")
            logger.warning(
                "vLLM rollout with top_p=%s, top_k=%s: its log-probs are of the truncated, "
                "renormalised distribution, not of log_softmax(logits / T) as the actor "
                "computes them; expect a larger rollout/train log-prob mismatch",
                params.top_p,
                params.top_k,
            )

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream `(HF name, full tensor)` pairs into the live engine, one bucket at a time."""
        skip = frozenset({"lm_head.weight"} if self._live.tied_embeddings else ())
        self.load_payloads(weight_buckets(named_tensors, self.bucket_bytes, self.dtype, skip))

    @torch.no_grad()
    def load_payloads(self, payloads: Iterable[bytes]) -> None:
        """Load safetensors buckets (`weight_buckets`) into the live engine as one reload."""
        live = self._live
        with awake(live):  # on CUDA the weights' memory is released while asleep
            live.llm.collective_rpc("treadle_begin_weight_update")
            live.weights_ok = False
            missing: list[str] = []
            try:
                for payload in payloads:  # a tied model's lm_head.weight must not be in them
                    live.llm.collective_rpc("treadle_load_weight_bucket", args=(payload,))
            finally:
                # Closing the reload puts back the layers the stream never reached; after an
                # error, half-loaded layers stay wrong, so weights_ok stays False.
                missing = live.llm.collective_rpc("treadle_finish_weight_update")[0]
            forget_old_outputs(live)
            if missing:
                raise ValueError(
                    f"update_weights: the stream left {len(missing)} vLLM parameters unset "
                    f"(e.g. {missing[:3]}); pass the model's full state"
                )
            live.weights_ok = True

    def reload_from_folder(self) -> None:
        """Load the weights of the engine's model folder again (what it started with)."""
        reload_folder(self._live)

    # ------------------------------------------------------------------ sleep

    def sleep(self) -> None:
        """Free weights and KV cache (CUDA, sleep level 1); a no-op on CPU."""
        if not torch.cuda.is_available():
            self._log_no_sleep()
            return
        put_to_sleep(self._live)

    def wake(self) -> None:
        """Undo :meth:`sleep`."""
        if not torch.cuda.is_available():
            self._log_no_sleep()
            return
        wake_up(self._live)

    def _log_no_sleep(self) -> None:
        if "sleep" not in self._live.warned:
            self._live.warned.add("sleep")
            logger.info("vLLM sleep mode is not supported on CPU: sleep()/wake() are skipped")


@contextlib.contextmanager
def _seeded_rng(seed: int) -> Iterator[None]:
    """The global torch RNG (CPU and CUDA) seeded with `seed` inside, the caller's stream
    untouched outside (what vLLM samples from: see "Seeding")."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _request_seeds(count: int) -> list[int]:
    """``count`` requests' own sampling seeds, drawn from the global torch RNG (below 2**62:
    vLLM gives a request's ``n`` samples ``seed + index``, an int64)."""
    return torch.randint(0, 1 << 62, (count,)).tolist()


def _held_to(request_params: Any, json_schema: str | None) -> Any:
    """vLLM's ``request_params`` with structured output to ``json_schema`` (None: as given)."""
    if json_schema is not None:
        from vllm.sampling_params import StructuredOutputsParams

        request_params.structured_outputs = StructuredOutputsParams(json=json_schema)
    return request_params
