"""Mixtures of experts, which transformers 5 holds otherwise than their files: each layer's
experts fused into two 3-D tensors (``mlp.experts.gate_up_proj``, ``down_proj``) where a
checkpoint has one matrix per expert and projection, and Mixtral's ``block_sparse_moe`` named
``mlp``. A weight update reaches vLLM as the files hold them (`checkpoint_format`), a
checkpoint loads back through transformers' conversion, and LoRA's 'all-linear' means their
linear layers (the end-to-end run through vLLM: tests/trainers/test_run_eval.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import random_lm

from treadle.config.actor import LoraConfig
from treadle.engines.inference import HFRolloutEngine
from treadle.engines.lora import lora_scalings, merged_lora
from treadle.models.loading import apply_lora, checkpoint_format, has_weight_conversions
from treadle.runtime.errors import ConfigError


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_a_mixture_of_experts_is_sent_as_save_pretrained_writes_it(arch, tmp_path):
    model = random_lm(arch)
    model.save_pretrained(tmp_path)
    files = load_file(str(tmp_path / "model.safetensors"))
    sent = dict(checkpoint_format(model, model.state_dict().items()))
    assert has_weight_conversions(model)
    assert sent.keys() == files.keys()
    assert all(torch.equal(sent[name], files[name]) for name in files)
    assert {name for name in files if ".experts.3." in name}  # one matrix an expert
    assert not {name for name in sent if name.endswith("gate_up_proj")}


def test_a_dense_model_s_tensors_pass_through_untouched():
    model = random_lm("llama")
    named = list(model.state_dict().items())
    sent = list(checkpoint_format(model, iter(named)))
    assert not has_weight_conversions(model)
    assert [name for name, _ in sent] == [name for name, _ in named]
    assert all(a is b for (_, a), (_, b) in zip(sent, named, strict=True))


def test_the_tensors_are_converted_one_layer_at_a_time():
    """A layer's tensors leave before the next layer's second tensor is taken: the full
    tensors held at once are one layer's."""
    model = random_lm("mixtral", num_hidden_layers=3)
    taken: list[str] = []

    def gathered():  # as the FSDP engine yields them, one at a time
        for name, tensor in model.state_dict().items():
            taken.append(name)
            yield name, tensor

    for name, _ in checkpoint_format(model, gathered()):
        if ".layers.0." in name:
            assert sum(".layers.1." in t for t in taken) <= 1
            assert not [t for t in taken if ".layers.2." in t]


def test_all_linear_gives_a_mixture_of_experts_adapters_on_its_linear_layers(tmp_path):
    """peft's own 'all-linear' also wraps the fused experts (``ParamWrapper``), whose adapters
    the merge for the rollout dropped: the run stopped at its first weight sync."""
    model = random_lm("mixtral")
    lora = apply_lora(model, LoraConfig(rank=4, alpha=8), tmp_path)
    adapted = {name.rsplit(".", 1)[-1] for name, m in lora.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not [m for m in lora.modules() if type(m).__name__ == "ParamWrapper"]
    with torch.no_grad():  # adapters that change the weights (B starts at 0)
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_()
    base = lora.get_base_model()
    merged = merged_lora(iter(lora.state_dict().items()), lora_scalings(lora))
    sent = dict(checkpoint_format(base, merged))
    files = tmp_path / "merged"
    lora.merge_and_unload().save_pretrained(files)
    written = load_file(str(files / "model.safetensors"))
    assert sent.keys() == written.keys()
    assert all(torch.allclose(sent[name], written[name], atol=1e-6) for name in written)


def test_a_dense_model_keeps_peft_s_all_linear(tmp_path):
    """(Its Conv1D layers, GPT-2's, are peft's 'all-linear' too: tests/workers/test_lora.py.)"""
    model = random_lm("llama")
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    lora = apply_lora(model, LoraConfig(rank=4, alpha=8), tmp_path)
    adapted = {name for name, m in lora.get_base_model().named_modules() if hasattr(m, "lora_A")}
    assert adapted == linear - {"lm_head"} and len(adapted) == 14


def test_lora_keeps_off_the_experts_peft_would_move_a_dense_mlp_s_names_onto(tmp_path):
    """peft moves ``gate_proj``, ``up_proj`` and ``down_proj`` onto a Qwen3-MoE's fused experts
    (its names for a transformers 4 model's expert layers), those of a dense MLP layer too
    (``mlp_only_layers``): 'all-linear' leaves them out, a list naming them is refused."""
    lm = random_lm("qwen3_moe", mlp_only_layers=[0])
    lora = apply_lora(lm, LoraConfig(rank=4, alpha=8), tmp_path)
    adapted = {name.rsplit(".", 1)[-1] for name, m in lora.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not [m for m in lora.modules() if type(m).__name__ == "ParamWrapper"]
    listed = LoraConfig(rank=4, target_modules=["q_proj", "gate_proj", "up_proj"])
    with pytest.raises(ConfigError) as e:
        apply_lora(random_lm("qwen3_moe", mlp_only_layers=[0]), listed, tmp_path)
    assert str(e.value) == (
        "actor.lora.target_modules: 'gate_proj', 'up_proj': on this mixture of experts peft "
        "puts such adapters on its fused experts, which treadle cannot merge into the "
        "rollout's weights: leave it out (its other linear layers: k_proj, o_proj, q_proj, "
        "v_proj), or use 'all-linear'"
    )


def test_the_hf_engine_takes_a_saved_buffer_and_refuses_a_tensor_that_does_not_fit():
    """DeepSeek V3's router keeps a score-correction bias as a buffer its checkpoints hold,
    so a weight update sends it: the transformers engine, which knew parameters only (every
    update of such a model failed), copies it in place with the rest; a tensor of another
    shape is refused by name (``copy_`` would have broadcast it)."""
    model = random_lm("deepseek_v3")
    engine = HFRolloutEngine(model, [0], 0)
    new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert bias in new and bias not in dict(model.named_parameters())
    engine.update_weights(new.items())
    assert all(torch.equal(t, new[k]) for k, t in model.state_dict().items())
    with pytest.raises(ValueError, match=r"'model.norm.weight' of shape \(1,\) does not fit "):
        engine.update_weights([("model.norm.weight", torch.zeros(1))])
