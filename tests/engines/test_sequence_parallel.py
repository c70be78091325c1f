"""Ulysses attention on packed rows: each packed sequence attends within itself, for every
architecture, forward and backward, against each sequence's own forward, alone (the
decoder's own packed forward mixes a row's sequences for some families: gpt-oss's): one
rank in this process (a sequence-parallel
group of one: the all-to-alls are identities, the attention is what is tested), and two
ranks of their own processes (the all-to-alls, the padding of an odd width);
``tests/workers/test_parallel.py`` runs the workers' two ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from tiny_models import random_lm

from treadle.engines import parallel

# three packed rows: two sequences; one; a sequence of one token, then two more
POSITIONS = torch.tensor(
    [
        [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6],
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        [0, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6],
    ]
)


@pytest.fixture
def sp_group():
    """A one-rank gloo group in this process, and a sequence-parallel group of it."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.new_group([0])
    if made:
        dist.destroy_process_group()


def test_the_sequences_of_packed_rows():
    assert parallel.packed_segments(POSITIONS) == [
        [(0, 4), (4, 11)],
        [(0, 11)],
        [(0, 1), (1, 4), (4, 11)],
    ]
    # filler goes on counting the last sequence; a row starts a sequence whatever its position
    assert parallel.packed_segments(torch.tensor([[0, 1, 2, 3, 4], [5, 6, 0, 1, 2]])) == [
        [(0, 5)],
        [(0, 2), (2, 5)],
    ]


# Qwen2 with its second layer's attention in a sliding window of 3 positions
SLIDING = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}


