"""Loading and saving HF model folders, and their errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from treadle.models.loading import (
    count_parameters,
    load_causal_lm,
    load_tokenizer,
    load_value_model,
    resolve_model_path,
    save_hf_folder,
)
from treadle.runtime.errors import ConfigError
from treadle.tasks import arithmetic as ar


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    rows = ar.generate_problems(100, seed=0)
    tok = ar.build_tokenizer([r["solution"] for r in rows], out)
    ar.build_tiny_model(tok, out, ar.ModelShape(hidden_size=32, num_layers=2, intermediate_size=64))
    return out


def test_load_tokenizer_and_model(model_dir: Path):
    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, "bfloat16")
    assert model.dtype == torch.bfloat16
    assert model.config.vocab_size == len(tok)
    assert load_causal_lm(str(model_dir), torch.float32).dtype == torch.float32


def test_a_tokenizer_is_loaded_once_while_its_files_stay(tmp_path: Path, model_dir: Path):
    folder = tmp_path / "model"
    folder.mkdir()
    for f in model_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    first = load_tokenizer(folder)
    assert load_tokenizer(str(folder)) is first  # the driver asks four times at start
    assert load_tokenizer(model_dir) is not first  # another folder: its own
    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    config.write_text(json.dumps({**settings, "model_max_length": 77}))
    again = load_tokenizer(folder)  # a file changed: loaded anew, with the change
    assert again is not first and again.model_max_length == 77
    assert load_tokenizer(folder) is again


def test_missing_folder_names_the_key_and_path(tmp_path: Path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=rf"^model\.path: '{missing}' does not exist"):
        load_causal_lm(missing)
    with pytest.raises(ConfigError, match=r"^reference\.path: .* does not exist"):
        load_tokenizer(missing, key="reference.path")


def test_folder_without_config_or_tokenizer_or_weights(tmp_path: Path, model_dir: Path):
    with pytest.raises(
        ConfigError, match=rf"model\.path: '{tmp_path}' is not a model folder: no config\.json"
    ):
        load_causal_lm(tmp_path)
    with pytest.raises(
        ConfigError, match=rf"model\.path: '{tmp_path}' is not a model folder: no tokenizer"
    ):
        load_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="no \\*\\.safetensors weights"):
        load_causal_lm(tmp_path)
    with pytest.raises(ConfigError, match="is a file, not a model folder"):
        load_causal_lm(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="not a torch dtype"):
        load_causal_lm(model_dir, "float33")


def damaged_copy(model_dir: Path, out: Path, drop: tuple[str, ...] = (), **config: object) -> Path:
    """A copy of the model folder with the tensors ``drop`` removed from model.safetensors and
    the ``config`` entries changed in config.json."""
    shutil.copytree(model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k not in drop}, str(out / "model.safetensors"))
    settings = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**settings, **config}))
    return out


def refused(folder: Path, key: str, *facts: str) -> str:
    """The pattern of the ConfigError for a folder whose weights do not match config.json."""
    found = ".*".join(map(re.escape, facts))
    return (
        rf"^{re.escape(key)}: the weights in '{re.escape(str(folder))}' do not match its "
        rf"config\.json: .*{found}.*: fix config\.json or save the model again$"
    )


def test_a_tensor_missing_from_the_weights_is_refused(tmp_path: Path, model_dir: Path):
    """Not started at random and trained as if it were the model."""
    gone = "model.layers.1.mlp.down_proj.weight"
    folder = damaged_copy(model_dir, tmp_path / "m", drop=(gone,))
    with pytest.raises(ConfigError, match=refused(folder, "model.path", f"{gone} is missing")):
        load_causal_lm(folder)
    with pytest.raises(ConfigError, match=refused(folder, "critic.model.path", gone)):
        load_value_model(folder, key="critic.model.path")  # only the new score head may lack


def test_weights_of_more_layers_than_config_json_says_are_refused(tmp_path: Path, model_dir: Path):
    """Not silently cut to the first num_hidden_layers layers."""
    folder = damaged_copy(
        model_dir, tmp_path / "m", num_hidden_layers=1, layer_types=["full_attention"]
    )
    want = refused(
        folder,
        "reference.path",
        "model.layers.1.input_layernorm.weight",
        "not used by config.json's architecture",
        "the weights have 2 layers, config.json says num_hidden_layers=1",
    )
    with pytest.raises(ConfigError, match=want):
        load_causal_lm(folder, key="reference.path")
    with pytest.raises(ConfigError, match=want.replace("reference", "critic")):
        load_value_model(folder, key="critic.path")


def test_layer_types_of_another_length_than_num_hidden_layers(tmp_path: Path, model_dir: Path):
    """transformers' refusal was a huggingface_hub StrictDataclassClassValidationError
    traceback; it is one line naming the file and both keys, for either loader."""
    folder = damaged_copy(model_dir, tmp_path / "m", num_hidden_layers=1)
    want = (
        rf"^model\.path: '{re.escape(str(folder))}/config\.json' has num_hidden_layers=1 but "
        r"layer_types lists 2 layers: make them agree \(one type per layer\)$"
    )
    with pytest.raises(ConfigError, match=want):
        load_causal_lm(folder)
    with pytest.raises(ConfigError, match=want.replace("model", "critic", 1)):
        load_value_model(folder, key="critic.path")


def test_weights_of_another_shape_than_config_json_implies_are_refused(
    tmp_path: Path, model_dir: Path
):
    """Named with both shapes, not transformers' RuntimeError pointing at a report."""
    folder = damaged_copy(model_dir, tmp_path / "m", intermediate_size=96)
    want = "model.layers.0.mlp.down_proj.weight is 32x64 in the file but 32x96 by config.json"
    with pytest.raises(ConfigError, match=refused(folder, "model.path", want)):
        load_causal_lm(folder)
    with pytest.raises(ConfigError, match=refused(folder, "model.path", want)):
        load_value_model(folder)


