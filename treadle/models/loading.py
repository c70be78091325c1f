"""Loading and saving Hugging Face model folders, with errors that name the config key.

A model in treadle is an ordinary HF folder (config.json, safetensors weights, tokenizer files,
chat template), local or a hub id. The workers load it through these helpers so a wrong path
fails at start-up with `model.path: '<folder>' is not a model folder: no config.json` rather
than a stack trace from deep inside transformers. Weights are written as safetensors only.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from treadle.models.folders import (  # the folder helpers (no torch), for callers of both
    ADAPTER_DIR,
    PROCESSOR_FILES,
    TOKENIZER_FILES,  # noqa: F401
    check_config_file,
    is_vision_language,
    load_tokenizer,  # noqa: F401
    lora_head_refused,
    model_config,  # noqa: F401
    resolve_model_path,
    shared_vocabulary,  # noqa: F401
    vocab_size,  # noqa: F401
)
from treadle.runtime.errors import ConfigError

if TYPE_CHECKING:  # transformers' model classes: imported where a model is loaded or saved
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase


def _model_folder(
    path: str | Path, dtype: torch.dtype | str, key: str, allow_download: bool
) -> tuple[str, torch.dtype]:
    """The model folder (or hub id) ``path`` resolves to, and ``dtype`` as a torch dtype."""
    resolved = resolve_model_path(path, key=key, need="model", allow_download=allow_download)
    check_config_file(resolved, key)  # (transformers' own refusal is a traceback)
    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype):
        raise ConfigError(f"{key}: '{dtype}' is not a torch dtype")
    return resolved, torch_dtype


def _from_pretrained(
    auto: Any, resolved: str, dtype: torch.dtype, failed: str, **kwargs: Any
) -> tuple[Any, dict[str, Any]]:
    """``auto.from_pretrained`` of the folder ``resolved`` and its loading info (for
    :func:`_check_weights_match`: weights of another shape are loaded as mismatched, not
    raised); a folder that does not load is a ``ConfigError`` that begins with ``failed``."""
    try:
        loaded: Any = auto.from_pretrained(
            resolved,
            dtype=dtype,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
            **kwargs,
        )
    except (OSError, ValueError) as e:
        raise ConfigError(f"{failed}: {e}") from e
    model, info = loaded
    if "attn_implementation" not in kwargs and soft_caps_attention(model.config):
        model.set_attn_implementation("eager")  # (see soft_caps_attention)
    return model, info


def soft_caps_attention(config: Any) -> bool:
    """Whether a model of ``config`` soft-caps its attention scores (Gemma 2's
    ``attn_logit_softcapping``, 50). transformers' sdpa attention, which it loads such a model
    with by default, drops the soft-cap (so does its paged attention); its eager attention
    applies it, as vLLM does. So treadle switches such a model to eager attention once loaded:
    its forwards (the actor's, the hf engine's) are then the model's own."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "attn_logit_softcapping", None) is not None


