"""No compute on padding: packed rows, token-budget micro-batches, balanced ranks.

Every path is checked against a plain padded computation written here: a Hugging Face forward
on the padded batch, full-vocabulary float32 log-softmax, the PPO-clip loss by hand.
"""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest
import torch
from tiny_models import random_lm

from treadle.config import load_config
from treadle.controller import Collect, Dispatch, Worker, WorkerGroup, register
from treadle.engines.fsdp import TrainEngine, packed_row_tokens
from treadle.engines.heads import LogProbHead, LogProbRequest, PairTerm
from treadle.engines.packing import (
    balance_ranks,
    balanced_order,
    first_fit_decreasing,
    label_positions,
    pack,
    scatter_labels,
    token_micro_batches,
)
from treadle.engines.value import ValueHead
from treadle.models.folders import UNPACKED_MODELS, packing_problem, row_state_layers
from treadle.models.loading import load_causal_lm, load_value_model
from treadle.protocol import Batch
from treadle.runtime.errors import ConfigError
from treadle.workers import ActorRolloutRefWorker, micro_batches
from treadle.workers.objectives import PolicyGradient, optimizer_step

# ----------------------------------------------------------------------------- pure functions


def test_first_fit_decreasing_fills_groups_longest_first():
    assert first_fit_decreasing([3, 8, 5, 2, 12], capacity=10) == [[4], [1, 3], [2, 0]]


def test_token_micro_batches_respect_the_budget_and_reach_the_count():
    lengths = [3, 8, 5, 2, 6, 1]
    assert token_micro_batches(lengths, budget=10) == [[1, 3], [4, 0, 5], [2]]
    groups = token_micro_batches(lengths, budget=10, count=5)
    assert len(groups) == 5
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(sum(lengths[i] for i in g) <= 10 for g in groups)
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert loads == sorted(loads, reverse=True)
    with pytest.raises(ValueError, match="cannot make 2 micro-batches of 6 samples"):
        token_micro_batches(lengths, budget=10, count=2)


def test_balanced_order_gives_equal_sized_parts_of_similar_tokens():
    lengths = [100, 90, 10, 5, 80, 20]
    order = balanced_order(lengths, 2)
    assert sorted(order) == list(range(6))
    # Greedy: 100 -> A, 90 -> B, 80 -> B, 20 -> A, 10 -> A (now full), 5 -> B.
    assert order == [0, 2, 5, 1, 3, 4]  # 130 and 175 tokens (the input order: 200 and 105)
    assert balanced_order(lengths, 1) == list(range(6))
    with pytest.raises(ValueError, match="5 samples cannot be cut into 2 equal parts"):
        balanced_order(lengths[:5], 2)


def test_balance_ranks_reorders_whole_samples():
    lengths = torch.tensor([9, 8, 2, 1])
    batch = Batch.from_dict(
        tensors={
            "prompt_mask": torch.ones(4, 1, dtype=torch.long),
            "response_mask": (torch.arange(9)[None] < lengths[:, None] - 1).long(),
        },
        objects={"uid": ["a", "b", "c", "d"]},
    )
    out = balance_ranks(batch, 2)
    assert list(out["uid"]) == ["a", "d", "b", "c"]  # 9 + 1 against 8 + 2
    torch.testing.assert_close(out["response_mask"], batch["response_mask"][[0, 3, 1, 2]])


