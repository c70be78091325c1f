"""Model folders without loading them: where a model or tokenizer is, its config.json, its
vocabulary, its tokenizer. Nothing here imports torch (the tokenizer's load imports
transformers on first call), so ``treadle check`` and config-time code can use it;
:mod:`treadle.models.loading` loads and saves the models themselves.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.runtime.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ADAPTER_DIR = "adapter"  # a LoRA checkpoint's adapters (treadle.models.loading.save_adapter)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_HUB_ID_RE = re.compile(r"^[\w.-]+/[\w.-]+$")


def lora_head_refused(name: str) -> str:
    """Why ``actor.lora.target_modules`` may not name the output head ``name`` (after the key)."""
    return (
        f"'{name}' is the output head, whose log-probs treadle computes from its weight in "
        "chunks, so an adapter on it would never train (and a head tied to the input embedding "
        "has no weight of its own to merge it into): leave it out, as 'all-linear' does"
    )


def _hub_id(path: str | Path, key: str, allow_download: bool) -> str:
    """``path``, which is no local folder, as a hub id to download; ConfigError if it is none
    or downloads are off."""
    if not _HUB_ID_RE.match(str(path)):
        raise ConfigError(f"{key}: '{path}' does not exist (expected a model folder)")
    if not allow_download:
        raise ConfigError(
            f"{key}: '{path}' is not a local folder; treadle does not download models "
            "unless model.allow_download=true (then it is fetched from the Hugging Face hub)"
        )
    return str(path)


def resolve_model_path(
    path: str | Path,
    *,
    key: str = "model.path",
    need: str = "model",
    allow_download: bool = False,
) -> str:
    """Check that `path` is a model folder holding what `need` ("model" or "tokenizer") requires.

    A treadle checkpoint directory (`checkpoints/step_N`) stands for its `model/` folder.
    A path that does not exist locally is an error; with `allow_download` (`model.allow_download`)
    one that looks like a hub id (`org/name`) is passed through, for transformers to fetch.
    Raises ConfigError naming `key` and the folder otherwise.
    """
    if not str(path).strip():  # `reward.model_path=` on a command line: not this directory
        raise ConfigError(f"{key} is empty: give a model folder, or leave {key} out")
    folder = Path(path).expanduser()
    if not folder.exists():
        return _hub_id(path, key, allow_download)
    if not folder.is_dir():
        raise ConfigError(f"{key}: '{folder}' is a file, not a model folder")
    if not (folder / "config.json").is_file() and (folder / "model" / "config.json").is_file():
        folder = folder / "model"  # a treadle checkpoint directory: its model folder
    _not_adapters_only(folder, key)
    if need == "tokenizer":
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise ConfigError(
                f"{key}: '{folder}' is not a model folder: no tokenizer "
                f"(none of {', '.join(TOKENIZER_FILES)})"
            )
    elif not (folder / "config.json").is_file():
        raise ConfigError(f"{key}: '{folder}' is not a model folder: no config.json")
    elif not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ConfigError(f"{key}: '{folder}' is not a model folder: no *.safetensors weights")
    return str(folder)


def model_config(path: str, key: str, allow_download: bool) -> dict[str, Any]:
    """The folder's config.json; empty for a hub id (checked when transformers fetches it)."""
    file = Path(resolve_model_path(path, key=key, allow_download=allow_download)) / "config.json"
    config: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
    return config


def is_vision_language(path: str | Path) -> bool:
    """Whether the model folder at ``path`` is a vision-language model (its config.json has a
    ``vision_config``): loaded as ``AutoModelForImageTextToText``, with an image processor."""
    file = Path(path) / "config.json"
    return file.is_file() and "vision_config" in json.loads(file.read_text(encoding="utf-8"))


def vocab_size(config: dict[str, Any]) -> int | None:
    """The vocabulary size a model's config.json gives (a multimodal one's text model's)."""
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return int(size) if size is not None else None


def layer_count_problem(config: dict[str, Any]) -> str | None:
    """What transformers refuses with a traceback (a ``StrictDataclassClassValidationError``):
    ``num_hidden_layers`` that is not the length of ``layer_types`` (in a multimodal config,
    of its ``text_config``); None when they agree or one is not given."""
    for prefix, part in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(part, dict):
            continue
        types, layers = part.get("layer_types"), part.get("num_hidden_layers")
        if isinstance(types, list) and isinstance(layers, int) and len(types) != layers:
            return (
                f"has {prefix}num_hidden_layers={layers} but {prefix}layer_types lists "
                f"{len(types)} layers: make them agree (one type per layer)"
            )
    return None