def load_causal_lm(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    *,
    key: str = "model.path",
    allow_download: bool = False,
    **kwargs: Any,
) -> PreTrainedModel:
    """The causal LM of the model folder (or hub id) at `path`, on CPU in `dtype`.

    `dtype` is a torch dtype or its name (`"bfloat16"`); extra kwargs go to `from_pretrained`
    (for example `attn_implementation`), except the two loading-info ones this function sets
    itself. Moving to a device is the caller's business. Weights that do not match config.json
    are a `ConfigError` (`_check_weights_match`).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    taken = sorted({"output_loading_info", "ignore_mismatched_sizes"} & kwargs.keys())
    if taken:
        raise TypeError(f"load_causal_lm sets {', '.join(taken)} itself; do not pass it")
    resolved, torch_dtype = _model_folder(path, dtype, key, allow_download)
    auto = AutoModelForImageTextToText if is_vision_language(resolved) else AutoModelForCausalLM
    failed = f"{key}: cannot load a causal LM from '{path}'"
    model, info = _from_pretrained(auto, resolved, torch_dtype, failed, **kwargs)
    _check_weights_match(info, model, resolved, key)
    return model


def load_value_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    *,
    key: str = "model.path",
    allow_download: bool = False,
) -> PreTrainedModel:
    """A value model (critic or reward model) from the folder at `path`, on CPU in `dtype`.

    A value model is the ``*ForTokenClassification`` model of the folder's architecture with
    one label: its decoder plus a linear ``score`` head, one number per position (as verl's
    critic). For a family transformers has none of (Gemma 3, OLMo 2, Qwen3.5, Granite,
    Cohere...), one is made as transformers makes its own (:func:`_token_classification`).
    From a causal LM folder the head is new and starts at zero, so a fresh critic predicts 0
    everywhere; from a value-model folder (saved by treadle) it is loaded. Decoder weights
    that do not match config.json are a `ConfigError`, as in `load_causal_lm`.
    """
    resolved, torch_dtype = _model_folder(path, dtype, key, allow_download)
    failed = f"{key}: cannot load a value model from '{path}'"
    value_class = _token_classification(resolved, failed)
    model, info = _from_pretrained(value_class, resolved, torch_dtype, failed, num_labels=1)
    # From a causal LM folder the new score head is missing and the LM's own head (lm_head)
    # is left over: both are expected; anything else of the decoder is a damaged folder.
    prefix = f"{model.base_model_prefix}."
    _check_weights_match(
        {
            **info,
            "missing_keys": {k for k in info["missing_keys"] if not k.startswith("score.")},
            "unexpected_keys": {k for k in info["unexpected_keys"] if k.startswith(prefix)},
        },
        model,
        resolved,
        key,
    )
    model.config.architectures = [type(model).__name__]  # saved folders load as value models
    if any(k.startswith("score.") for k in info["missing_keys"]):
        with torch.no_grad():
            for p in model.score.parameters():
                p.zero_()
    return model


def _token_classification(folder: str, failed: str) -> Any:
    """The class a value model of ``folder``'s family loads with (:func:`value_class`)."""
    from transformers import AutoConfig

    try:
        config_class = type(AutoConfig.from_pretrained(folder))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{failed}: {e}") from e
    made = value_class(config_class)
    if made is None:
        raise ConfigError(f"{failed}: transformers has no causal LM of {config_class.__name__}")
    return made


