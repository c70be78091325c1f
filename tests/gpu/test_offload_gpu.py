"""actor.offload_params and actor.offload_optimizer on one GPU: what waits leaves the device's
memory (weights: 4 bytes a float32 parameter; AdamW's moments: 8) and the engine trains as if it
had stayed; the hf rollout engine's weights leave it while the engine sleeps. The CPU runs the
same steps under the device double (tests/engines/test_fsdp.py) and the engine's sleep with a
host copy on the same memory (tests/engines/test_hf_generate.py), where nothing can show the
memory."""

from __future__ import annotations

import pytest
import torch
from gpu_runs import GPU
from tiny_models import random_lm

from treadle.controller import Collect, Dispatch, Worker, WorkerGroup, register
from treadle.engines.fsdp import TrainEngine
from treadle.engines.heads import LogProbRequest

pytestmark = GPU

VOCAB = 4096


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """~17M parameters (68 MB in float32): the weights, not the CUDA context, are what moves."""
    shape = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4}
    shape |= {"num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 128}
    out = tmp_path_factory.mktemp("offload_model")
    random_lm("qwen2", vocab_size=VOCAB, tie_word_embeddings=False, **shape).save_pretrained(out)
    return out


class Waiting(Worker):
    def __init__(self, rank, world_size, addr, port, *, model_path, offload) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__(rank, world_size, addr, port)
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.engine = TrainEngine(
            lm, chunk_size=64, lr=1e-3, offload_params=offload, offload_optimizer=offload
        )

    def _loss(self, batch):
        ids = batch["input_ids"]
        request = LogProbRequest(ids, torch.ones_like(ids), 8)
        return -self.engine.forward(request).log_probs.mean(), {}

    @register(Dispatch.ALL, Collect.RANK0)
    def steps(self, n: int) -> tuple[int, list[tuple[int, int]], list[torch.Tensor]]:
        """``n`` steps, the engine waiting after each: the weights' bytes, the memory allocated
        after each step and after its wait, and the weights at the end."""
        from treadle.protocol import Batch

        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (8, 40), generator=g)
        batch = Batch.from_dict(tensors={"input_ids": ids})
        size = sum(p.numel() * p.element_size() for p in self.engine.module.parameters())
        memory = []
        for _ in range(n):
            self.engine.train_step(batch.split(4), self._loss)
            stepped = torch.cuda.memory_allocated()
            self.engine.offload()
            memory.append((stepped, torch.cuda.memory_allocated()))
        weights = [p.full_tensor().detach().cpu() for p in self.engine.module.parameters()]
        return size, memory, weights


def run(model_dir, offload: bool):
    kwargs = {"model_path": str(model_dir), "offload": offload}
    group = WorkerGroup(Waiting, world_size=1, backend="local", kwargs=kwargs)
    try:
        return group.steps(3)
    finally:
        group.shutdown()


def test_what_waits_leaves_the_gpu_and_trains_as_if_it_had_stayed(model_dir):
    size, kept, want = run(model_dir, offload=False)
    _, memory, got = run(model_dir, offload=True)
    assert size > 60e6
    for stepped, waiting in kept:  # weights and two moments stay: at least 3 x the weights
        assert stepped >= 3 * size and waiting == stepped
    for stepped, waiting in memory:
        assert stepped < kept[0][0] - 1.9 * size  # the moments left after the step
        assert waiting < stepped - 0.95 * size  # then the weights
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_sleeping_rollout_engine_leaves_the_gpu_and_wakes_with_the_synced_weights(model_dir):
    """On CUDA the hf engine sleeps to host memory by default (its server puts it to sleep
    between generations, colocated): the bfloat16 weights leave the device's memory, a weight
    sync while asleep reaches them, and awake it answers as an engine that never slept."""
    from transformers import AutoModelForCausalLM

    from treadle.engines.inference import HFRolloutEngine, SamplingParams

    def engine() -> HFRolloutEngine:
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        return HFRolloutEngine(lm.cuda(), [0], 0)

    slept, kept = engine(), engine()
    assert slept.host is not None
    size = sum(t.numel() * t.element_size() for t in slept.host.tensors)
    g = torch.Generator().manual_seed(0)
    new = [
        (n, (p.float().cpu() + 0.05 * torch.randn(p.shape, generator=g)).cuda())
        for n, p in kept.params.items()
    ]
    prompts = torch.randint(1, VOCAB, (8, 12), generator=g).tolist()
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=16, ignore_eos=True)
    first = slept.generate(prompts, params).token_ids
    awake = torch.cuda.memory_allocated()
    slept.sleep()
    assert torch.cuda.memory_allocated() < awake - 0.95 * size
    for e in (slept, kept):
        e.update_weights(new)
    slept.wake()
    assert abs(torch.cuda.memory_allocated() - awake) < 0.05 * size
    answers = kept.generate(prompts, params).token_ids
    assert slept.generate(prompts, params).token_ids == answers != first