def check_config_file(folder: str | Path, key: str) -> None:
    """ConfigError naming ``key`` and the file when the folder's config.json has keys that
    contradict each other (:func:`layer_count_problem`); nothing for a folder without one."""
    file = Path(folder) / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none (a hub id), or not JSON: said where it is read
        return
    problem = layer_count_problem(config) if isinstance(config, dict) else None
    if problem is not None:
        raise ConfigError(f"{key}: '{file}' {problem}")


def shared_vocabulary(
    actor: str | None, paths: list[tuple[str, str]], allow_download: bool
) -> dict[str, dict[str, Any]]:
    """The config.json of each model ``(key, path)`` that scores the actor's token ids,
    checked to have the vocabulary size of the actor at ``actor`` (unknown sizes pass)."""
    actor_vocab = vocab_size(model_config(actor, "model.path", allow_download)) if actor else None
    configs = {}
    for key, path in paths:
        configs[key] = config = model_config(path, key, allow_download)
        vocab = vocab_size(config)
        if vocab and actor_vocab and vocab != actor_vocab:
            raise ConfigError(
                f"{key}: '{path}' has a vocabulary of {vocab} tokens, the actor "
                f"(model.path) {actor_vocab}; it scores the actor's token ids, so it must use "
                "the actor's tokenizer"
            )
    return configs


def _not_adapters_only(folder: Path, key: str) -> None:
    if not (folder / "config.json").is_file() and (folder / ADAPTER_DIR).is_dir():
        raise ConfigError(
            f"{key}: '{folder}' is a LoRA checkpoint (adapters only, no model/): use the run's "
            "final_model (merged), or load its adapter/ onto the base model with peft"
        )


WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")  # file suffixes
_LOADED: dict[tuple[Any, ...], PreTrainedTokenizerBase] = {}  # load_tokenizer's, by its files