def value_class(config_class: type) -> Any:
    """transformers' ``AutoModelForTokenClassification`` where it knows the family of
    ``config_class``; else a ``<Family>ForTokenClassification`` made as transformers makes its
    own, its ``GenericForTokenClassification`` over the family's pretrained-model class (the
    decoder as ``model``, a linear ``score``), so a causal LM's folder and a value model saved
    from it both load (their architectures name it; a reward model's rule reads the suffix).
    ``None`` for a family without a causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if config_class in AutoModelForTokenClassification._model_mapping:
        return AutoModelForTokenClassification
    if config_class not in AutoModelForCausalLM._model_mapping:
        return None
    causal: Any = AutoModelForCausalLM._model_mapping[config_class]
    pretrained = next(b for b in causal.__mro__[1:] if b.__name__.endswith("PreTrainedModel"))
    name = pretrained.__name__.removesuffix("PreTrainedModel") + "ForTokenClassification"
    return _made_class(name, pretrained, config_class)


@functools.cache
def _made_class(name: str, pretrained: type, config_class: type) -> type:
    """One class per family and process (a saved model's class, compared by identity), of
    ``config_class`` (Qwen3.5's pretrained-model class is its vision-language model's)."""
    from transformers.modeling_layers import GenericForTokenClassification

    # the decoder where the family's checkpoints hold it (GPT-J's "transformer"...)
    prefix = pretrained.base_model_prefix or "model"  # type: ignore[attr-defined]
    own = {"__module__": __name__, "config_class": config_class, "base_model_prefix": prefix}
    return type(name, (GenericForTokenClassification, pretrained), own)


def _check_weights_match(
    info: Mapping[str, Any], model: PreTrainedModel, folder: str, key: str
) -> None:
    """Refuse a folder whose weights do not fit the model its config.json describes.

    transformers would start a missing tensor at random and drop a tensor the architecture
    has no place for, both with no more than a log table, and the run would train the damaged
    model; a shape mismatch (loaded with ``ignore_mismatched_sizes=True`` so that it lands in
    ``info`` rather than as a bare RuntimeError) is the same mistake. ``info`` is the loading
    info of ``from_pretrained``, in which transformers has already left out what is benign (a
    tied ``lm_head.weight``, old rotary buffers, the model's own ignore patterns).
    """
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    mismatched = sorted(info["mismatched_keys"], key=lambda m: m[0])
    problems: list[str] = []
    if missing:
        problems.append(f"{_first(missing)} {'is' if len(missing) == 1 else 'are'} missing")
    if unexpected:
        problems.append(
            f"{_first(unexpected)} {'is' if len(unexpected) == 1 else 'are'} not used by "
            f"config.json's architecture ({type(model).__name__}{_layer_hint(unexpected, model)})"
        )
    if mismatched:
        shapes = [
            f"{k} is {_dims(got)} in the file but {_dims(want)} by config.json"
            for k, got, want in mismatched
        ]
        problems.append(_first(shapes))
    problems += [" ".join(str(m).split()) for m in info.get("error_msgs") or []]
    if problems:
        raise ConfigError(
            f"{key}: the weights in '{folder}' do not match its config.json: "
            f"{'; '.join(problems)}: fix config.json or save the model again"
        )


def _first(items: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``items``, and how many more there are."""
    more = f" (and {len(items) - shown} more)" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def _dims(shape: tuple[int, ...]) -> str:
    """``128x384``: a shape without the commas that separate tensors in a message."""
    return "x".join(map(str, shape))


def _layer_hint(unexpected: list[str], model: PreTrainedModel) -> str:
    """``; the weights have 4 layers, config.json says num_hidden_layers=2`` where the unused
    tensors are of layers past config.json's count (the usual cause), else ``""``."""
    declared = getattr(model.config, "num_hidden_layers", None)  # a text model's own count
    layer = re.compile(r"\.layers\.(\d+)\.")
    extra = [int(m.group(1)) for k in unexpected if (m := layer.search(k))]
    if not isinstance(declared, int) or not extra or min(extra) < declared:
        return ""
    return (
        f"; the weights have {max(extra) + 1} layers, config.json says num_hidden_layers={declared}"
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> None:
    """`tokenizer.save_pretrained(out_dir)`, written so older transformers (vLLM's) read it too.

    A vision-language model's processor files (``PROCESSOR_FILES``) in the folder the tokenizer
    was loaded from are copied beside it, so a saved checkpoint loads its processor too.

    transformers 5 names a plain tokenizers-backed tokenizer `TokenizersBackend` and lists extra
    special tokens as `extra_special_tokens`; both names are unknown to transformers 4, which
    reads the same file as `PreTrainedTokenizerFast` with `additional_special_tokens`.
    """
    out = Path(out_dir)
    tokenizer.save_pretrained(out)
    source = Path(str(getattr(tokenizer, "name_or_path", "")))
    for name in PROCESSOR_FILES:  # a vision-language model's processor goes with its tokenizer
        if (source / name).is_file() and source.resolve() != out.resolve():
            shutil.copyfile(source / name, out / name)
    config_path = out / "tokenizer_config.json"
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def save_hf_folder(
    state_dict: Mapping[str, torch.Tensor],
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    out_dir: str | Path,
) -> Path:
    """Write a full (gathered) state dict as an HF model folder: safetensors, config, tokenizer.

    A config whose architecture is a ``*ForTokenClassification`` gives a value-model folder.
    The weights go through a model built from `config` and `save_pretrained`, so the folder
    holds exactly what transformers writes itself (tied embeddings stored once, the generation
    config). The model is built on the meta device and takes the given tensors without a copy.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    value_model = any(a.endswith("ForTokenClassification") for a in config.architectures or [])
    auto: Any = value_class(type(config)) if value_model else AutoModelForCausalLM
    if hasattr(config, "vision_config") and not value_model:
        auto = AutoModelForImageTextToText
    with torch.device("meta"):
        model = auto.from_config(config) if hasattr(auto, "from_config") else auto(config)
    result = model.load_state_dict(dict(state_dict), strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"state dict has keys the model lacks: {result.unexpected_keys[:5]}")
    model.tie_weights()
    still_empty = [name for name, p in model.named_parameters() if p.is_meta]
    if still_empty:
        raise ValueError(f"state dict is missing parameters: {still_empty[:5]}")
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out


def has_weight_conversions(model: Any) -> bool:
    """Whether ``model``'s parameters are named or laid out otherwise than its files."""
    return bool(_weight_conversions(model))


def _weight_conversions(model: Any) -> list[Any]:
    """The conversions between ``model``'s checkpoint files and its parameters that
    ``save_pretrained`` reverses (transformers 5's `revert_weight_conversion`): none for a
    dense LM; for a mixture of experts, its experts fused into one tensor a layer. A
    ``PrefixChange`` alone (a model built, not loaded) changes nothing a save writes."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers 4: parameters are named and laid out as in the files
        return []
    found = getattr(model, "_weight_conversions", None)  # what from_pretrained applied
    if found is None:
        found = get_model_conversion_mapping(model, add_legacy=False)
        found = [c for c in found if not isinstance(c, PrefixChange)]
    return list(found)


def _layer_of(name: str) -> str:
    """The decoder layer (``model.layers.3``) a tensor belongs to, or else its module."""
    parts = name.split(".")
    index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return ".".join(parts[: index + 1] if index is not None else parts[:-1])


def checkpoint_format(
    model: Any, named: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named``, ``model``'s own ``(name, tensor)`` pairs, as ``save_pretrained`` writes them:
    what an engine that loads the model's files (vLLM) is sent in a weight update.

    transformers 5 holds some weights otherwise than its files do: a mixture of experts'
    experts fused into two 3-D tensors a layer (``mlp.experts.gate_up_proj``, where the files
    hold ``mlp.experts.<i>.gate_proj.weight`` and ``up_proj``), Mixtral's ``block_sparse_moe``
    renamed ``mlp``. The pairs go through transformers' own reversal a layer at a time (a
    layer's tensors are consecutive in a state dict, and no conversion spans two layers), so
    one layer's full tensors are held at most. A model without conversions (Llama, Qwen2 and
    the other dense LMs) passes its pairs through untouched."""
    if not has_weight_conversions(model):
        yield from named
        return
    from transformers.core_model_loading import revert_weight_conversion

    group: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        if group and _layer_of(name) != _layer_of(next(iter(group))):
            yield from revert_weight_conversion(model, group).items()
            group = {}
        group[name] = tensor
    if group:
        yield from revert_weight_conversion(model, group).items()


def count_parameters(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters, tied ones counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# ----------------------------------------------------------------------------- LoRA

"""A LoRA checkpoint's (and ``final_model``'s) peft adapter folder: adapter_config.json,
adapter_model.safetensors, the tokenizer; loadable with ``PeftModel.from_pretrained``."""


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (``q_proj``, ``down_proj``...)."""
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    return sorted(names)


def _moved_onto_experts(model: torch.nn.Module, names: list[str]) -> set[str]:
    """The ``names`` peft moves onto a transformers 5 mixture of experts' fused experts (3-D
    parameters, ``target_parameters``), as it does with the names of a transformers 4 model's
    expert layers (``gate_proj``, ``up_proj``, ``down_proj`` on Qwen3-MoE, also those of its
    dense layers): peft's own 'all-linear' moves them all. Adapters there `merged_lora` cannot
    merge for the rollout."""
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a peft before transformers 5 moves nothing
        return set()
    trial = LoraConfig(target_modules=list(names), task_type="CAUSAL_LM")
    convert_peft_config_for_transformers(trial, model=model, conversions=None)
    if not trial.target_parameters:
        return set()
    return set(names) - set(trial.target_modules or ())


def _lora_modules(model: torch.nn.Module, targets: str | list[str]) -> str | list[str]:
    """``actor.lora.target_modules`` as peft is to get them, checked against ``model`` (a
    ConfigError naming the key): listed names must be its linear layers, not its output head.
    On a mixture of experts, names peft would move onto its fused experts are refused, and
    'all-linear' becomes the list of its other linear layers."""
    head = cast(Any, model).get_output_embeddings()
    head_name = next((n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is head), "")
    known = [n for n in linear_module_names(model) if n != head_name]
    if not isinstance(targets, str):
        if head_name in targets:
            raise ConfigError(f"actor.lora.target_modules: {lora_head_refused(head_name)}")
        unknown = [t for t in targets if t not in known]
        if unknown:
            raise ConfigError(
                f"actor.lora.target_modules: {', '.join(map(repr, unknown))} is not a linear "
                f"layer of the model (its linear layers: {', '.join(known)}; or 'all-linear')"
            )
    elif targets != "all-linear":
        raise ConfigError(
            f"actor.lora.target_modules: '{targets}' is neither 'all-linear' nor a list of "
            "module names"
        )
    modules = targets if isinstance(targets, str) else list(targets)
    if has_weight_conversions(model):  # a mixture of experts: peft may target its experts
        experts = _moved_onto_experts(model, known)
        if modules == "all-linear":  # its linear layers by name, less those
            modules = [name for name in known if name not in experts]
        elif moved := sorted(experts.intersection(modules)):
            raise ConfigError(
                f"actor.lora.target_modules: {', '.join(map(repr, moved))}: on this mixture of "
                "experts peft puts such adapters on its fused experts, which treadle cannot "
                "merge into the rollout's weights: leave it out (its other linear layers: "
                f"{', '.join(n for n in known if n not in experts)}), or use 'all-linear'"
            )
    return modules


def apply_lora(model: torch.nn.Module, lora: Any, base_path: str | Path, seed: int = 0) -> Any:
    """``model`` with peft LoRA adapters as ``lora`` (an ``actor.lora`` section) says.

    Only the adapters require gradients. A listed target module must be the last name of
    one of the model's linear layers other than the output head (checked here, naming the
    key). The adapter records ``base_path`` (absolute) as its base model, so an exported
    adapter loads with ``PeftModel.from_pretrained`` on it. The adapters' random start (A; B is
    0) is drawn from ``seed``, whatever the global RNG went through before, which it leaves as
    it was.
    """
    from peft import LoraConfig, get_peft_model

    modules = _lora_modules(model, lora.target_modules)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=modules,
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    if getattr(peft_model.peft_config["default"], "fan_in_fan_out", False):  # GPT-2 Conv1D
        raise ConfigError(
            "actor.lora: this model's layers store weights transposed (Conv1D, as GPT-2), "
            "which treadle's merged weight sync does not handle; use full fine-tuning "
            "(actor.lora.rank=0)"
        )
    resolved = Path(base_path).expanduser()
    peft_model.peft_config["default"].base_model_name_or_path = (
        str(resolved.resolve()) if resolved.exists() else str(base_path)
    )
    return peft_model


def save_adapter(
    state: Mapping[str, torch.Tensor],
    peft_config: Any,
    tokenizer: PreTrainedTokenizerBase | None,
    out_dir: str | Path,
) -> Path:
    """Write adapter weights (peft's saved names, ``...lora_A.weight``) as a peft folder."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"))
    peft_config.save_pretrained(str(out))
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out


def export_merged(adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """The adapter merged into its base model, as an HF folder at ``out_dir`` (in the base
    model's dtype), with the adapter folder itself copied to ``out_dir/adapter``."""
    import shutil

    from peft import PeftConfig, PeftModel
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    adapter = Path(adapter_dir)
    base = PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path
    dtype = getattr(AutoConfig.from_pretrained(base), "dtype", None) or torch.float32
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no loading/writing bars at the end of a run
    try:
        model = load_causal_lm(base, dtype, key=f"{adapter}/adapter_config.json base model")
        merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        out = Path(out_dir)
        merged.save_pretrained(out, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    shutil.copytree(adapter, out / ADAPTER_DIR)
    for name in adapter.iterdir():
        if name.name not in ("adapter_model.safetensors", "adapter_config.json", "README.md"):
            shutil.copy2(name, out / name.name)  # the tokenizer files
    return out
