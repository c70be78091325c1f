"""What a checkpoint records of its run's settings, and what a resuming config changes."""

from __future__ import annotations

import shutil

from treadle.config import load_config
from treadle.config.recorded import FIXED, changes, record


def shown(found):
    return [[str(c) for c in part] for part in found]


def test_a_path_is_its_real_path_and_a_moved_folder_is_the_same(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model/model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "rows.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    before = record(load_config(None, ["model.path=model", "data.train_files=[rows.jsonl]"]))
    assert before["model.path"]["path"] == str(tmp_path / "model")
    assert before["data.train_files"][0]["path"] == str(tmp_path / "rows.jsonl")
    assert before["model.dtype"] == "float32"  # (not a path: as it is)
    same = load_config(
        None, [f"model.path={tmp_path}/model", f"data.train_files=[{tmp_path}/rows.jsonl]"]
    )
    assert shown(changes(before, same)) == [[], []]

    shutil.copytree(tmp_path / "model", tmp_path / "copy")  # the recorded folder still there
    copy = load_config(None, ["model.path=copy", "data.train_files=[rows.jsonl]"])
    assert shown(changes(before, copy)) == [[f"model.path {tmp_path}/model -> {tmp_path}/copy"], []]
    shutil.rmtree(tmp_path / "model")  # now it moved: the same files elsewhere
    assert shown(changes(before, copy)) == [[], []]
    (tmp_path / "copy/model.safetensors").write_bytes(b"x" * 11)  # other weights
    assert shown(changes(before, copy))[0] == [f"model.path {tmp_path}/model -> {tmp_path}/copy"]


def test_fixed_settings_are_refused_and_the_others_named():
    before = record(load_config("examples/arithmetic/grpo.yaml"))
    after = load_config(
        "examples/arithmetic/grpo.yaml",
        ["actor.lr=3e-6", "trainer.total_steps=50", "model.tokenizer_path=elsewhere"],
    )
    fixed, other = shown(changes(before, after))
    assert fixed == ['model.tokenizer_path null -> "elsewhere"']
    assert other == ["actor.lr 0.0002 -> 3e-06", "trainer.total_steps 40 -> 50"]
    assert "model.tokenizer_path" in FIXED


def test_lora_settings_count_only_where_there_are_adapters():
    before = record(load_config("examples/arithmetic/grpo.yaml"))
    no_adapters = load_config("examples/arithmetic/grpo.yaml", ["actor.lora.alpha=64"])
    assert shown(changes(before, no_adapters)) == [[], []]
    adapters = load_config("examples/arithmetic/grpo.yaml", ["actor.lora.rank=8"])
    assert shown(changes(before, adapters)) == [["actor.lora.rank 0 -> 8"], []]
    lora = record(adapters)
    wider = load_config(
        "examples/arithmetic/grpo.yaml", ["actor.lora.rank=8", "actor.lora.alpha=64"]
    )
    assert shown(changes(lora, wider)) == [["actor.lora.alpha 16.0 -> 64.0"], []]
