"""A shared prompt computed once: the layout by hand, and the same log-probs and gradients as
the padded forward and the unshared packed one on a tiny random Llama (sdpa and eager)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_lm

from treadle.engines.heads import LogProbHead, LogProbRequest, can_share_prompts
from treadle.engines.packing import (
    PackedLayout,
    label_positions,
    pack,
    pack_shared,
    prompt_groups,
)
from treadle.protocol import Batch


def grouped_batch() -> Batch:
    """Three groups of identical prompts (5, 3 and 2 tokens: left-padded to 5) with responses
    of 1 to 4 tokens, and one row whose prompt no other row has."""
    prompts = [[11, 12, 13, 14, 15]] * 3 + [[21, 22, 23]] * 2 + [[31, 32]] * 2 + [[11, 12, 13, 14]]
    responses = [[40], [41, 42, 43, 44], [45, 46], [50, 51, 52], [53], [60, 61], [62, 63, 6]]
    responses.append([7, 8])
    p, r = 5, 4
    pmask = torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts])
    rmask = torch.tensor([[1] * len(x) + [0] * (r - len(x)) for x in responses])
    return Batch.from_dict(
        tensors={
            "prompts": torch.tensor([[0] * (p - len(x)) + x for x in prompts]),
            "prompt_mask": pmask,
            "responses": torch.tensor([x + [0] * (r - len(x)) for x in responses]),
            "response_mask": rmask,
        }
    )


def joined(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([batch["prompts"], batch["responses"]], 1)
    return ids, torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)


# ----------------------------------------------------------------------------- the layout


def test_prompt_groups_are_identical_valid_tokens_in_first_seen_order():
    batch = grouped_batch()
    assert prompt_groups(batch["prompts"], batch["prompt_mask"]) == [
        [0, 1, 2],
        [3, 4],
        [5, 6],
        [7],  # a prefix of group 0's prompt is another prompt
    ]
    empty = torch.zeros(2, 3, dtype=torch.long)
    assert prompt_groups(empty, empty) == [[0], [1]]  # no prompt: nothing to share


def test_the_shared_layout_of_two_groups_by_hand():
    # Group A: prompt [5, 6] (left-padded), responses [7, 8] and [9]; group B: prompt
    # [1, 2, 3], responses [4] and [5, 6]. Units: A = 2 + 3 tokens, B = 3 + 3 tokens.
    ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0], [1, 2, 3, 4, 0], [1, 2, 3, 5, 6]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    where = label_positions(mask, 2)
    layout = pack_shared(ids, mask, where, row_tokens=11, pad_id=-1)
    # One row of 11: B first (the longer unit), then A.
    assert layout.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9]]
    # Each response goes on counting its prompt's positions.
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 3, 4, 0, 1, 2, 3, 2]]
    # Labels in row-major order of where: row 0 (7, 8), row 1 (9), row 2 (4), row 3 (5, 6);
    # the first of each response is predicted by its prompt's last token (shared).
    assert layout.gather.tolist() == [7, 8, 7, 2, 2, 4]
    allowed = {(q, k) for q in range(11) for k in range(11) if layout.attention_mask[0, 0, q, k]}
    prompt_b, prompt_a = [0, 1, 2], [6, 7]
    want = {(q, k) for q in prompt_b for k in prompt_b if k <= q}
    want |= {(3, k) for k in [*prompt_b, 3]}  # B's first response
    want |= {(q, k) for q in [4, 5] for k in [*prompt_b, 4, 5] if k <= q}  # B's second
    want |= {(q, k) for q in prompt_a for k in prompt_a if k <= q}
    want |= {(q, k) for q in [8, 9] for k in [*prompt_a, 8, 9] if k <= q}  # A's first
    want |= {(10, k) for k in [*prompt_a, 10]}  # A's second
    assert allowed == want


def test_filler_attends_to_itself_only():
    ids = torch.tensor([[5, 6, 7], [5, 6, 8], [1, 2, 3]])
    mask = torch.ones_like(ids)
    layout = pack_shared(ids, mask, label_positions(mask, 1), row_tokens=4, pad_id=-1)
    # Units of 4 ([5, 6, 7, 8]) and 3 tokens, a row each: the second ends in one filler.
    assert layout.input_ids.tolist() == [[5, 6, 7, 8], [1, 2, 3, -1]]
    assert layout.attention_mask[1, 0, 3].tolist() == [False, False, False, True]


def test_the_shared_layout_holds_each_prompt_once():
    batch = grouped_batch()
    ids, mask = joined(batch)
    where = label_positions(mask, 4)
    layout = pack_shared(ids, mask, where, row_tokens=1000, pad_id=-1)
    prompts, responses = batch["prompt_mask"].sum(1), batch["response_mask"].sum(1)
    groups = prompt_groups(batch["prompts"], batch["prompt_mask"])
    want = sum(int(prompts[g[0]] + responses[g].sum()) for g in groups)
    assert want == 5 + 7 + 3 + 4 + 2 + 5 + 4 + 2 == 32  # against 47 unshared
    assert int((layout.input_ids != -1).sum()) == want
    assert layout.input_ids.numel() == want  # one row, no filler
    assert int(mask.sum()) == 47


def test_a_group_wider_than_a_row_is_cut_with_its_prompt_in_each_piece():
    # Prompt [1, 2] with three responses of 3: rows of 8 take the prompt and two responses,
    # the third goes with a prompt of its own (unshared, as pack lays it).
    ids = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 6, 7, 8], [1, 2, 9, 10, 11]])
    mask = torch.ones_like(ids)
    layout = pack_shared(ids, mask, label_positions(mask, 3), row_tokens=8, pad_id=-1)
    assert layout.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 10, 11, -1, -1, -1]]
    assert layout.position_ids[0].tolist() == [0, 1, 2, 3, 4, 2, 3, 4]


def test_a_one_column_prompt_is_not_shared():
    # SFT's request: labels at every position but the first, which rows often share.
    ids = torch.tensor([[7, 1, 2, 3], [7, 4, 5, 0]])
    mask = (ids != 0).long()
    where = label_positions(mask, 3)
    layout = pack_shared(ids, mask, where, row_tokens=8)
    assert layout.attention_mask is None
    assert torch.equal(layout.input_ids, pack(ids, mask, where, row_tokens=8).input_ids)


def test_without_a_shared_prompt_it_is_pack():
    ids = torch.tensor([[0, 11, 12, 13, 0], [21, 22, 23, 24, 0], [0, 0, 31, 32, 0]])
    mask = (ids != 0).long()
    where = label_positions(mask, 2)
    shared = pack_shared(ids, mask, where, row_tokens=5, pad_id=-1)
    plain = pack(ids, mask, where, row_tokens=5, pad_id=-1)
    assert shared.attention_mask is None
    for name in ("input_ids", "position_ids", "gather", "order"):
        assert torch.equal(getattr(shared, name), getattr(plain, name))


# ----------------------------------------------------------------------------- exactness


def test_a_shared_states_gradients_add_up_in_the_same_order_every_time():
    """A shared prompt's last state is gathered once per response. Indexing's backward on the
    CPU adds the repeated rows from two threads at once: 20 backward passes of this gather
    gave 20 different gradients (the last bits), and runs beside a busy core parted. The
    layout's gather adds them in order."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 512, 64, generator=g, requires_grad=True)
    gather = torch.randint(0, 8, (8192,), generator=g)  # 8 states, ~1,000 readers each
    weights = torch.randn(len(gather), 64, generator=g)
    empty = torch.zeros(0, dtype=torch.long)
    layout = PackedLayout(empty, empty, empty.bool(), gather, empty)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (indexing's backward adds from one thread with one)
    try:
        seen = []
        for _ in range(10):
            hidden.grad = None
            (layout.label_states(hidden) * weights).sum().backward()
            seen.append(hidden.grad.clone())
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(seen[0], other) for other in seen[1:])
    want = torch.zeros(1024, 64).index_add_(0, gather, weights).view(2, 512, 64)
    torch.testing.assert_close(seen[0], want)


