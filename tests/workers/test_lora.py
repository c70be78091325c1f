"""LoRA on the actor: only adapters train and are saved; the rollout gets merged weights.

On the tiny model, one FSDP2 rank in-process: after a step the base weights are bit-identical
and the adapters moved; the optimizer holds the adapters only; the merged state equals peft's
``merge_and_unload``; a checkpoint holds the adapters (not the base); a GRPO run resumed from
one equals an uninterrupted run, and its ``final_model`` loads in transformers (merged) and
with peft (``final_model/adapter``). Bad ``actor.lora`` values are one line naming the key.
"""

from __future__ import annotations

import logging

import pytest
import tiny_runs
import torch
import torch.distributed as dist
from peft import PeftModel
from safetensors.torch import load_file

from treadle.config import LoraConfig, load_config
from treadle.engines.checkpoint import load_checkpoint, save_checkpoint
from treadle.engines.fsdp import TrainEngine
from treadle.models.checkpoint import CheckpointError, holds_adapters
from treadle.models.loading import apply_lora, load_causal_lm, load_tokenizer
from treadle.protocol import Batch
from treadle.runtime.errors import ConfigError


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process (FSDP2 needs one), unless a test left one."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    if made:
        dist.destroy_process_group()


def lora_engine(model, lr=1e-2, **lora):
    lm = apply_lora(load_causal_lm(model), LoraConfig(rank=4, alpha=8, **lora), model)
    return TrainEngine(lm, chunk_size=64, lr=lr)


def batch(vocab: int, n: int = 4, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n, length), generator=gen)
    return ids, torch.ones(n, length, dtype=torch.long)


def step(engine: TrainEngine, vocab: int) -> dict[str, float]:
    ids, mask = batch(vocab)

    def loss(mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        logp, _ = engine.log_probs(mb["input_ids"], mb["attention_mask"], 6)
        return -logp.mean(), {}

    micro = Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask})
    out = engine.train_step([micro], loss)
    return {k: v for k, v in out.items() if not k.startswith("perf/")}  # (rates: timed)


def full(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state()}


def test_a_step_moves_only_the_adapters_and_the_rollout_gets_peft_merged_weights(
    tiny_task, one_rank
):
    engine = lora_engine(tiny_task["model"])
    base = load_causal_lm(tiny_task["model"]).state_dict()
    vocab = engine.module.lm.config.vocab_size
    named = dict(engine.module.named_parameters())
    adapters = {n for n in named if ".lora_A." in n or ".lora_B." in n}
    assert {n for n, p in named.items() if p.requires_grad} == adapters
    assert engine.optimizer is not None
    held = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert held == {id(named[n]) for n in adapters}
    before = {n: p.full_tensor().clone() for n, p in named.items()}
    assert step(engine, vocab)["grad_norm"] > 0
    step(engine, vocab)  # B starts at 0, so A has no gradient before a second step
    after = {n: p.full_tensor() for n, p in named.items()}
    for n in named:
        same = torch.equal(before[n], after[n])
        assert same != (n in adapters), n  # base bit-identical, every adapter moved

    merged = full(engine)  # what weight sync sends: the base model's names
    assert merged.keys() == base.keys() - {"lm_head.weight"}  # the tied head: the embedding
    changed = {k for k in merged if not torch.equal(merged[k], base[k])}
    assert changed == {k for k in base if k.endswith("proj.weight")}
    # peft's own merge of the same adapters into a fresh base model
    model = tiny_task["model"]
    peft_model = apply_lora(load_causal_lm(model), LoraConfig(rank=4, alpha=8), model)
    trained = {
        k.removeprefix("lm."): v.full_tensor()
        for k, v in engine.module.state_dict().items()
        if ".lora_" in k
    }
    assert not peft_model.load_state_dict(trained, strict=False).unexpected_keys
    want = peft_model.merge_and_unload().state_dict()
    for k, v in merged.items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=1e-7)