TEMPLATE_KWARGS = "treadle_template_kwargs"  # the tokenizer's attribute: see load_tokenizer
_NOT_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def load_tokenizer(
    path: str | Path,
    *,
    key: str = "model.path",
    allow_download: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> PreTrainedTokenizerBase:
    """The tokenizer of the model folder (or, with `allow_download`, hub id) at `path`.

    A process loads a folder's tokenizer once while the folder's files stay as they were (its
    files other than weights, by name, size and modification time): a run's driver asks for it
    at the check, for the prompts, the held-out prompts and the rollout (SmolLM2's takes ~0.3 s
    each). The object is shared: callers read it and never change its settings.

    ``template_kwargs`` (``data.chat_template_kwargs``): variables every rendering of its chat
    template gets (``treadle.data.templating.render``), held by the tokenizer object; each
    must be one the template reads."""
    resolved = resolve_model_path(path, key=key, need="tokenizer", allow_download=allow_download)
    folder = Path(resolved)
    extra = dict(template_kwargs or {})
    memo: tuple[Any, ...] | None = None  # None: a hub id, not remembered
    if folder.is_dir():
        stats = [(f.name, f.stat()) for f in sorted(folder.iterdir()) if f.is_file()]
        files = [(n, st.st_size, st.st_mtime_ns) for n, st in stats if not n.endswith(WEIGHTS)]
        memo = (str(folder.resolve()), json.dumps(extra, sort_keys=True, default=str), *files)
        if memo in _LOADED:
            return _LOADED[memo]
    from treadle.models.hf_facts import tokenizer_class

    # the class AutoTokenizer would pick, without importing it (which imports torch)
    found = tokenizer_class(resolved)
    if found is None:  # (a hub id, a folder the facts do not know)
        from transformers import AutoTokenizer

        found = AutoTokenizer
    try:
        tokenizer = found.from_pretrained(resolved)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: cannot load a tokenizer from '{path}': {e}") from e
    if extra:
        _check_template_kwargs(tokenizer, extra, path)
        setattr(tokenizer, TEMPLATE_KWARGS, extra)
    if memo is not None:
        if len(_LOADED) >= 4:  # a process uses one or two: keep the newest few
            del _LOADED[next(iter(_LOADED))]
        _LOADED[memo] = tokenizer
    return tokenizer


def template_key(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The tokenizer's chat template as one string, for the caches of what it renders: the
    template, or its named templates (Hermes 2's and Command R's ``default`` and
    ``tool_use``) as JSON; None without one."""
    template = tokenizer.chat_template
    if not template:
        return None
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


def _check_template_kwargs(
    tokenizer: PreTrainedTokenizerBase, extra: dict[str, Any], path: str | Path
) -> None:
    """A ConfigError for a variable the chat template never reads (it would change nothing)."""
    text = template_key(tokenizer) or ""
    for name in extra:
        where = f"data.chat_template_kwargs.{name}"
        if name in _NOT_TEMPLATE_KWARGS:
            raise ConfigError(f"{where}: '{name}' is set by treadle itself; remove it")
        if not re.search(rf"\b{re.escape(name)}\b", text):
            raise ConfigError(
                f"{where}: the chat template of '{path}' never reads '{name}', so it would "
                "change nothing; remove it, or give the template that reads it"
            )


# Layer types (transformers' ``config.layer_types``) whose state runs along the sequence: a
# convolution, a recurrence or a linear attention (Mamba, Gated DeltaNet...). In a packed row
# a sequence would see the ones before it (Qwen3-Next: states off by 0.06, 0.23 with shared
# prompts), and a sequence-parallel rank its piece of the sequence alone.
ROW_STATE_LAYERS = frozenset({"conv", "linear_attention", "hybrid", "hybrid_sliding", "mamba"})
# Such models by type, for a config that does not list its layer types (a ``config.json``, a
# ``to_dict()``: Jamba's and Mamba's are properties, Qwen3-Next's files may give an interval).
ROW_STATE_MODELS = frozenset(
    {
        *("rwkv", "xlstm", "recurrent_gemma", "mamba", "mamba2", "falcon_mamba", "falcon_h1"),
        *("jamba", "bamba", "zamba", "zamba2", "nemotron_h", "granitemoehybrid", "minimax"),
        *("lfm2", "lfm2_moe", "lfm2_vl", "kimi_linear", "olmo_hybrid", "qwen3_next", "zaya"),
        *("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp"),
        *("qwen4_exp_text", "inkling_text"),
    }
)


def row_state_layers(config: Any) -> str | None:
    """The first layer type of the decoder of ``config`` (a transformers config, or its
    ``config.json`` as a dict) that carries a state along the sequence (`ROW_STATE_LAYERS`),
    or, where it lists none, its model type (`ROW_STATE_MODELS`); ``None`` for a decoder whose
    tokens meet through attention alone, which packed rows and sequence parallel keep exact."""
    types, model_type = _decoder_kinds(config)
    found = [t for t in types if t in ROW_STATE_LAYERS]
    if found:
        return found[0]
    if types:  # the layer types say: attention alone
        return None
    return model_type if model_type in ROW_STATE_MODELS else None


def _decoder_kinds(config: Any) -> tuple[list[str], str | None]:
    """The layer types and model type of the decoder of ``config`` (a config or a dict)."""
    if isinstance(config, dict):
        text = config.get("text_config") or config
        types, model_type = text.get("layer_types"), text.get("model_type")
    else:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        types, model_type = getattr(text, "layer_types", None), getattr(text, "model_type", None)
    return [str(t) for t in types or ()], (str(model_type) if model_type else None)


# Decoders whose attention mask ignores the packed sequences that position ids mark: their
# forward builds one causal mask over the whole row (gpt-oss, Falcon, OPT...) or has no
# positions at all (ALiBi: BLOOM, MPT). Measured with transformers 5.19: a row's second
# sequence off by 0.004-0.7 against it alone (tests/engines/test_packing.py keeps the list).
UNPACKED_MODELS = frozenset(
    {"gpt_oss", "afmoe", "falcon", "bloom", "mpt", "opt", "biogpt", "openai-gpt", "xglm", "cpmant"}
)


def packing_problem(config: Any) -> str | None:
    """Why packed rows would not keep each sequence of a decoder of ``config`` (a
    transformers config or its dict) to itself, in words; ``None`` where they do."""
    state = row_state_layers(config)
    if state is not None:
        return f"its {state!r} layers carry a state along the sequence"
    model_type = _decoder_kinds(config)[1]
    if model_type in UNPACKED_MODELS:
        return f"its attention mask ({model_type}) ignores where packed sequences begin"
    return None
