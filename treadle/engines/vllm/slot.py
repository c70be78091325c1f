"""The process's one vLLM engine: started once, checked at start, kept in a slot, reused.

:func:`engine_for` answers every construction of a
:class:`~treadle.engines.vllm.engine.VLLMRolloutEngine`: the first starts the engine
(:func:`_start`), the next ones get the same engine with its model folder's weights reloaded.
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
  function are restored after start, and so are transformers' classes that vLLM decorates
  for torch.compile where it runs a model with transformers' code (OLMo, SmolLM3, GPT-NeoX,
  ...: :func:`_transformers_classes_kept`). Not undone: when no torch.distributed group exists,
  vLLM creates the default one (world size 1, gloo) and keeps it; in a Ray actor the rank's
  group exists first and vLLM works beside it.
- **Checked at start.** vLLM's CPU attention supports head sizes 32, 64, 80, ...; a model with
  another (the 16 of a 64-wide, 4-head toy) fails in the first forward pass deep inside
  vLLM, so it is refused at start with a `ConfigError` instead.
- **Prefix caching on CPU, 32-token blocks.** vLLM caches whole KV blocks of prompts, and its
  CPU default block is 128 tokens, which an RL prompt of tens of tokens never fills: each of
  a prompt's `n` samples computed its prefill. With 32-token blocks (the smallest vLLM's CPU
  attention takes) the samples of a prompt share its full blocks within a call
  (`bench/vllm_sweep.py`: SmolLM2, 32 prompts of 39 tokens x 4 samples, ~2.6x less prefill).
- **What it starts with.** ``logprobs_mode="processed_logprobs"`` (what that gives:
  :mod:`.engine`), treadle's worker extension (:mod:`.worker`), eager mode on CPU (compiling
  costs minutes there and gains little) and sleep mode enabled on CUDA.

Errors: if vLLM cannot be imported or the engine does not start, `ConfigError` says why (the
first line of the original error) and that `rollout.engine=hf` works without vLLM.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from treadle.engines.inference import Finished
from treadle.engines.vllm.pictures import PictureLayout
from treadle.engines.vllm.worker import TreadleWorkerExtension
from treadle.runtime.errors import ConfigError

logger = logging.getLogger("treadle")

_EXTENSION_CLS = f"{TreadleWorkerExtension.__module__}.{TreadleWorkerExtension.__qualname__}"
# KV-cache block size on CPU, unless `block_size` is given (see "Prefix caching on CPU").
CPU_BLOCK_SIZE = 32
_FALLBACK_HINT = "rollout.engine=hf works without vLLM"
_NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"  # Ray leaves every GPU of a node visible


@dataclass(frozen=True)
class EngineSettings:
    """What an engine was started with; a second construction must ask for the same."""

    model_path: str
    dtype: str
    seed: int
    max_model_len: int
    kv_cache_gib: float
    gpu_memory_utilization: float
    extra: tuple[tuple[str, Any], ...] = ()


@dataclass
class LiveEngine:
    """The process's engine and what every handle on it shares."""

    settings: EngineSettings
    llm: Any  # vllm.LLM
    tied_embeddings: bool
    start_seconds: float
    # each request carries its own sampling seed (CUDA's V2 runner: "Seeding" in .engine)
    seeds_requests: bool = False
    asleep: bool = False
    weights_ok: bool = True  # False after a weight update that failed part-way
    pictures: PictureLayout | None = None  # a vision-language model's, on its first picture
    warned: set[str] = field(default_factory=set)
    # request id -> its tokens and log-probs so far (step() returns deltas)
    so_far: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    # requests that finished while `score` stepped the engine: the next step() returns them
    stash: list[Finished] = field(default_factory=list)


_LIVE: LiveEngine | None = None


def engine_running() -> bool:
    """Whether this process's engine has started (it lives until the process ends)."""
    return _LIVE is not None


def engine_for(settings: EngineSettings) -> LiveEngine:
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
    reload_folder(handle)
    return handle


def reload_folder(live: LiveEngine) -> None:
    """Load the engine's model folder's weights again (what it started with)."""
    with awake(live):
        live.weights_ok = False
        live.llm.collective_rpc("treadle_reload_from_disk")
        forget_old_outputs(live)
        live.weights_ok = True


def put_to_sleep(live: LiveEngine) -> None:
    """Free the engine's weights and KV cache (vLLM's sleep level 1; CUDA only)."""
    if not live.asleep:
        live.llm.sleep(level=1)
        live.asleep = True


def wake_up(live: LiveEngine) -> None:
    """Undo :func:`put_to_sleep`."""
    if live.asleep:
        live.llm.wake_up()
        live.asleep = False


@contextlib.contextmanager
def awake(live: LiveEngine) -> Iterator[None]:
    """The engine awake inside, for a weight reload: asleep (CUDA, level 1) its weights are
    not mapped in device memory, so a reload would write to memory it released. A sleeping
    engine goes back to sleep after a reload that succeeded."""
    asleep = live.asleep
    wake_up(live)
    yield
    if asleep:
        put_to_sleep(live)


def forget_old_outputs(live: LiveEngine) -> None:
    """Drop what vLLM computed with the old weights: cached KV blocks and the vision tower's
    outputs (the scheduler's record of them too, or it would skip the encoder for a picture it
    thinks cached)."""
    live.llm.reset_prefix_cache()
    live.llm.llm_engine.reset_encoder_cache()


def _describe(s: EngineSettings) -> str:
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