def test_a_bfloat16_base_trains_float32_adapters(tiny_task, one_rank):
    """model.dtype=bfloat16 with LoRA: the frozen base in bfloat16 (2 bytes a parameter, the
    memory a GPU run saves), the adapters and their AdamW moments in float32 (peft's
    autocast_adapter_dtype), and a step moves every adapter, in float32."""
    model = tiny_task["model"]
    lm = load_causal_lm(model, torch.bfloat16)
    engine = TrainEngine(apply_lora(lm, LoraConfig(rank=4, alpha=8), model), chunk_size=64, lr=1e-2)
    named = dict(engine.module.named_parameters())
    dtypes = {(p.dtype, p.requires_grad) for p in named.values()}
    assert dtypes == {(torch.bfloat16, False), (torch.float32, True)}
    before = {n: p.full_tensor().clone() for n, p in named.items() if p.requires_grad}
    vocab = engine.module.lm.config.vocab_size
    step(engine, vocab), step(engine, vocab)  # (B starts at 0: A moves from the second)
    assert engine.optimizer is not None
    moments = [v for state in engine.optimizer.state.values() for v in state.values()]
    assert moments and {v.dtype for v in moments if v.dim() > 0} == {torch.float32}
    assert all(not torch.equal(before[n], named[n].full_tensor()) for n in before)


def test_a_checkpoint_holds_the_adapters_and_without_optimizer_resume_warns(
    tiny_task, one_rank, tmp_path, caplog
):
    model = tiny_task["model"]
    tok = load_tokenizer(model)
    engine = lora_engine(model)
    vocab = engine.module.lm.config.vocab_size
    step(engine, vocab)
    step(engine, vocab)
    save_checkpoint(engine, tmp_path / "a", 0, tok)
    save_checkpoint(engine, tmp_path / "b", 0, tok, with_optimizer=False)
    assert holds_adapters(tmp_path / "a") and not (tmp_path / "a" / "model").exists()
    saved = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    assert saved and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in saved)
    assert (tmp_path / "a" / "optimizer.safetensors").is_file()
    assert not (tmp_path / "b" / "optimizer.safetensors").exists()
    # The adapter folder is peft's: it loads onto the base model and gives the merged weights.
    peft_model = PeftModel.from_pretrained(load_causal_lm(model), str(tmp_path / "a" / "adapter"))
    want = peft_model.merge_and_unload().state_dict()
    for k, v in full(engine).items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=1e-7)

    # Resume onto a fresh base: the same adapters and optimizer, so the same next step.
    expected = step(engine, vocab)
    again = lora_engine(model)
    load_checkpoint(again, tmp_path / "a", 0)
    assert step(again, vocab) == pytest.approx(expected, rel=1e-6)
    fresh = lora_engine(model)
    with caplog.at_level(logging.WARNING, logger="treadle"):
        load_checkpoint(fresh, tmp_path / "b", 0)
    assert "holds no optimizer state (trainer.save_optimizer=false)" in caplog.text
    assert fresh.scheduler is not None and engine.scheduler is not None
    assert fresh.scheduler.last_epoch == 2
    # A rank that does not match the checkpoint's adapters is one clear error.
    other = apply_lora(load_causal_lm(model), LoraConfig(rank=2), model)
    with pytest.raises(CheckpointError, match=r"actor\.lora"):
        load_checkpoint(TrainEngine(other, chunk_size=64), tmp_path / "a", 0)
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters .* actor\.lora\.rank"):
        load_checkpoint(TrainEngine(load_causal_lm(model), chunk_size=64), tmp_path / "a", 0)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.lora.rank=-1", r"actor\.lora\.rank"),
        ("actor.lora.alpha=0", r"actor\.lora\.alpha"),
        ("actor.lora.dropout=1", r"actor\.lora\.dropout"),
    ],
)
def test_bad_lora_values_are_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, [override])
    assert len(str(e.value).splitlines()) == 1


def test_an_adapter_on_the_output_head_is_refused_by_name(tiny_task):
    """Log-probs come from the head's weight (chunked), past an adapter on it: it never
    trained, in silence (and the tiny model's head is its embedding, gathered once). The config
    refuses ``lm_head``; the model's own head under another name is refused at start-up."""
    with pytest.raises(ConfigError, match=r"target_modules: 'lm_head' is the output head, whose"):
        load_config(None, ["actor.lora.rank=4", "actor.lora.target_modules=[q_proj, lm_head]"])
    model = load_causal_lm(tiny_task["model"])
    lora = LoraConfig.model_construct(rank=4, alpha=8.0, dropout=0.0, target_modules=["lm_head"])
    with pytest.raises(ConfigError, match=r"^actor\.lora\.target_modules: 'lm_head' is the output"):
        apply_lora(model, lora, "m")