def test_pack_lays_valid_tokens_in_rows_with_restarting_positions():
    # Left-padded prompt + right-padded response, lengths 3, 4 and 2 (pad id 0).
    ids = torch.tensor([[0, 11, 12, 13, 0], [21, 22, 23, 24, 0], [0, 0, 31, 32, 0]])
    mask = (ids != 0).long()
    where = label_positions(mask, num_labels=2)
    assert where.tolist() == [[True, False], [True, False], [True, False]]
    layout = pack(ids, mask, where, row_tokens=5, pad_id=-1)
    # First fit, longest first: [seq 1], [seq 0, seq 2] in rows of width 5.
    assert layout.input_ids.tolist() == [[21, 22, 23, 24, -1], [11, 12, 13, 31, 32]]
    # The filler after a row's last sequence goes on counting its positions.
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    # Label (row b, column 3) is predicted by the state of column 2 of row b.
    assert layout.gather.tolist() == [6, 2, 8]
    values = scatter_labels(torch.tensor([1.0, 2.0, 3.0]), where)
    assert values.tolist() == [[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]


def test_the_model_width_weighs_attention_against_padding():
    # Lengths 6, 2, 2, 2, 2, 2, rows of at most 12. By positions alone (no hidden size) the
    # end capacities give 3 rows x 6 = 18 ([6], [2, 2, 2], [2, 2]) against 2 x 12 = 24.
    # With hidden size h a position costs 3h + width: capacity 9 ([6, 2], [2, 2, 2, 2]: 2 rows
    # of 8) costs 308 x 16 = 4928 for h = 100, under 306 x 18 = 5508 and 312 x 24 = 7488.
    ids = torch.tensor([[1] * 6] + [[0, 0, 0, 0, 5, 5]] * 5)
    mask = (ids != 0).long()
    where = label_positions(mask, 1)
    assert pack(ids, mask, where, row_tokens=12).input_ids.shape == (3, 6)
    assert pack(ids, mask, where, row_tokens=12, hidden_size=100).input_ids.shape == (2, 8)


def test_rows_of_one_sequence_need_no_attention_mask():
    from transformers.masking_utils import find_packed_sequence_indices

    # Lengths 4, 3 and 2 one a row (width 4): transformers sees one run of positions a row,
    # so it attends causally without building a mask; rows holding two sequences need one.
    ids = torch.tensor([[0, 11, 12, 13, 14], [21, 22, 23, 0, 0], [0, 0, 31, 32, 0]])
    mask = (ids != 0).long()
    single = pack(ids, mask, label_positions(mask, 1), row_tokens=1)
    assert single.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert find_packed_sequence_indices(single.position_ids) is None
    two = pack(ids, mask, label_positions(mask, 1), row_tokens=5)
    assert two.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert find_packed_sequence_indices(two.position_ids) is not None


def test_pack_takes_the_capacity_with_fewer_row_positions():
    # Four sequences of 3 tokens: rows of 8 hold two each (2 rows x 6 = 12 positions, attention
    # over squares of 6); rows as long as the longest sequence hold one (4 x 3 = 12): the tie
    # goes to the narrower rows.
    ids = torch.arange(1, 13).view(4, 3)
    mask = torch.ones_like(ids)
    layout = pack(ids, mask, label_positions(mask, 1), row_tokens=8)
    assert layout.input_ids.shape == (4, 3)
    # Lengths 5, 3, 3, 3: one sequence a row is 4 x 5 = 20 positions; rows of 8 hold [5, 3]
    # and [3, 3]: 2 x 8 = 16.
    ids = torch.tensor([[1, 2, 3, 4, 5]] + [[0, 0, 6, 7, 8]] * 3)
    mask = (ids != 0).long()
    layout = pack(ids, mask, label_positions(mask, 1), row_tokens=8, pad_id=-1)
    assert layout.input_ids.tolist() == [
        [1, 2, 3, 4, 5, 6, 7, 8],
        [6, 7, 8, 6, 7, 8, -1, -1],
    ]


# ----------------------------------------------------------------------------- heads


def uneven_batch(vocab: int, n: int = 6, prompt: int = 7, response: int = 8, seed: int = 0):
    """Left-padded prompts and right-padded responses of different lengths, as in treadle."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(2, prompt + 1, (n,), generator=g)
    r_len = torch.randint(1, response + 1, (n,), generator=g)
    p_len[0], r_len[0] = prompt, response  # one full row: the padded width is needed
    pmask = (torch.arange(prompt)[None] >= (prompt - p_len)[:, None]).long()
    rmask = (torch.arange(response)[None] < r_len[:, None]).long()
    prompts = torch.randint(3, vocab, (n, prompt), generator=g) * pmask
    responses = torch.randint(3, vocab, (n, response), generator=g) * rmask
    return Batch.from_dict(
        tensors={
            "prompts": prompts,
            "prompt_mask": pmask,
            "responses": responses,
            "response_mask": rmask,
            "old_log_probs": -torch.rand(n, response, generator=g) * 2 - 4.5,
            "advantages": torch.randn(n, response, generator=g),
        },
        meta={"step": 1},
    )


def joined(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([batch["prompts"], batch["responses"]], 1)
    return ids, torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)


def plain_log_probs(model, ids, mask, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    logp_all = torch.log_softmax(logits[:, -r - 1 : -1], -1)
    logp = logp_all.gather(-1, ids[:, -r:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def grads_of(module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("lm."): p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("row_tokens", [1, 16, 1000])
def test_packed_log_probs_and_gradients_equal_the_padded_forward(tiny_task, row_tokens):
    path = str(tiny_task["model"])
    batch = uneven_batch(vocab=100)
    ids, mask = joined(batch)
    rmask = batch["response_mask"].bool()
    head = LogProbHead(load_causal_lm(path), chunk_size=5, row_tokens=row_tokens)
    out = head(LogProbRequest(ids, mask, 8))
    logp, ent = out.log_probs, out.entropy
    (logp * rmask).sum().backward()
    model = load_causal_lm(path)
    want_logp, want_ent = plain_log_probs(model, ids, mask, 8)
    (want_logp * rmask).sum().backward()
    torch.testing.assert_close(logp[rmask], want_logp[rmask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[rmask], want_ent[rmask], atol=1e-5, rtol=1e-5)
    assert (logp[~rmask] == 0).all()  # no head compute on padding
    got, want = grads_of(head), grads_of(model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4)
    rows = pack(ids, mask, label_positions(mask, 8), row_tokens).input_ids.shape[0]
    assert rows > 1 if row_tokens < 1000 else rows == 1  # 1000: all six sequences in a row


def test_packing_with_16_token_rows_puts_several_sequences_in_a_row(tiny_task):
    ids, mask = joined(uneven_batch(vocab=100))
    rows = pack(ids, mask, label_positions(mask, 8), 16).input_ids.shape[0]
    assert rows < 6 and int(mask.sum()) <= 16 * rows


class ForwardWorker(Worker):
    def __init__(self, rank, world_size, addr, port, *, model_path: str, **options) -> None:
        super().__init__(rank, world_size, addr, port)
        self.engine = TrainEngine(load_causal_lm(model_path), chunk_size=4, **options)

    @register(Dispatch.ALL, Collect.RANK0)
    def log_probs(self, ids: torch.Tensor, mask: torch.Tensor, r: int) -> torch.Tensor:
        with torch.no_grad():
            return self.engine.log_probs(ids, mask, r)[0]


@pytest.mark.parametrize(
    ("arch", "changes", "why"),
    [
        ("qwen3_next", {}, "its 'linear_attention' layers carry a state along the sequence"),
        ("lfm2", {"layer_types": ["conv", "full_attention"], "initializer_range": 0.5}, "its .c"),
        ("gpt_oss", {"attn": "eager"}, r"its attention mask \(gpt_oss\) ignores where packed"),
    ],
    ids=["qwen3_next", "lfm2", "gpt_oss"],
)
def test_a_model_whose_packed_sequences_would_meet_is_not_packed(arch, changes, why, tmp_path):
    """A linear attention's recurrence (Qwen3-Next, Qwen3.5) or a convolution (LFM2) runs
    along a packed row, and gpt-oss builds one causal mask over the whole row: a sequence saw
    the ones before it (Qwen3-Next's log-probs off by up to 0.2). The engine's forwards run on
    the padded batch instead, and give each sequence's own log-probs."""
    model = random_lm(arch, **changes)
    assert re.match(why, packing_problem(model.config) or "")
    model.save_pretrained(tmp_path)
    batch = uneven_batch(vocab=64)
    ids, mask = joined(batch)
    rmask = batch["response_mask"].bool()
    with torch.no_grad():  # the truth: each sequence alone, without padding
        alone = [model(ids[i][mask[i].bool()][None]).logits[0].float() for i in range(len(ids))]
    want = torch.zeros(rmask.shape)
    for i, logits in enumerate(alone):
        n = int(rmask[i].sum())
        logp = torch.log_softmax(logits[-n - 1 : -1], -1)
        want[i, :n] = logp.gather(-1, batch["responses"][i, :n, None])[:, 0]
    options = {"row_tokens": 1000, "share_prompts": True}
    kwargs = {"model_path": str(tmp_path), **options}
    group = WorkerGroup(ForwardWorker, world_size=1, backend="local", kwargs=kwargs)
    try:
        got = group.log_probs(ids, mask, 8)
    finally:
        group.shutdown()
    torch.testing.assert_close(got[rmask], want[rmask], atol=1e-5, rtol=1e-5)
    rows = pack(ids, mask, label_positions(mask, 8), 1000).input_ids.shape[0]
    assert rows == 1  # packed, all six sequences would have shared a row


@pytest.mark.parametrize(
    "arch",
    ["llama", "qwen2", "mistral", "phi3", "olmo2", "gemma3_text", "gpt_oss", "opt", "bloom", "mpt"],
)
def test_the_decoders_listed_unpacked_are_those_whose_masks_mix_packed_sequences(arch):
    """`UNPACKED_MODELS` against transformers itself: a row of two sequences marked by their
    position ids, the second one's logits against it alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64}
    sizes |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    sizes |= {"max_position_embeddings": 64, "pad_token_id": 0}
    config = AutoConfig.for_model(arch, **sizes)
    attention = "eager" if arch in ("gpt_oss", "bloom", "mpt") else "sdpa"  # (their only one)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    ids = torch.randint(3, 60, (1, 11))
    with torch.no_grad():
        positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]])
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, 4:]
        alone = model(input_ids=ids[:, 4:], use_cache=False).logits
    mixed = (packed - alone).abs().max().item() > 1e-4
    assert mixed == (arch in UNPACKED_MODELS)
    assert mixed == (packing_problem(config) is not None)


def test_sequence_parallel_keeps_the_rows_its_attention_splits_into_sequences_itself():
    """gpt-oss's mask mixes packed sequences, sequence parallel's attention never reads it."""
    gpt_oss, split = random_lm("gpt_oss", attn="eager").config, SimpleNamespace(sp_group=1)
    assert packed_row_tokens(gpt_oss, 256, None, "actor") is None
    assert packed_row_tokens(gpt_oss, 256, split, "actor") == 256
    assert packed_row_tokens(random_lm("llama").config, 256, None, "actor") == 256
    with pytest.raises(ConfigError, match=r"^critic\.sequence_parallel_size > 1 splits packed"):
        packed_row_tokens(gpt_oss, None, split, "critic")  # (the padded batch: no rows to split)


def test_a_decoder_of_attention_alone_packs():
    assert row_state_layers(random_lm("qwen3").config) is None
    assert row_state_layers(random_lm("gemma2").config) is None  # (sliding attention)
    assert row_state_layers({"model_type": "rwkv"}) == "rwkv"  # (no layer types)
    # Jamba's layer types are a property: its config.json and to_dict() have none
    from transformers import JambaConfig

    jamba = JambaConfig(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1)
    assert row_state_layers(jamba) == "linear_attention"
    assert row_state_layers(jamba.to_dict()) == "jamba"
    assert row_state_layers({"model_type": "lfm2", "layer_types": ["full_attention"]}) is None
    vlm = {"model_type": "qwen3_5", "text_config": {"layer_types": ["full_attention", "conv"]}}
    assert row_state_layers(vlm) == "conv"


def test_sequence_parallel_and_the_paged_cache_refuse_a_state_along_the_sequence(
    tiny_task, tmp_path
):
    """Sequence parallel splits each sequence over ranks, and transformers' paged cache holds
    attention keys and values only ("Invalid layer type: linear_attention" mid-rollout)."""
    from treadle.config.rules import parallel_model_problems
    from treadle.models.loading import load_tokenizer, save_tokenizer
    from treadle.serving.replica import make_engine

    model = random_lm("qwen3_next")
    assert list(parallel_model_problems("actor", 1, 2, model.config.to_dict())) == [
        "actor.sequence_parallel_size=2: the model's 'linear_attention' layers carry a state "
        "along the sequence, which sequence parallel splits over ranks: set it to 1"
    ]
    assert list(parallel_model_problems("actor", 2, 1, model.config.to_dict())) == []
    model.save_pretrained(tmp_path)
    save_tokenizer(load_tokenizer(tiny_task["model"]), tmp_path)
    cfg = load_config(None, [f"model.path={tmp_path}", "rollout.cache_implementation=paged"])
    with pytest.raises(ConfigError, match=r"^rollout\.cache_implementation=paged: .*'linear_"):
        make_engine(cfg, str(tmp_path), torch.device("cpu"))


def test_packed_values_equal_padded_values(tiny_task):
    path = str(tiny_task["model"])
    batch = uneven_batch(vocab=100)
    ids, mask = joined(batch)
    lm = load_value_model(path)
    torch.nn.init.normal_(lm.score.weight)  # a zero head would make every value equal
    padded = ValueHead(lm)(ids, mask, 8)
    packed = ValueHead(lm, row_tokens=20)(ids, mask, 8)
    rmask = batch["response_mask"].bool()
    assert padded[rmask].abs().min() > 0
    torch.testing.assert_close(packed, padded * rmask, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- worker updates


def plain_ppo_update(path: str, batch: Batch, mode: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The padded reference: full forward, PPO-clip (0.2) on response tokens, one backward."""
    model = load_causal_lm(path)
    ids, mask = joined(batch)
    r = batch["responses"].shape[1]
    logp, _ = plain_log_probs(model, ids, mask, r)
    m = batch["response_mask"].float()
    ratio = torch.exp(logp - batch["old_log_probs"])
    adv = batch["advantages"]
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * m
    # token-mean, or else seq-mean-token-mean
    loss = pg.sum() / m.sum() if mode == "token-mean" else (pg.sum(1) / m.sum(1)).mean()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


class GradActor(ActorRolloutRefWorker):
    """The real worker; ``actor.step`` is replaced to hand back the gradients it would apply."""

    def _capture(self) -> dict[str, torch.Tensor]:
        grads: dict[str, torch.Tensor] = {}

        def step() -> dict[str, float]:
            for n, p in self.actor.module.named_parameters():
                grads[n.removeprefix("lm.")] = p.grad.full_tensor().to("cpu", copy=True)
            self.actor.optimizer.zero_grad(set_to_none=True)
            return {"grad_norm": 0.0, "lr": 0.0}

        self.actor.step = step
        return grads

    @register(Dispatch.DP, Collect.LIST)
    def update_grads(self, batch: Batch, mode: str) -> tuple[dict[str, float], dict, int]:
        """The step's metrics, its gradients, and the micro-batches of the whole batch."""
        self.cfg.algorithm.loss_agg_mode = mode
        grads = self._capture()
        lengths = batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)
        count = len(micro_batches(batch, self.cfg.actor, lengths))
        metrics, _ = optimizer_step(self.engine, PolicyGradient(self.policy()), batch)
        return metrics, grads, count

    @register(Dispatch.DP, Collect.RANK0)
    def sft_grads(self, batch: Batch) -> tuple[float, dict]:
        grads = self._capture()
        return self.train_sft(batch)["sft/loss"], grads


def actor_config(path: str, *overrides: str):
    return load_config(
        None,
        [
            f"model.path={path}",
            "algorithm.kl_coef=0",
            "rollout.n=1",
            "data.batch_size=6",
            "actor.ppo_mini_batch_size=6",
            "actor.micro_batch_size=4",
            "trainer.threads_per_rank=1",
            *overrides,
        ],
    )


def local_actor(path: str, *overrides: str) -> WorkerGroup:
    cfg = actor_config(path, "trainer.backend=local", *overrides)
    kwargs = {"config": cfg, "actor_path": path, "with_ref": False}
    return WorkerGroup(GradActor, world_size=1, backend="local", kwargs=kwargs)


def assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in want.values())


