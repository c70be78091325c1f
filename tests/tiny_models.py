"""The tests' tiny models: the built-in task's model family (`build_tiny_model`) at test size,
one helper for every test that builds one (a module, not a conftest fixture, so that fixtures
and tests both import it as they import tiny_runs)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from treadle.tasks.arithmetic import ModelShape

# The tiny task's model shape (tests/conftest.py's `tiny_task`): head size 32 (64 / 2 heads),
# the smallest vLLM's CPU attention runs.
TINY_SHAPE = ModelShape(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128
)


def tiny_model(out: str | Path, tokenizer_from: str | Path, seed: int = 0, **changes: Any) -> Path:
    """A tiny model of `TINY_SHAPE` (128 positions) with the tokenizer of the model folder
    ``tokenizer_from``, saved to ``out``; ``changes`` replace any of `ModelShape`'s fields."""
    from treadle.models.loading import load_tokenizer
    from treadle.tasks.arithmetic import build_tiny_model

    shape = replace(TINY_SHAPE, **{"max_positions": 128, **changes})
    tokenizer = load_tokenizer(tokenizer_from)  # a fast tokenizer, typed as their base class
    return build_tiny_model(tokenizer, out, shape, seed=seed)  # type: ignore[arg-type]


# A family's own keys, by architecture: a mixture of experts' 4 experts of which 2 a token,
# a linear attention's heads.
FAMILY_KEYS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
    },
    # Gated DeltaNet (a linear attention: a state along the sequence) and full attention
    "qwen3_next": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "layer_types": ["linear_attention", "full_attention"],
    },
    # Gated DeltaNet and full attention, dense (no transformers token classification)
    "qwen3_5_text": {
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"],
    },
    # (vLLM cannot update its weights in place: a refused family)
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2},
    # its second layer's experts; multi-head latent attention (as many key/value heads as
    # query heads), its own head sizes
    "deepseek_v3": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "num_key_value_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 8,
    },
}


def random_lm(arch: str = "llama", attn: str = "sdpa", **changes: Any) -> Any:
    """An in-memory causal LM of ``arch`` (llama, qwen2, qwen3, gemma2, cohere, granite, lfm2,
    or a mixture of experts: mixtral, qwen3_moe, qwen2_moe, deepseek_v3, qwen3_next, gpt_oss) with
    random weights (seed 0): 2 layers of 4 heads (2 key/value heads) of 8, a vocabulary of 64,
    float32; ``changes``: more config keys."""
    import torch
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma2"}
    name |= {"cohere": "Cohere", "granite": "Granite", "mixtral": "Mixtral"}
    name |= {"qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe", "deepseek_v3": "DeepseekV3"}
    name |= {"qwen3_next": "Qwen3Next", "lfm2": "Lfm2", "gpt_oss": "GptOss"}
    head = {"head_dim": 8} if arch.startswith("qwen3") else {}  # (Qwen3's own default: 128)
    changes = {**FAMILY_KEYS.get(arch, {}), **head, **changes}
    config_cls = getattr(transformers, f"{name[arch]}Config")
    model_cls = getattr(transformers, f"{name[arch]}ForCausalLM")
    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64}
    sizes |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    sizes["max_position_embeddings"] = 64
    config = config_cls(attn_implementation=attn, **{**sizes, **changes})
    torch.manual_seed(0)
    return model_cls(config).float()


def tiny_family(out: str | Path, tokenizer_from: str | Path, arch: str = "mixtral") -> Path:
    """A tiny model of the family ``arch`` (`FAMILY_KEYS`, Mixtral by default; or ``olmo2``,
    which vLLM runs on transformers' code) with `TINY_SHAPE`'s
    attention (head size 32, for vLLM's CPU attention) and 128 positions, random weights
    (seed 0), with the tokenizer of the model folder ``tokenizer_from``, saved to ``out`` by
    ``save_pretrained`` (a mixture's experts one tensor per expert, as a hub checkpoint's)."""
    from treadle.models.loading import load_tokenizer
    from treadle.tasks.arithmetic import build_tiny_model

    shape = replace(TINY_SHAPE, arch=arch, max_positions=128)
    head = TINY_SHAPE.hidden_size // TINY_SHAPE.num_heads
    tokenizer = load_tokenizer(tokenizer_from)  # a fast tokenizer, typed as their base class
    keys = FAMILY_KEYS.get(arch, {})
    return build_tiny_model(tokenizer, out, shape, head_dim=head, **keys)  # type: ignore[arg-type]