def padded_log_probs(model, ids, mask, r: int) -> torch.Tensor:
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    logp = torch.log_softmax(logits[:, -r - 1 : -1], -1)
    return logp.gather(-1, ids[:, -r:, None]).squeeze(-1)


def grads(module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("lm."): p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("row_tokens", [1, 12, 1000])
def test_shared_log_probs_and_gradients_equal_the_padded_and_packed_ones(attn, row_tokens):
    batch = grouped_batch()
    ids, mask = joined(batch)
    rmask = batch["response_mask"].bool()
    results = {}
    for name in ("shared", "packed", "padded"):
        lm = random_lm("llama", attn)
        assert can_share_prompts(lm.config)
        if name == "padded":
            logp = padded_log_probs(lm, ids, mask, 4) * rmask
            module = lm
        else:
            module = LogProbHead(lm, chunk_size=3, row_tokens=row_tokens)
            module.share_prompts = name == "shared"
            logp = module(LogProbRequest(ids, mask, 4)).log_probs
        (logp * torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)).sum().backward()
        results[name] = (logp.detach(), grads(module))
    if row_tokens == 1000:  # one row: every group's prompt computed once
        layout = pack_shared(ids, mask, label_positions(mask, 4), row_tokens)
        assert layout.input_ids.shape == (1, 32)
    logp, got = results["shared"]
    for other in ("packed", "padded"):
        want_logp, want = results[other]
        torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
        assert got.keys() == want.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], atol=1e-4, rtol=1e-4)
    assert (logp[rmask] != 0).all() and (logp[~rmask] == 0).all()