def test_adapters_whose_base_weight_never_comes_are_an_error():
    from treadle.engines.lora import merged_lora

    prefix = "base_model.model."
    state = [
        (f"{prefix}lm_head.lora_A.default.weight", torch.ones(2, 3)),
        (f"{prefix}lm_head.lora_B.default.weight", torch.ones(3, 2)),
        (f"{prefix}model.norm.weight", torch.ones(3)),
    ]
    with pytest.raises(RuntimeError, match=r"without their base weight: \['lm_head'\]"):
        list(merged_lora(iter(state), {"lm_head": 2.0}))


def test_an_unknown_target_module_names_the_key_and_the_model_layers(tiny_task):
    model = load_causal_lm(tiny_task["model"])
    lora = LoraConfig(rank=4, target_modules=["q_proj", "qkv"])
    with pytest.raises(ConfigError) as e:
        apply_lora(model, lora, tiny_task["model"])
    assert str(e.value).startswith("actor.lora.target_modules: 'qkv' is not a linear layer")
    assert "q_proj, up_proj, v_proj" in str(e.value)
    # a string but 'all-linear' is the schema's to refuse (treadle check says it first)
    with pytest.raises(ConfigError, match=r"actor\.lora\.target_modules: .linear. is neither"):
        load_config(None, ["actor.lora.rank=4", "actor.lora.target_modules=linear"])


@pytest.mark.slow
def test_grpo_with_lora_resumes_like_a_straight_run_and_exports_merged_and_adapter(
    tiny_task, length_reward, tmp_path
):
    from transformers import AutoModelForCausalLM

    from treadle.tracking.tracker import read_metrics
    from treadle.trainers.rl import train

    def run(out, steps: int) -> None:
        overrides = tiny_runs.overrides(
            tiny_task,
            out,
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=8",
            f"reward.function={length_reward}",
            "algorithm.kl_coef=0.01",
            "actor.lr=1e-2",
            "actor.micro_batch_size=4",
            "actor.lora.rank=4",
            "actor.lora.alpha=8",
            "trainer.backend=local",
            f"trainer.total_steps={steps}",
            "trainer.save_every=1",
            samples=4,
        )
        train(load_config(None, overrides))

    def weights(folder) -> dict[str, torch.Tensor]:
        return load_file(str(folder / "model.safetensors"))

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, 2)
    run(resumed, 1)
    run(resumed, 2)
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in b] == [1, 2]
    for key in ("reward/mean", "actor/pg_loss", "actor/kl", "response/length_mean"):
        assert b[-1][key] == pytest.approx(a[-1][key], rel=1e-5, abs=1e-7), key
    assert a[-1]["actor/kl"] > 0  # the reference (adapters off) differs from the actor

    ckpt = resumed / "checkpoints" / "step_2"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["adapter"]
    final = straight / "final_model"
    base, merged = weights(tiny_task["model"]), weights(final)
    assert merged.keys() == base.keys()
    assert {k for k in base if not torch.equal(base[k], merged[k])} == {
        k for k in base if k.endswith("proj.weight")
    }
    loaded = AutoModelForCausalLM.from_pretrained(final).state_dict()
    adapter = PeftModel.from_pretrained(load_causal_lm(tiny_task["model"]), str(final / "adapter"))
    for k, v in adapter.merge_and_unload().state_dict().items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=1e-6)
    other = weights(resumed / "final_model")
    for k, v in merged.items():
        torch.testing.assert_close(other[k], v, rtol=1e-5, atol=1e-6)


def test_a_lora_checkpoint_as_model_path_says_to_use_final_model(tmp_path):
    from treadle.models.loading import resolve_model_path

    (tmp_path / "step_2" / "adapter").mkdir(parents=True)
    want = r"model\.path: .*step_2' is a LoRA checkpoint .*final_model"
    with pytest.raises(ConfigError, match=want):
        resolve_model_path(tmp_path / "step_2")


def test_a_model_with_transposed_conv1d_weights_is_refused_naming_the_key(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with (
        pytest.raises(ConfigError, match=r"actor\.lora: .*Conv1D"),
        pytest.warns(UserWarning, match="fan_in_fan_out"),  # peft's, on Conv1D
    ):
        apply_lora(model, LoraConfig(rank=2), tmp_path)


def test_the_reward_model_trainer_refuses_lora_naming_the_key(tiny_task, one_rank):
    from treadle.workers.reward_model import RewardTrainerWorker

    cfg = load_config(None, [f"model.path={tiny_task['model']}", "actor.lora.rank=4"])
    with pytest.raises(ConfigError, match=r"^actor\.lora\.rank=4: treadle rm trains the whole"):
        RewardTrainerWorker(0, 1, "127.0.0.1", 0, config=cfg, model_path=str(tiny_task["model"]))
