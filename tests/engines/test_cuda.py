"""The CUDA path of the engines (skipped without a GPU): the FSDP2 training engine on one GPU
(NCCL) with GKD's top-k head and loss, its lr schedule, and the transformers engine's scoring,
each against a float64 CPU computation of the same model."""

from __future__ import annotations

import pytest
import torch

from treadle.algorithms.distill import generalized_jsd
from treadle.controller import Collect, Dispatch, Worker, WorkerGroup, register
from treadle.engines.fsdp import TrainEngine
from treadle.engines.heads import LogProbRequest
from treadle.engines.inference import HFRolloutEngine
from treadle.engines.schedule import LrSchedule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB, K = 96, 7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    out = tmp_path_factory.mktemp("cuda_model")
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def load(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)


def sequences(n: int = 4, prompt: int = 5, response: int = 6):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (n, prompt + response), generator=g)
    rmask = torch.ones(n, response, dtype=torch.long)
    rmask[1, 3:] = 0
    topk = torch.randint(0, VOCAB, (n, response, K), generator=g)
    teacher = torch.log_softmax(torch.randn(n, response, K, generator=g), -1)
    return ids, rmask, topk, teacher


def reference(model_dir, ids, rmask, topk, teacher, beta, temperature):
    """The GKD loss (token-mean) and the gradient of the LM head, in float64 on the CPU."""
    lm = load(model_dir).double()
    r = rmask.shape[1]
    logits = lm(input_ids=ids).logits[:, -r - 1 : -1]
    sel = rmask.bool()
    per_token = generalized_jsd(
        logits.gather(-1, topk)[sel], teacher.double()[sel], beta, temperature
    )
    loss = per_token.mean()
    loss.backward()
    return float(loss.detach()), lm.get_output_embeddings().weight.grad.float()


class GKDWorker(Worker):
    def __init__(self, rank, world_size, addr, port, *, model_path, compute_dtype=None):
        super().__init__(rank, world_size, addr, port)
        lm = load(model_path)  # on the host, as workers hand it over: FSDP2 moves it
        self.engine = TrainEngine(
            lm,
            chunk_size=4,
            lr=1e-3,
            compute_dtype=compute_dtype,
            schedule=LrSchedule(2, "cosine", 0.1, 6),
        )

    @register(Dispatch.ALL, Collect.RANK0)
    def loss_and_head_grad(self, ids, rmask, topk, teacher, beta, temperature):
        d = self.device
        mask = torch.ones_like(ids)
        r = rmask.shape[1]
        out = self.engine.forward(
            LogProbRequest(ids.to(d), mask.to(d), r, label_mask=rmask.to(d), topk_ids=topk.to(d))
        )
        sel = rmask.bool().to(d)
        per_token = generalized_jsd(out.topk_logits, teacher.to(d)[sel], beta, temperature)
        loss = per_token.mean()
        loss.backward()
        weight = self.engine.module.lm.get_output_embeddings().weight
        return (
            float(loss.detach()),
            weight.grad.full_tensor().float().cpu(),
            out.topk_logits.device.type,
        )

    @register(Dispatch.ALL, Collect.RANK0)
    def where(self) -> tuple[list[str], bool]:
        """The device types of the engine's parameters and buffers (the rotary tables among
        them), and whether its LM head is still its input embedding (tied)."""
        root, lm = self.engine.module, self.engine.module.lm
        places = {t.device.type for t in (*root.parameters(), *root.buffers())}
        return sorted(places), lm.get_output_embeddings().weight is lm.get_input_embeddings().weight

    @register(Dispatch.ALL, Collect.RANK0)
    def lrs(self, steps: int) -> list[float]:
        return [self.engine.step()["lr"] for _ in range(steps)]


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_gkd_top_k_loss_and_gradient_on_cuda(model_dir, compute_dtype):
    ids, rmask, topk, teacher = sequences()
    want_loss, want_grad = reference(model_dir, ids, rmask, topk, teacher, 0.3, 0.8)
    group = WorkerGroup(
        GKDWorker,
        world_size=1,
        backend="local",
        kwargs={"model_path": str(model_dir), "compute_dtype": compute_dtype},
    )
    try:
        # built from a model on the host (RoleWorker.load_lm): fully_shard moved every tensor
        assert group.where() == (["cuda"], True)
        loss, grad, where = group.loss_and_head_grad(ids, rmask, topk, teacher, 0.3, 0.8)
        assert where == "cuda"
        tol = 1e-4 if compute_dtype is None else 3e-2
        assert loss == pytest.approx(want_loss, rel=tol)
        torch.testing.assert_close(grad, want_grad, rtol=tol, atol=tol * want_grad.abs().max())
        # the lr schedule on the GPU's optimizer: warm-up 1/2, 1, then cosine to 0.1
        lrs = group.lrs(3)
        assert lrs == pytest.approx([1e-3 * 0.5, 1e-3, 1e-3 * (0.1 + 0.9 * (1 + 0.5**0.5) / 2)])
    finally:
        group.shutdown()


class Reducer(Worker):
    @register(Dispatch.ALL, Collect.RANK0)
    def sum_both(self) -> list[list[float]]:
        import torch.distributed as dist

        counts = torch.tensor([3.0, 4.0], dtype=torch.float64)  # as global_sums makes them
        values = torch.tensor([5.0], device=self.device)
        dist.all_reduce(counts)
        dist.all_reduce(values)
        return [counts.tolist(), values.cpu().tolist(), [float(values.is_cuda)]]


def test_a_groups_collectives_take_cpu_and_cuda_tensors():
    """Token counts and metrics are reduced as CPU tensors: an NCCL-only group refused them
    ("No backend type associated with device type cpu"), so no update ran on a GPU."""
    group = WorkerGroup(Reducer, world_size=1, backend="local")
    try:
        assert group.sum_both() == [[3.0, 4.0], [5.0], [1.0]]
    finally:
        group.shutdown()


def test_transformers_engine_scores_on_cuda(model_dir):
    ids, _, _, _ = sequences()
    seqs, starts = [row.tolist() for row in ids], [5, 5, 7, 9]
    engine = HFRolloutEngine(load(model_dir).cuda(), eos_token_ids=[0], pad_token_id=0)
    scored = engine.score(seqs, starts, top_k=K)
    lm = load(model_dir).double()
    for seq, start, got in zip(seqs, starts, scored, strict=True):
        full = torch.log_softmax(lm(input_ids=torch.tensor([seq])).logits[0], -1)
        want = full[start - 1 : len(seq) - 1]
        token = want.gather(-1, torch.tensor(seq[start:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got.log_probs), token.float(), atol=1e-4, rtol=0)
        top = want.topk(K, -1)
        torch.testing.assert_close(
            torch.tensor(got.topk_log_probs), top.values.float(), atol=1e-4, rtol=0
        )


def test_sdpa_on_cuda_is_transformers_own_in_bfloat16():
    """The CPU's float32 attention backward (treadle.engines.attention) leaves CUDA alone."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from treadle.engines.attention import sdpa_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, h, 16, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_()
        for h in (4, 2, 2)
    )
    module = SimpleNamespace(is_causal=True, num_key_value_groups=2)
    out, _ = sdpa_attention(module, q, k, v, None)
    ref, _ = sdpa_attention_forward(module, q, k, v, None)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref)