def test_a_sliding_window_or_another_attention_keeps_the_unshared_layout():
    from transformers import LlamaConfig, Qwen2Config

    assert can_share_prompts(Qwen2Config(attn_implementation="sdpa"))
    assert not can_share_prompts(
        Qwen2Config(attn_implementation="sdpa", use_sliding_window=True, sliding_window=16)
    )
    assert not can_share_prompts(LlamaConfig(attn_implementation="flex_attention"))


# ----------------------------------------------------------------------------- micro-batches


def test_units_weigh_a_prompt_once_and_stay_under_the_budget():
    from treadle.workers.common import shared_prompt_units

    batch = grouped_batch()
    units, tokens = shared_prompt_units(batch, budget=100)
    assert units == [[0, 1, 2], [3, 4], [5, 6], [7]]
    assert tokens == [5 + 7, 3 + 4, 2 + 5, 4 + 2]
    # A budget of 10: group 0 (5 + 1, + 4 would be 10, + 2 is 12) is cut after its second.
    units, tokens = shared_prompt_units(batch, budget=10)
    assert units == [[0, 1], [2], [3, 4], [5, 6], [7]]
    assert tokens == [10, 7, 7, 7, 6]


def test_micro_batches_by_samples_keep_a_prompts_rows_together():
    from treadle.config import ActorConfig
    from treadle.workers.common import micro_batches

    batch = grouped_batch().select(torch.tensor([0, 3, 5, 1, 7, 4, 2, 6]))  # groups spread
    shared = micro_batches(batch, ActorConfig(micro_batch_size=3))
    assert [g.tolist() for g in shared] == [[0, 3, 6], [1, 5, 2], [7, 4]]
    off = micro_batches(batch, ActorConfig(micro_batch_size=3, share_prompts=False))
    assert [g.tolist() for g in off] == [[0, 1, 2], [3, 4, 5], [6, 7]]


# ----------------------------------------------------------------------------- the actor


def groups_of(batch: Batch, groups: list[list[int]]) -> Batch:
    """``batch`` with the prompt of each group's first row copied to its other rows."""
    prompts, pmask = batch["prompts"].clone(), batch["prompt_mask"].clone()
    for g in groups:
        prompts[g], pmask[g] = prompts[g[0]].clone(), pmask[g[0]].clone()
    batch["prompts"], batch["prompt_mask"] = prompts, pmask
    return batch