def packed_and_parallel(lm, ids: torch.Tensor, group) -> tuple:
    """Each sequence of ``ids``' packed rows (POSITIONS) through the decoder alone, then the
    rows through :func:`~treadle.engines.parallel.sequence_parallel_forward` over ``group``:
    each one's hidden states and gradients (of a weighted sum), the parallel ones averaged over
    the group as FSDP2 does (a rank's own are its slice's share, times the group size)."""

    def run(forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lm.zero_grad()
        hidden = forward()
        (hidden * torch.linspace(-1, 1, hidden.shape[-1])).sum().backward()
        grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
        return hidden.detach(), grads

    def alone() -> torch.Tensor:
        return torch.cat(
            [
                torch.cat(
                    [lm.model(input_ids=ids[r : r + 1, a:e]).last_hidden_state for a, e in row], 1
                )
                for r, row in enumerate(parallel.packed_segments(POSITIONS))
            ]
        )

    want, want_grads = run(alone)
    parallel._register_ulysses()
    lm.set_attn_implementation(parallel.ULYSSES)
    for layer in lm.model.layers:
        layer.self_attn.sequence_group = group
    got, grads = run(lambda: parallel.sequence_parallel_forward(lm.model, ids, POSITIONS, group))
    for g in grads.values():
        dist.all_reduce(g, group=group)
        g.div_(dist.get_world_size(group))
    return want, got, want_grads, grads


def assert_same(want, got, want_grads, grads) -> None:
    # float32 rounding: up to 1.4e-6 for gpt-oss's states over 12 seeds on an AVX-512 Xeon (a
    # left-out sink is off by 0.16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        scale = max(1.0, g.abs().max().item())  # (gpt-oss's reach 1,700: float32 rounding)
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize(
    ("arch", "changes"),
    [("llama", {}), ("qwen2", {}), ("qwen2", SLIDING), ("qwen3", {}), ("mixtral", {})],
)
def test_each_packed_sequence_attends_within_itself(sp_group, arch, changes):
    """Llama's forward drops a mask it did not build for an attention it does not know: the
    block-diagonal mask treadle passed then never reached the attention, and a row's second
    sequence attended to the first. A sliding window holds each sequence to it. (Qwen3
    normalises each head's queries and keys; a mixture of experts routes each token.)"""
    lm = random_lm(arch, **changes)
    if changes:
        assert lm.config.layer_types == ["full_attention", "sliding_attention"]
    ids = torch.randint(0, 64, POSITIONS.shape, generator=torch.Generator().manual_seed(0))
    assert_same(*packed_and_parallel(lm, ids, sp_group))
    with pytest.raises(RuntimeError, match="sequence-parallel attention got no sequence_segments"):
        lm.model(input_ids=ids, position_ids=POSITIONS, use_cache=False)


def sunk_gpt_oss():
    """A gpt-oss (a sink a head, random; its first layer's window of 3 positions)."""
    lm = random_lm("gpt_oss", attn="eager", sliding_window=3)  # (its only attention)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in lm.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g))
    return lm


def test_attention_sinks_take_their_share_of_each_softmax(sp_group):
    """gpt-oss's attention passes a sink a head (``s_aux``), which sdpa has no place for: left
    out, a 2-rank run's log-probs were off by 0.16 against the engine's."""
    lm = sunk_gpt_oss()
    assert lm.config.layer_types == ["sliding_attention", "full_attention"]
    ids = torch.randint(0, 64, POSITIONS.shape, generator=torch.Generator().manual_seed(0))
    assert_same(*packed_and_parallel(lm, ids, sp_group))


def _rank(rank: int, store: str, out: str, arch: str) -> None:
    """One of two ranks of :func:`test_two_ranks_split_an_odd_width`; rank 0 saves the four."""
    dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(store, 2))
    torch.set_num_threads(1)
    ids = torch.randint(0, 64, POSITIONS.shape, generator=torch.Generator().manual_seed(1))
    lm = sunk_gpt_oss() if arch == "gpt_oss" else random_lm(arch)
    result = packed_and_parallel(lm, ids, dist.group.WORLD)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    # Out at once: tearing gloo down as the process ends aborted one rank in about ten runs
    # ("terminate called without an active exception", exit code -6).
    os._exit(0)


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_two_ranks_split_an_odd_width(tmp_path, arch):
    """Two gloo ranks, each a slice of the 11-wide rows (padded to 12): the all-to-alls, the
    padding and the gather against the decoder's own packed forward (gpt-oss: each rank's
    heads take their own sinks)."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    out = tmp_path / "result.pt"
    args = (str(tmp_path / "store"), str(out), arch)
    ranks = [spawn.Process(target=_rank, args=(r, *args)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
    codes = [p.exitcode for p in ranks]
    for p in ranks:
        p.kill()  # (one still waiting in a collective, if the other failed)
    assert codes == [0, 0]
    assert_same(*torch.load(out))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_per_sequence_attention_on_a_gpu_in_bf16(arch):
    """The attention of sequence parallelism without its all-to-alls (one rank has nothing to
    exchange): causal sdpa on slices of each row (flash attention's path where it takes them),
    in bfloat16 on the GPU, against the decoder's own packed forward there; forward and the
    gradients of the attention projections, to bf16's rounding."""
    from transformers import AttentionInterface

    def segments_only(module, query, key, value, attention_mask, sequence_segments, **kwargs):
        return parallel.segment_attention(
            module, query, key, value, sequence_segments, **kwargs
        ), None

    AttentionInterface.register("treadle_segments_only", segments_only)
    lm = random_lm(arch).to("cuda", torch.bfloat16)
    ids, positions = torch.randint(0, 64, POSITIONS.shape).cuda(), POSITIONS.cuda()

    def run(**kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        lm.zero_grad()
        hidden = lm.model(input_ids=ids, position_ids=positions, use_cache=False, **kwargs)
        (hidden.last_hidden_state.float() * torch.linspace(-1, 1, 32).cuda()).sum().backward()
        q = lm.model.layers[0].self_attn.q_proj.weight.grad
        return hidden.last_hidden_state.detach().float(), q.float()

    want, want_q = run()
    lm.set_attn_implementation("treadle_segments_only")
    got, got_q = run(sequence_segments=parallel.packed_segments(POSITIONS))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_q, want_q, rtol=3e-2, atol=3e-2 * float(want_q.abs().max()))