def test_undamaged_tied_and_untied_folders_still_load(tmp_path: Path, model_dir: Path):
    """What transformers leaves out as benign stays allowed: the tied lm_head.weight that is
    not in the file, and for a critic the causal LM's lm_head beside the new score head."""
    weights = load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights
    tied = load_causal_lm(model_dir)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied = tmp_path / "untied"
    shutil.copytree(model_dir, untied)
    head = weights["model.embed_tokens.weight"] + 1.0
    save_file({**weights, "lm_head.weight": head}, str(untied / "model.safetensors"))
    settings = json.loads((model_dir / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**settings, "tie_word_embeddings": False}))
    assert torch.equal(load_causal_lm(untied).lm_head.weight, head)
    for folder in (model_dir, untied):
        critic = load_value_model(folder)
        assert not critic.score.weight.any()  # the new head starts at zero
        assert torch.equal(critic.model.norm.weight, tied.model.norm.weight)
    with pytest.raises(TypeError, match="sets output_loading_info itself"):
        load_causal_lm(model_dir, output_loading_info=True)


def test_save_hf_folder_round_trips_tied_weights(tmp_path: Path, model_dir: Path):
    model = load_causal_lm(model_dir)
    tok = load_tokenizer(model_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)  # changes lm_head too: they are one tensor
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out = save_hf_folder(state, model.config, tok, tmp_path / "saved")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    again = load_causal_lm(out)
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    saved_tok = json.loads((out / "tokenizer_config.json").read_text())
    # names transformers 4 (vLLM's) knows too
    assert saved_tok["tokenizer_class"] in {"PreTrainedTokenizerFast", "Qwen2Tokenizer"}
    assert saved_tok["additional_special_tokens"] == ["<|im_start|>"]
    assert load_tokenizer(out).encode("What is 12+3?") == tok.encode("What is 12+3?")


def test_save_hf_folder_rejects_incomplete_or_foreign_state(tmp_path: Path, model_dir: Path):
    model = load_causal_lm(model_dir)
    state = model.state_dict()
    partial = {k: v for k, v in state.items() if "layers.1." not in k}
    with pytest.raises(ValueError, match="missing parameters"):
        save_hf_folder(partial, model.config, None, tmp_path / "a")
    with pytest.raises(ValueError, match="keys the model lacks"):
        save_hf_folder(
            {**state, "extra.weight": torch.zeros(1)}, model.config, None, tmp_path / "b"
        )


def test_count_parameters_counts_tied_weights_once(model_dir: Path):
    model = load_causal_lm(model_dir)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert count_parameters(model) == sum(unique.values())
    embed = model.model.embed_tokens.weight
    assert count_parameters(model) < sum(t.numel() for t in model.state_dict().values())
    embed.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == count_parameters(model) - embed.numel()


def test_checkpoint_directory_stands_for_its_model_folder(tmp_path):
    from treadle.models.loading import resolve_model_path

    model = tmp_path / "checkpoints" / "step_3" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    assert resolve_model_path(model.parent) == str(model)
    assert resolve_model_path(model) == str(model)


def test_a_hub_id_is_an_error_unless_downloads_are_allowed(monkeypatch, tmp_path: Path):
    """A path that is not a local folder never reaches the hub by default."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"^model.path: 'org/model' is not a local folder; treadle does not download "
        r"models unless model.allow_download=true",
    ):
        load_tokenizer("org/model")
    assert resolve_model_path("org/model", allow_download=True) == "org/model"
    with pytest.raises(ConfigError, match=r"'not a hub id' does not exist"):
        resolve_model_path("not a hub id", allow_download=True)