@pytest.mark.parametrize(
    "overrides",
    [
        ("actor.remove_padding=false",),
        ("actor.pack_row_tokens=24", "actor.max_tokens_per_micro_batch=30"),
    ],
    ids=["padded", "packed+token-budget"],
)
def test_update_gives_the_plain_padded_loss_and_gradients(tiny_task, overrides):
    path = str(tiny_task["model"])
    batch = uneven_batch(vocab=100)
    group = local_actor(path, *overrides)
    try:
        for mode in ("token-mean", "seq-mean-token-mean"):
            [(metrics, grads, micros)] = group.update_grads(batch, mode)
            want_loss, want_grads = plain_ppo_update(path, batch, mode)
            assert metrics["actor/pg_loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
            assert metrics["actor/rows_skipped"] == 0.0
            assert_same_grads(grads, want_grads)
            assert micros == (2 if "actor.remove_padding=false" in overrides else 3)
        # old log-probs: micro-batches in budget order come back in the batch's order
        out = group.compute_log_probs(batch)
        squares = group.compute_log_probs(batch, sum_pi_squared=True)  # asked for, not flagged
    finally:
        group.shutdown()
    ids, mask = joined(batch)
    with torch.no_grad():
        want, want_ent = plain_log_probs(load_causal_lm(path), ids, mask, 8)
    rmask = batch["response_mask"].bool()
    torch.testing.assert_close(out["old_log_probs"][rmask], want[rmask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["entropy"][rmask], want_ent[rmask], atol=1e-5, rtol=1e-5)
    assert sorted(out.keys()) == ["entropy", "old_log_probs"]
    assert sorted(squares.keys()) == ["entropy", "old_log_probs", "sum_pi_squared"]
    torch.testing.assert_close(squares["old_log_probs"], out["old_log_probs"])
    assert (squares["sum_pi_squared"][rmask] > 0).all() and (squares["sum_pi_squared"] <= 1).all()


def test_rows_without_advantage_are_left_out_with_the_same_loss_and_gradients(tiny_task):
    """Three of six rows with all-zero advantages (equal-reward groups): the update computes
    the other three, and its loss and gradients are the whole batch's."""
    path = str(tiny_task["model"])
    batch = uneven_batch(vocab=100)
    batch["advantages"][[1, 2, 4]] = 0.0
    batch["advantages"][3, 1:] = 0.0  # one advantage left in a row: the row counts
    group = local_actor(path, "actor.pack_row_tokens=24", "actor.max_tokens_per_micro_batch=30")
    try:
        for mode in ("token-mean", "seq-mean-token-mean"):
            [(metrics, grads, _)] = group.update_grads(batch, mode)
            want_loss, want_grads = plain_ppo_update(path, batch, mode)
            assert metrics["actor/rows_skipped"] == 0.5
            assert metrics["actor/pg_loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
            assert_same_grads(grads, want_grads)
    finally:
        group.shutdown()
    # actor/entropy, in the last update's mode (seq-mean-token-mean), is over the rows computed
    ids, mask = joined(batch)
    with torch.no_grad():
        _, ent = plain_log_probs(load_causal_lm(path), ids, mask, 8)
    live = batch["response_mask"][[0, 3, 5]].float()
    want_entropy = ((ent[[0, 3, 5]] * live).sum(1) / live.sum(1)).mean()
    assert metrics["actor/entropy"] == pytest.approx(float(want_entropy), rel=1e-5)


@pytest.mark.parametrize(
    "overrides, skips",
    [
        ((), True),
        (("algorithm.policy_loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean"), True),
        (("actor.skip_zero_advantage=false",), False),
        (("algorithm.kl_coef=0.01",), False),  # the KL loss has a gradient on every row
        (("algorithm.entropy_coef=0.01",), False),
        (("algorithm.policy_loss=dro", "algorithm.dro_beta=0.1"), False),
        (("algorithm.policy_loss=kl_cov",), False),  # batch covariance
    ],
)
def test_rows_are_left_out_only_where_they_add_nothing(tiny_task, overrides, skips):
    from treadle.workers.objectives import skips_zero_advantage

    assert skips_zero_advantage(actor_config(str(tiny_task["model"]), *overrides)) is skips


def test_sft_update_gives_the_plain_loss_and_gradients(tiny_task):
    path = str(tiny_task["model"])
    rl = uneven_batch(vocab=100)
    ids, mask = joined(rl)
    # SFT layout: right-padded, loss on the response tokens only.
    order = (1 - mask).argsort(dim=1, stable=True)
    ids, mask = ids.gather(1, order), mask.gather(1, order)
    loss_mask = torch.cat([torch.zeros_like(rl["prompt_mask"]), rl["response_mask"]], 1)
    loss_mask = loss_mask.gather(1, order)
    batch = Batch.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
    )
    group = local_actor(path, "actor.pack_row_tokens=24", "actor.max_tokens_per_micro_batch=30")
    try:
        loss, grads = group.sft_grads(batch)
    finally:
        group.shutdown()
    model = load_causal_lm(path)
    logp, _ = plain_log_probs(model, ids, mask, ids.shape[1] - 1)
    lm = loss_mask[:, 1:].float()
    want = -(logp * lm).sum() / lm.sum()
    want.backward()
    assert loss == pytest.approx(float(want.detach()), rel=1e-5)
    assert_same_grads(grads, {n: p.grad for n, p in model.named_parameters()})


@pytest.mark.slow
def test_two_ranks_with_token_budgets_match_the_plain_update(tiny_task, ray_session):
    """Rank 0 gets the long samples and needs more micro-batches: both must run as many."""
    from ray import cloudpickle

    from treadle.controller import ResourcePool

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    path = str(tiny_task["model"])
    batch = uneven_batch(vocab=100, n=8, seed=3)
    lengths = batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)
    batch = batch.select(lengths.argsort(descending=True))  # unbalanced on purpose
    cfg = actor_config(
        path,
        "actor.world_size=2",
        "data.batch_size=8",
        "actor.ppo_mini_batch_size=8",
        "actor.pack_row_tokens=24",
        "actor.max_tokens_per_micro_batch=30",
    )
    pool = ResourcePool(world_size=2, cpus_per_rank=1.0)
    kwargs = {"config": cfg, "actor_path": path, "with_ref": False}
    group = WorkerGroup(GradActor, world_size=2, backend="ray", pool=pool, kwargs=kwargs)
    # one row with an advantage: a rank has none, and still runs its passes (no hang)
    one_live = batch.select(torch.arange(len(batch)))
    one_live["advantages"][1:] = 0.0
    try:
        for rows, mode in [
            (batch, "token-mean"),
            (batch, "seq-mean-token-mean"),
            (one_live, "token-mean"),
        ]:
            results = group.update_grads(rows, mode)
            want_loss, want_grads = plain_ppo_update(path, rows, mode)
            (m0, grads0, n0), (m1, _, n1) = results
            loss = (m0["actor/pg_loss"] + m1["actor/pg_loss"]) / 2
            assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
            assert_same_grads(grads0, want_grads)
            assert n0 == n1
            # every rank computes the most live rows any has: 1 of 4 each
            assert m0["actor/rows_skipped"] == (0.75 if rows is one_live else 0.0)
    finally:
        group.shutdown()
        pool.remove()


def test_bf16_mixed_precision_keeps_float32_parameters_and_log_probs(tiny_task):
    path = str(tiny_task["model"])
    batch = uneven_batch(vocab=100)
    group = local_actor(path, "actor.mixed_precision=bf16")
    try:
        out = group.compute_log_probs(batch)
        [(_, grads, _)] = group.update_grads(batch, "token-mean")
        [worker] = group.workers
        dtypes = {p.dtype for p in worker.actor.module.parameters()}
    finally:
        group.shutdown()
    ids, mask = joined(batch)
    with torch.no_grad():
        want, _ = plain_log_probs(load_causal_lm(path), ids, mask, 8)
    rmask = batch["response_mask"].bool()
    assert out["old_log_probs"].dtype == torch.float32 and dtypes == {torch.float32}
    diff = (out["old_log_probs"] - want)[rmask].abs()
    assert 0 < diff.max() < 0.05  # computed in bfloat16 (not exact), close to float32
    _, want_grads = plain_ppo_update(path, batch, "token-mean")
    for name, value in want_grads.items():
        assert grads[name].dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(grads[name].flatten(), value.flatten(), 0)
        assert cos > 0.99, name


def test_a_log_prob_request_names_the_fields_its_output_holds(tiny_task):
    """One head, one request record in, one output record out: Σπ² and the whole
    log-softmax come with the same log-probs and entropy, and a pair term against the
    model's own distribution (the exact KL to itself) is 0."""
    from treadle.algorithms.kl import kl_full

    head = LogProbHead(load_causal_lm(tiny_task["model"]), chunk_size=5, row_tokens=16)
    ids, mask = joined(uneven_batch(vocab=100))
    with torch.no_grad():
        plain = head(LogProbRequest(ids, mask, 8, 0.7))
        squares = head(LogProbRequest(ids, mask, 8, 0.7, sum_pi_squared=True))
        full = head(LogProbRequest(ids, mask, 8, 0.7, full_vocab=True))
    assert plain.sum_pi_squared is plain.full_log_softmax is plain.pair_term is None
    for out in (squares, full):
        torch.testing.assert_close(out.log_probs, plain.log_probs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.entropy, plain.entropy, atol=1e-5, rtol=1e-5)
    where = label_positions(mask, 8)
    assert squares.sum_pi_squared is not None and full.full_log_softmax is not None
    assert squares.sum_pi_squared[~where].eq(0).all() and squares.sum_pi_squared[where].gt(0).all()
    assert full.full_log_softmax.shape[0] == int(where.sum())
    pair = head(LogProbRequest(ids, mask, 8, 0.7, pair=PairTerm(full.full_log_softmax, kl_full)))
    assert pair.pair_term is not None and pair.pair_term.requires_grad
    torch.testing.assert_close(pair.pair_term, torch.zeros_like(pair.pair_term), atol=1e-5, rtol=0)
    torch.testing.assert_close(pair.log_probs.detach(), plain.log_probs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("row_tokens", [None, 16])
def test_a_micro_batch_without_labels_still_backpropagates(tiny_task, row_tokens):
    """Every response masked out (DAPO's truncation masking can do that to a micro-batch):
    the log-probs are all 0 but stay on the graph, so backward runs and gives zero gradients."""
    lm = load_causal_lm(tiny_task["model"])
    head = LogProbHead(lm, chunk_size=4, row_tokens=row_tokens)
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[:, 5:] = 0  # the 3 response columns are all padding
    logp = head(LogProbRequest(ids, mask, 3)).log_probs
    assert torch.equal(logp, torch.zeros(2, 3)) and logp.requires_grad
    logp.sum().backward()
    grads = [p.grad for p in lm.parameters()]
    assert all(g is not None and not g.any() for g in grads)
