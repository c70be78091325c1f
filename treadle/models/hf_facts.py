"""What treadle needs to know of transformers before a run, without importing the parts of it
that import torch (~3.5 s of a first ``treadle check`` on a 2-core machine): the class a model
folder's tokenizer loads with (``AutoTokenizer``'s import pulls in torch through the auto model
classes; the class itself, transformers' own import included, in ~2 s), and the model types
it knows (its config classes import torch).

``hf_facts.json`` beside this module (``make facts`` writes it) holds, for the transformers
version it was written with, the class ``AutoTokenizer`` picks for each of a set of
(``tokenizer_class`` in tokenizer_config.json, ``model_type`` in config.json) pairs, the
folder-name patterns for which it picks the generic backend instead, and the model types of
``CONFIG_MAPPING``. A local folder whose pair is there, with no ``auto_map`` (remote code) and a
name no pattern matches, loads with that class; anything else, or another transformers
version, goes through ``AutoTokenizer``. A test holds the file to transformers itself (a
folder made for each pair).
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

FACTS_FILE = Path(__file__).with_name("hf_facts.json")

# The pairs the facts hold a class for: treadle's own folders (`treadle prepare`'s Qwen2-shaped
# model, SmolLM2 from `treadle model fetch`) and common shapes of local chat models. Not
# Mistral's: AutoTokenizer's pick there depends on the folder's files (tekken.json).
PAIRS = (
    ("Qwen2Tokenizer", "qwen2"),
    ("Qwen2TokenizerFast", "qwen2"),
    ("Qwen2Tokenizer", "qwen3"),
    ("Qwen2TokenizerFast", "qwen3"),
    ("Qwen2Tokenizer", "llama"),
    ("PreTrainedTokenizerFast", "qwen2"),
    ("PreTrainedTokenizerFast", "llama"),
    ("GPT2Tokenizer", "llama"),
    ("GPT2TokenizerFast", "llama"),
    ("GPT2Tokenizer", "gpt2"),
    ("GPT2TokenizerFast", "gpt2"),
    ("TokenizersBackend", "qwen2"),
    ("TokenizersBackend", "llama"),
)

_FACTS: dict[str, Any] = {}


def tokenizer_class(folder: str | Path) -> type[Any] | None:
    """The class ``AutoTokenizer`` would load the local ``folder``'s tokenizer with, when the
    facts know it; None otherwise (the caller then asks ``AutoTokenizer``)."""
    facts = _facts()
    if not facts:
        return None
    path = Path(folder)
    tokenizer_config, config = _json(path / "tokenizer_config.json"), _json(path / "config.json")
    if tokenizer_config is None or config is None or "auto_map" in {*tokenizer_config, *config}:
        return None
    name = str(folder).lower()  # (AutoTokenizer matches the path it was given, lower-cased)
    if any(fnmatch.fnmatch(name, pattern) for pattern in facts["backend_patterns"]):
        return None
    pair = f"{tokenizer_config.get('tokenizer_class')} {config.get('model_type')}"
    found = facts["classes"].get(pair)
    if found is None:
        return None
    module, cls = found
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def known_model_type(model_type: str) -> bool | None:
    """Whether this transformers has a config class for ``model_type``; None if the facts do not
    say (another transformers version: ask ``transformers.CONFIG_MAPPING``)."""
    facts = _facts()
    return model_type in facts["model_types"] if facts else None


def _facts() -> dict[str, Any]:
    """The facts file's, or empty when written for another transformers than this one."""
    if not _FACTS:
        _FACTS.update(json.loads(FACTS_FILE.read_text(encoding="utf-8")))
    return _FACTS if _FACTS["transformers"] == _transformers_version() else {}


def _transformers_version() -> str:
    return metadata.version("transformers")


def _json(file: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def live_facts() -> dict[str, Any]:
    """The facts as this transformers says them; a tokenizer class is what ``AutoTokenizer``
    loads from a folder made for its pair (a small tokenizer, its tokenizer_class and
    model_type set)."""
    from transformers import AutoTokenizer
    from transformers.models.auto import tokenization_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    classes = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = _small_tokenizer(Path(tmp) / "base")
        for name, model_type in PAIRS:
            folder = pair_folder(base, Path(tmp) / f"{name}-{model_type}", name, model_type)
            loaded = type(AutoTokenizer.from_pretrained(str(folder)))
            classes[f"{name} {model_type}"] = [loaded.__module__, loaded.__qualname__]
    return {
        "transformers": _transformers_version(),
        "backend_patterns": sorted(tokenization_auto.MODEL_IDS_TO_TOKENIZERS_BACKEND),
        "classes": classes,
        "model_types": sorted(CONFIG_MAPPING_NAMES),
    }


def _small_tokenizer(out: Path) -> Path:
    """A byte-level BPE tokenizer folder (what it encodes does not matter here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|pad|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["1 + 2 = 3", "12 * 3 = 36", "the answer is 7"] * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>"
    )
    wrapped.save_pretrained(str(out))
    return out


def pair_folder(base: Path, out: Path, tokenizer_cls: str, model_type: str) -> Path:
    """A copy of the tokenizer folder ``base`` at ``out`` whose tokenizer_config.json names
    ``tokenizer_cls`` and whose config.json has ``model_type``."""
    out.mkdir(parents=True)
    for file in base.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_config["tokenizer_class"] = tokenizer_cls
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    (out / "config.json").write_text(json.dumps({"model_type": model_type}), encoding="utf-8")
    return out


def write_facts() -> None:
    """Write :data:`FACTS_FILE` from this transformers (``make facts``)."""
    text = json.dumps(live_facts(), indent=1, sort_keys=True)
    FACTS_FILE.write_text(text + "\n", encoding="utf-8")