def _start(settings: EngineSettings) -> LiveEngine:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine lives in this process
    start = time.perf_counter()
    with _heap_frozen(), _preserve_host_state(), _transformers_classes_kept():
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
        elif os.environ.get(_NOSET, "").lower() in ("1", "true"):
            raise ConfigError(
                f"rollout.engine=vllm does not run under {_NOSET}: vLLM puts its engine on "
                "GPU 0 of every process that sees all of its node's GPUs (whichever GPU Ray "
                f"gave it); unset {_NOSET}, or use rollout.engine=hf"
            )
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
    return LiveEngine(settings, llm, tied, seconds, seeds_requests=takes_request_seeds(llm, cuda))


def takes_request_seeds(llm: Any, cuda: bool) -> bool:
    """Whether ``llm``'s requests carry seeds of their own ("Seeding" in :mod:`.engine`): on
    CUDA under vLLM's V2 model runner (they cost nothing there), not under V1 (it samples
    seeded rows one by one) nor on CPU (they crash it)."""
    return cuda and bool(getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", False))


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
def _heap_frozen() -> Iterator[None]:
    """Start vLLM with this process's objects out of the garbage collector's way.

    While it starts, vLLM runs five full collections (two in its loader, three before its
    engine core, here in this process, freezes the heap: vLLM 0.32 ``freeze_gc_heap``), each
    through every object of the process: torch's, transformers', the actor's model. Collected
    once and frozen here first, they scan only what vLLM makes: the tiny model's start 6.62 ->
    5.69 s in this process (medians of 6, a 2-core CPU), the tests' vLLM runs under Ray, whose
    actors hold their models, ~4 s a start (docs/findings.md, "Start-up"). The heap ends frozen as
    vLLM leaves it anyway; a start that fails thaws it, unless it was frozen before."""
    thawed = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()
    try:
        yield
    except BaseException:
        if thawed:
            gc.unfreeze()
        raise


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
def _transformers_classes_kept() -> Iterator[None]:
    """Keep transformers' model classes as they are while vLLM starts in this process.

    A model vLLM has no code of its own for (OLMo, OLMo 2, SmolLM3, GPT-NeoX, Phi, StarCoder2,
    ...) runs on transformers' code ("transformers backend"), and vLLM decorates its decoder
    class for torch.compile (``support_torch_compile``: a new ``__init__``, ``__call__`` and
    base class) in place, for the whole process. The actor's model in this process is of that
    class: it failed its first forward pass (``'Olmo2Model' object has no attribute
    'do_not_compile'``). Here the decoration is watched as vLLM makes it; then vLLM's own
    instances of the class get a subclass that holds it, and the class is put back as it was.
    """
    try:
        from vllm.model_executor.models.transformers import base
    except Exception:  # (no transformers backend, or no vLLM: `_start` says so, as a ConfigError)
        yield
        return
    decorate = base.support_torch_compile
    made: list[tuple[type, dict[str, Any], tuple[type, ...], Any, list[Any]]] = []

    def watched(*args: Any, **kwargs: Any) -> Any:
        wrap = decorate(**kwargs)

        def apply(cls: type) -> type:
            before, bases, instances = dict(vars(cls)), cls.__bases__, []
            wrap(cls)
            if cls.__bases__ != bases:  # (a class decorated already is left as it is)
                init = vars(cls)["__init__"]

                def recorded(self: Any, *a: Any, **k: Any) -> None:
                    init(self, *a, **k)
                    instances.append(self)

                cls.__init__ = recorded  # type: ignore[misc]
                made.append((cls, before, bases, init, instances))
            return cls

        return apply(args[0]) if args else apply

    base.support_torch_compile = watched
    try:
        yield
    finally:
        base.support_torch_compile = decorate
        for cls, before, bases, init, instances in made:
            _give_back(cls, before, bases, init, instances)


def _give_back(
    cls: type, before: dict[str, Any], bases: tuple[type, ...], init: Any, instances: list[Any]
) -> None:
    """``cls`` as it was (``before``, ``bases``); its decorated ``instances`` in a subclass
    holding the decoration (``init``: the decorated ``__init__``)."""
    changed = {k: v for k, v in vars(cls).items() if before.get(k, _ABSENT) is not v}
    changed["__init__"] = init
    added = tuple(b for b in cls.__bases__ if b not in bases)
    cls.__bases__ = bases
    for name in changed:
        if name in before:
            setattr(cls, name, before[name])
        elif name in vars(cls):
            delattr(cls, name)
    own = {**changed, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    decorated = type(cls.__name__, (cls, *added), own)
    for instance in instances:
        instance.__class__ = decorated


_ABSENT = object()


class _DropMessages(logging.Filter):
    def __init__(self, endings: tuple[str, ...]) -> None:
        super().__init__()
        self.endings = endings

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().endswith(self.endings)


def _quiet_benign_reload_warnings() -> None:
    """Drop two warnings every reload gives: a rotary embedding (a cache, no weights; its
    class's name ends so: ``YaRNScalingRotaryEmbedding``...) and a tied LM head (its weight
    is the embedding's, re-tied after) get no weights of their own. An untied head left
    unloaded is caught by the check in `update_weights`; another layer, by the worker's
    (`_kept_old_weights`)."""
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _DropMessages) for f in layerwise.filters):
        layerwise.addFilter(
            _DropMessages(
                (
                    "RotaryEmbedding: Failed to load weights",
                    "ParallelLMHead: Failed to load weights",
                )
            )
        )
