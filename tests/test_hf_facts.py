"""What `treadle check` knows of transformers without importing torch (treadle.models.hf_facts): the
facts file is what this transformers says, a folder loads with the tokenizer class
AutoTokenizer picks, and a first check (nothing kept) imports no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from treadle.models import folders as model_folders
from treadle.models import hf_facts
from treadle.models.hf_facts import FACTS_FILE, live_facts, pair_folder, tokenizer_class

MESSAGES = [{"role": "user", "content": "12 + 30"}]


def test_the_facts_file_is_what_this_transformers_says():
    kept = json.loads(FACTS_FILE.read_text(encoding="utf-8"))
    assert kept == live_facts(), "run `make facts` to write it again"
    assert kept["classes"]["Qwen2Tokenizer qwen2"][1] == "Qwen2Tokenizer"
    assert "llama" in kept["model_types"] and "qwen2" in kept["model_types"]


def test_a_folder_loads_with_the_class_autotokenizer_picks(tiny_task, monkeypatch):
    folder = str(tiny_task["model"])
    monkeypatch.setattr(model_folders, "_LOADED", {})
    ours, theirs = model_folders.load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert tokenizer_class(folder) is type(theirs) is type(ours)
    assert len(ours) == len(theirs)
    rendered = [
        t.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
        for t in (ours, theirs)
    ]
    assert rendered[0] == rendered[1]


def test_a_folder_the_facts_cannot_vouch_for_goes_through_autotokenizer(
    tiny_task, tmp_path, monkeypatch
):
    base = Path(tiny_task["model"])
    assert tokenizer_class(base) is not None
    remote = pair_folder(base, tmp_path / "remote", "Qwen2Tokenizer", "qwen2")
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "x.C"}}))
    unknown = pair_folder(base, tmp_path / "unknown", "BertTokenizer", "qwen2")
    assert tokenizer_class(remote) is None and tokenizer_class(unknown) is None
    # a name AutoTokenizer sends to the generic backend (it matches the path it is given)
    monkeypatch.chdir(tmp_path)
    named = pair_folder(base, Path("deepseek-ai/deepseek-coder-1b"), "Qwen2Tokenizer", "qwen2")
    assert tokenizer_class(str(named)) is None
    assert type(AutoTokenizer.from_pretrained(str(named))).__name__ == "TokenizersBackend"


def test_facts_written_for_another_transformers_say_nothing(tiny_task, monkeypatch):
    monkeypatch.setattr(hf_facts, "_transformers_version", lambda: "0.0.1")
    assert tokenizer_class(tiny_task["model"]) is None
    assert hf_facts.known_model_type("qwen2") is None


_FIRST_CHECK = """
import sys
from treadle.cli import main
code = main(["check", *sys.argv[1:]])
print(code, sorted(m for m in ("torch", "vllm", "ray") if m in sys.modules))
"""


KINDS = ("train", "sft", "dpo")


@pytest.fixture(scope="module")
def first_checks(env, tmp_path_factory):
    """A first check of each kind, each in a process of its own with an empty cache, all
    started together at the first test's start (one core each: their imports overlap)."""
    procs = {}
    for kind in KINDS:
        run = tmp_path_factory.mktemp(f"run-{kind}") / "run"  # (not one directory's probes)
        args = [env["config"], f"--kind={kind}", f"trainer.output_dir={run}"]
        if kind == "dpo":
            args += [f"data.train_files=[{env['pairs']}]", f"data.val_files=[{env['pairs']}]"]
        cache = {"TREADLE_CHECK_CACHE": str(tmp_path_factory.mktemp(f"cache-{kind}"))}
        procs[kind] = subprocess.Popen(
            [sys.executable, "-c", _FIRST_CHECK, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **cache},
        )  # fmt: skip
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_first_check_imports_no_torch(first_checks, kind):
    """Nothing kept (an empty cache): the tokenizer, the data rows, the model's config and the
    algorithm's facts are all read without torch (seconds of a first check)."""
    stdout, stderr = first_checks[kind].communicate(timeout=300)
    assert stdout.strip().splitlines()[-1] == "0 []", stdout + stderr[-3000:]