# Two chat templates as their models' tokenizer_config.json hold them, with turns of their own.
# Gemma 2's: no system role, user and model turns alternating, each closed by <end_of_turn>
# (not the tokenizer's EOS, <eos>).
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
# Phi-3.5-mini's: each turn closed by <|end|>, and a conversation that does not go on to the
# model's turn ends with the EOS, <|endoftext|>.
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# Mistral's tool calling (its v0.3 instruct models' template, abridged): a turn's calls as
# [TOOL_CALLS] with their ids, each result as [TOOL_RESULTS] naming its call's id, and both
# refused unless the id has nine characters.
_NINE = (
    "{% if not {0} is defined or {0} | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '[SYSTEM_PROMPT] ' + message['content'] + '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}"
    "{% if tools and loop.last %}{{ '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}"
    "{% endif %}{{ '[INST] ' + message['content'] + '[/INST]' }}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}{{ '[TOOL_CALLS] [' }}"
    "{% for call in message.tool_calls %}" + _NINE.replace("{0}", "call.id") + "{{ {'name': "
    "call.function.name, 'arguments': call.function.arguments, 'id': call.id} | tojson }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ ']' + eos_token }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'tool' %}" + _NINE.replace("{0}", "message.tool_call_id") + ""
    "{{ '[TOOL_RESULTS] {\"content\": ' + message['content'] + ', \"call_id\": \"' "
    "+ message.tool_call_id + '\"}[/TOOL_RESULTS]' }}"
    "{% endif %}{% endfor %}"
)
CHAT_STYLES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": (
        GEMMA2_TEMPLATE,
        {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
        },
    ),
    "phi3": (
        PHI3_TEMPLATE,
        {
            "eos_token": "<|endoftext|>",
            "additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        },
    ),
    "mistral": (
        MISTRAL_TEMPLATE,
        {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "additional_special_tokens": [
                f"[{end}{name}]"
                for name in ("INST", "SYSTEM_PROMPT", "AVAILABLE_TOOLS", "TOOL_RESULTS")
                for end in ("", "/")
            ]
            + ["[TOOL_CALLS]"],
        },
    ),
}


def chat_style(tokenizer: Any, family: str) -> Any:
    """A copy of ``tokenizer`` with ``family``'s chat template and special tokens
    (`CHAT_STYLES`), for the chat-rendering tests (ids past a tiny model's vocabulary: no model
    reads them)."""
    import copy

    template, specials = CHAT_STYLES[family]
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens(specials)
    tok.chat_template = template
    return tok


def shipped_style(tokenizer: Any, name: str) -> Any:
    """A copy of ``tokenizer`` with a chat template as its model ships it, from TRL's copies
    (``trl/chat_templates/<name>.jinja``: ``gptoss``, ``gemma4``, ``smolvlm``, ``qwen3``, ...),
    the special tokens it writes added (``<|call|>``, ``<turn|>``, ``<end_of_utterance>``)."""
    import copy
    import re

    import trl

    template = (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()
    specials = r"<\|[\w\"]+\|?>|<[\w\"]+\|>|<[a-z_]+_of_[a-z_]+>|\[/?[A-Z_]+\]|<｜[^｜<>]*｜>"
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens(
        {"additional_special_tokens": sorted(set(re.findall(specials, template)))}
    )
    if "bos_token" in template and tok.bos_token is None:  # (Llama 3.0's adds text to it)
        tok.add_special_tokens({"bos_token": "<bos>"})
    if "</s>" in template:  # (LLaVA-NeXT's writes Mistral's EOS as text)
        tok.add_special_tokens({"eos_token": "</s>"})
    tok.chat_template = template
    return tok


def shipped_templates() -> list[str]:
    """The names :func:`shipped_style` takes: TRL's copies of templates as models ship them
    (not its training variants)."""
    import trl

    folder = Path(trl.__file__).parent / "chat_templates"
    return sorted(p.stem for p in folder.glob("*.jinja") if not p.stem.endswith("_training"))
