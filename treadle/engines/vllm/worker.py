"""The worker side of a weight update: :class:`TreadleWorkerExtension`, mixed into vLLM's worker.

vLLM builds its worker class with this one mixed in (``worker_extension_cls``, named by
:mod:`.slot`); the handle calls its methods through ``LLM.collective_rpc``
(:meth:`~treadle.engines.vllm.engine.VLLMRolloutEngine.load_payloads`). Choices:

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
  bucket into it, and closes it; parameters the stream did not cover are an error, and so
  are those the reload kept as they were though the stream had them (`_kept_old_weights`).
- **A mixture of experts on CPU.** vLLM's CPU experts repack their weights after the first
  load only; the reload is made to repack them too (`_prepack_cpu_experts_on_reload`).
- **Tied embeddings.** With `tie_word_embeddings` the LM head shares the embedding's weight,
  but on CPU it computes with its own repacked copy, made when the model was loaded; a reload
  that fills the embedding leaves the head computing with the old weights. After the reload
  the head is re-tied to the embedding and its post-load processing re-run. `lm_head.weight`
  is not sent for a tied model (it is the embedding).
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load as load_safetensors_bytes

from treadle.runtime.errors import ConfigError


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
        model = self.model_runner.get_model()
        _prepack_cpu_experts_on_reload(model)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)

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
        tied = bool(getattr(self.model_config.hf_text_config, "tie_word_embeddings", False))
        # (those the stream did not name are reported below, as unset)
        kept = [name for name in _kept_old_weights(model, tied) if name in self._treadle_loaded]
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            finalize_layerwise_reload(model, self.model_config)
            if tied:
                _retie_lm_head(model)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()
        if kept:
            raise ConfigError(
                f"rollout.engine=vllm: vLLM kept the old weights of {len(kept)} parameters "
                f"through a weight update (e.g. {kept[:2]}): its loader for "
                f"{self.model_config.architectures[0]} copies them itself, past the in-place "
                "reload, so the rollout would sample from stale weights; rollout.engine=hf "
                "trains this model"
            )
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


def _kept_old_weights(model: torch.nn.Module, tied: bool) -> list[str]:
    """Parameters of the layers an open reload got nothing for, which closing it puts back
    as they were (vLLM's warning "<layer>: Failed to load weights"). Where the stream had
    them, the model's loader copied them itself, to the reload's placeholders on the meta
    device, where they are lost (vLLM 0.32's gpt-oss: its experts and attention sinks). Not
    counted: layers with buffers only (rotary embeddings) and a tied LM head."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    kept: list[str] = []
    for prefix, layer in model.named_modules():
        info = get_layerwise_info(layer)
        if not info.can_load() or info.load_numel > 0 or info.kernel_tensors is None:
            continue
        if tied and prefix.endswith("lm_head"):
            continue
        kept += [f"{prefix}.{name}" for name in info.kernel_tensors[0]]
    return kept


def _prepack_cpu_experts_on_reload(model: torch.nn.Module) -> None:
    """Make a reload repack a mixture of experts' weights on CPU, as the first load does.

    vLLM 0.32's CPU experts (`CPUUnquantizedExperts`) prepack ``w13_weight`` and ``w2_weight``
    for their kernel in ``process_weights_after_loading``, which
    ``UnquantizedFusedMoEMethod._setup_kernel`` calls on the first load only. On a reload (a
    weight update) it copies the new weights in unpacked, and the kernel reads them as packed:
    a Qwen3-MoE's log-probs were off by up to 0.03 after a sync of the very weights it held.
    So each such layer's processing is followed by the experts' own, once per layer (later
    calls find it wrapped). CUDA's experts keep the checkpoint layout and are left alone."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without them
        return
    for layer in model.modules():
        method: Any = getattr(layer, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or "treadle_prepack" in vars(method):
            continue
        process = method.process_weights_after_loading

        def process_and_prepack(
            layer: torch.nn.Module, process: Any = process, method: Any = method
        ) -> None:
            process(layer)  # the fresh layer's weights, in the checkpoint's layout
            # packed (by the kernel the processing left), then copied into place
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process_and_prepack
        method.treadle_prepack = True


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
