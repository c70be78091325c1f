"""Value models (critic, reward model): load from a causal LM, the value head, save and reload."""

from __future__ import annotations

import json

import pytest
import torch
from test_fsdp import make_batch, two_seconds
from tiny_models import tiny_family

from treadle.controller import Collect, Dispatch, Worker, WorkerGroup, register
from treadle.engines.fsdp import TrainEngine
from treadle.engines.value import ValueHead, last_token_values
from treadle.models.loading import load_tokenizer, load_value_model, save_hf_folder, value_class
from treadle.protocol import Batch


class ValueWorker(Worker):
    def __init__(self, rank, world_size, addr, port, *, model_path: str) -> None:
        super().__init__(rank, world_size, addr, port)
        self.model_path = model_path
        self.engine = TrainEngine(
            load_value_model(model_path), chunk_size=4, lr=1e-2, head=ValueHead
        )

    @register(Dispatch.DP, Collect.CONCAT)
    def values(self, batch: Batch) -> Batch:
        with torch.no_grad():
            v = self.engine.module(batch["input_ids"], batch["attention_mask"], 6)
        return Batch.from_dict(tensors={"values": v})

    @register(Dispatch.DP, Collect.RANK0)
    def fit_to(self, batch: Batch, target: float) -> float:
        for _ in range(20):
            v = self.engine.module(batch["input_ids"], batch["attention_mask"], 6)
            loss = ((v - target) ** 2 * batch["rmask"]).sum() / batch["rmask"].sum()
            loss.backward()
            self.engine.step()
        return float(loss)

    @register(Dispatch.ALL, Collect.RANK0)
    def timed_step(self, batch: Batch) -> dict[str, float]:
        """One ``train_step`` of a value loss, on a clock that says 2 s went by."""

        def loss_fn(mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            v = self.engine.module(mb["input_ids"], mb["attention_mask"], 6)
            return ((v - 1.0) ** 2 * mb["rmask"]).sum() / mb["rmask"].sum(), {}

        with two_seconds():
            return self.engine.train_step(batch.split(2), loss_fn, prefix="critic/")

    @register(Dispatch.ALL, Collect.RANK0)
    def save(self, out: str) -> None:
        state = {n: t.clone() for n, t in self.engine.full_state()}
        tok = load_tokenizer(self.model_path)
        save_hf_folder(state, self.engine.module.lm.config, tok, out)


@pytest.mark.parametrize(
    ("family", "architecture"),
    [
        ("qwen2", "Qwen2ForTokenClassification"),
        ("olmo2", "Olmo2ForTokenClassification"),
        ("qwen3_5_text", "Qwen3_5ForTokenClassification"),
    ],
)
def test_value_model_starts_at_zero_trains_saves_and_reloads(
    family, architecture, tiny_task, tmp_path
):
    """From the tiny task's Qwen2, and from two families transformers has no token
    classification of (OLMo 2; Qwen3.5, whose pretrained-model class is its vision-language
    model's: loaded through it, a critic built the whole default VLM until memory ran out)."""
    batch = make_batch(vocab=100)
    model = tiny_task["model"]
    if family != "qwen2":
        model = tiny_family(tmp_path / family, tiny_task["model"], family)
    kwargs = {"model_path": str(model)}
    group = WorkerGroup(ValueWorker, world_size=1, backend="local", kwargs=kwargs)
    try:
        assert torch.equal(group.values(batch)["values"], torch.zeros(4, 6))  # new head = 0
        loss = group.fit_to(batch, 1.5)
        trained = group.values(batch)["values"]
        group.save(str(tmp_path / "vm"))
    finally:
        group.shutdown()
    assert loss < 0.05
    assert (trained[batch["rmask"].bool()] - 1.5).abs().mean() < 0.25
    config = json.loads((tmp_path / "vm" / "config.json").read_text())
    assert config["architectures"] == [architecture]
    # The saved folder is a value model: reloaded, it gives the trained values.
    kwargs = {"model_path": str(tmp_path / "vm")}
    group = WorkerGroup(ValueWorker, world_size=1, backend="local", kwargs=kwargs)
    try:
        torch.testing.assert_close(group.values(batch)["values"], trained, atol=1e-5, rtol=1e-5)
    finally:
        group.shutdown()


def test_a_made_value_model_keeps_the_family_s_decoder_prefix_and_name(tmp_path):
    """GPT-J's checkpoints hold its decoder as ``transformer``, not ``model``: a value model
    made with the wrong prefix found none of it. Gemma 3's causal LM is its vision-language
    model's ``ForConditionalGeneration``: the name comes from the pretrained-model class, so a
    saved critic's architecture ends as a value model's must."""
    from transformers import Gemma3Config, GPTJConfig, GPTJForCausalLM

    made = value_class(GPTJConfig)
    assert (made.__name__, made.base_model_prefix) == ("GPTJForTokenClassification", "transformer")
    assert value_class(Gemma3Config).__name__ == "Gemma3ForTokenClassification"
    config = GPTJConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64)
    torch.manual_seed(0)
    lm = GPTJForCausalLM(config)
    lm.save_pretrained(tmp_path)
    value = load_value_model(tmp_path)  # (a decoder weight missing is a ConfigError)
    assert torch.equal(
        value.transformer.h[1].mlp.fc_in.weight, lm.transformer.h[1].mlp.fc_in.weight
    )
    assert value.config.architectures == ["GPTJForTokenClassification"]


def test_last_token_values_padded_and_packed_equal_a_plain_forward(tiny_task):
    torch.manual_seed(0)
    model = load_value_model(tiny_task["model"])
    with torch.no_grad():
        model.score.weight.normal_()
    batch = make_batch(vocab=100)  # left-padded prompts; some responses right-padded, some full
    ids, mask = batch["input_ids"], batch["attention_mask"]
    want = []
    with torch.no_grad():
        for row, m in zip(ids, mask, strict=True):
            want.append(model(input_ids=row[m.bool()][None]).logits[0, -1, 0])
        for row_tokens in (None, 16):
            got = last_token_values(ValueHead(model, row_tokens), ids, mask)
            torch.testing.assert_close(got, torch.stack(want), atol=1e-5, rtol=1e-5)


def test_a_value_model_s_update_rate_counts_a_one_output_head(tiny_task):
    """``perf/tflops/critic``: the batch's rows (9, 8, 10, 10 tokens, two micro-batches) by
    treadle's count with a head of one output, not the vocabulary, over 2 s."""
    from transformers import AutoConfig

    from treadle.engines.flops import update_flops

    path = str(tiny_task["model"])
    group = WorkerGroup(ValueWorker, world_size=1, backend="local", kwargs={"model_path": path})
    try:
        got = group.timed_step(make_batch(vocab=100))
    finally:
        group.shutdown()
    config = AutoConfig.from_pretrained(path)
    want = update_flops(config, 37, 345, head_outputs=1) / 2 / 1e12
    assert got["perf/tflops/critic"] == pytest.approx(want, rel=1e-12)
    assert want < update_flops(config, 37, 345) / 2 / 1e12