@pytest.mark.parametrize(
    "overrides, micros",
    [
        # a prompt weighs once: 2 micro-batches of 40 tokens, against 3 unshared
        (("actor.pack_row_tokens=24", "actor.max_tokens_per_micro_batch=40"), (2, 3)),
        (("actor.pack_row_tokens=64", "actor.micro_batch_size=4"), (2, 2)),
    ],
    ids=["token-budget", "samples"],
)
def test_the_update_with_shared_prompts_gives_the_plain_loss_and_gradients(
    tiny_task, overrides, micros
):
    from test_packing import assert_same_grads, joined, local_actor, plain_ppo_update, uneven_batch

    from treadle.models.loading import load_causal_lm

    path = str(tiny_task["model"])
    # Rows 0, 2, 5 share a prompt, and 1, 6; 3, 4 and 7 have their own (rows apart, as a
    # shuffled mini-batch has them).
    batch = groups_of(uneven_batch(vocab=100, n=8, seed=1), [[0, 2, 5], [1, 6]])
    ids, mask = joined(batch)
    shared = pack_shared(ids, mask, label_positions(mask, 8), row_tokens=1000)
    assert int((shared.input_ids != 0).sum()) < int(mask.sum())  # there is something to share
    results = {}
    for share in ("true", "false"):
        group = local_actor(path, f"actor.share_prompts={share}", "data.batch_size=8",
                            "actor.ppo_mini_batch_size=8", *overrides)  # fmt: skip
        try:
            [worker] = group.workers
            assert worker.actor.module.share_prompts is (share == "true")
            [results[share]] = group.update_grads(batch, "token-mean")
            out = group.compute_log_probs(batch)
        finally:
            group.shutdown()
        results[share + "/logp"] = out["old_log_probs"]
    want_loss, want_grads = plain_ppo_update(path, batch, "token-mean")
    (m_on, g_on, micros_on), (m_off, g_off, micros_off) = results["true"], results["false"]
    assert m_on["actor/pg_loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert m_on["actor/pg_loss"] == pytest.approx(m_off["actor/pg_loss"], rel=1e-5, abs=1e-6)
    assert_same_grads(g_on, want_grads)
    assert_same_grads(g_on, g_off)
    assert (micros_on, micros_off) == micros
    with torch.no_grad():
        from test_packing import plain_log_probs

        want, _ = plain_log_probs(load_causal_lm(path), ids, mask, 8)
    rmask = batch["response_mask"].bool()
    torch.testing.assert_close(results["true/logp"][rmask], want[rmask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["true/logp"], results["false/logp"], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- ranks


def test_balanced_group_order_keeps_groups_on_one_rank_where_they_fit():
    from treadle.engines.packing import balanced_group_order, balanced_order

    # Groups of 3, 3 and 2 samples over 2 ranks of 4: the groups cost (prompt once) 10 + 3,
    # 5 + 6 and 8 + 2 tokens. 13 -> A, 11 -> B; 10 fits whole in neither (1 place each): its
    # first sample to the lighter B, the other to A.
    prompt = [10] * 3 + [5] * 3 + [8] * 2
    response = [1, 1, 1, 2, 2, 2, 1, 1]
    groups = [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert balanced_group_order(groups, prompt, response, 2) == [0, 1, 2, 7, 3, 4, 5, 6]
    # Two groups of 2 and one of 4 over 2 ranks: every group whole.
    prompt, response = [4, 4, 3, 3, 9, 9, 9, 9], [1] * 8
    order = balanced_group_order([[0, 1], [2, 3], [4, 5, 6, 7]], prompt, response, 2)
    assert order == [4, 5, 6, 7, 0, 1, 2, 3]
    # Groups of one: balanced_order of the samples' tokens.
    lengths = [100, 90, 10, 5, 80, 20]
    singles = balanced_group_order([[i] for i in range(6)], lengths, [0] * 6, 2)
    assert singles == balanced_order(lengths, 2)
    with pytest.raises(ValueError, match="3 samples cannot be cut into 2 equal parts"):
        balanced_group_order([[0, 1, 2]], [1] * 3, [1] * 3, 2)


def test_balance_ranks_with_shared_prompts_keeps_a_group_together():
    from treadle.engines.packing import balance_ranks

    batch = grouped_batch().select(torch.tensor([0, 3, 5, 1, 7, 4, 2, 6]))
    shared = balance_ranks(batch, 2, share_prompts=True)
    halves = [prompt_groups(h["prompts"], h["prompt_mask"]) for h in shared.split(4)]
    # 3 + 1 and 2 + 2 samples: every group whole on one rank
    assert [sorted(len(g) for g in h) for h in halves] == [[1, 3], [2, 2]]
    unshared = [
        prompt_groups(h["prompts"], h["prompt_mask"]) for h in balance_ranks(batch, 2).split(4)
    ]
    assert sorted(len(g) for h in unshared for g in h) == [1, 1, 1, 1, 2, 2]  # groups spread
