"""Tensor parallel 2 and sequence parallel 2 against one rank: the actor's update, the
critic's, and the log-prob passes give the same losses and gradients (float32, 1e-5).

Each layout runs the real worker classes on 2 Ray ranks (one data-parallel rank: both ranks
read the whole batch, dispatched by the worker group), the reference the same classes in
local mode. The workers below only capture the gradients their optimizer step applies.
"""

from __future__ import annotations

import itertools
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from treadle.config import load_config
from treadle.controller import Collect, Dispatch, ResourcePool, WorkerGroup, register
from treadle.engines.parallel import ULYSSES
from treadle.models.loading import load_tokenizer, load_value_model, save_hf_folder
from treadle.protocol import Batch
from treadle.workers import ActorRolloutRefWorker, CriticWorker
from treadle.workers.common import SEQUENCES
from treadle.workers.objectives import PolicyGradient

PROMPT, RESPONSE = 5, 6
LAYOUTS = {
    # with what waits in host memory (a no-op move on a CPU, through FSDP2's and DTensor's
    # handling of a tensor-parallel model all the same): the one rank's numbers keep theirs
    "tp": (
        "actor.tensor_parallel_size=2",
        "critic.tensor_parallel_size=2",
        "actor.offload_params=true",
        "actor.offload_optimizer=true",
    ),
    "sp": ("actor.sequence_parallel_size=2", "critic.sequence_parallel_size=2"),
}


def capture_grads(worker, run):
    """``run()``'s result and the full gradients of ``worker.engine``'s optimizer step, each
    ``train_step`` timed by a clock on which it lasts 2 s (its ``perf/tflops/<role>`` then
    depends on the FLOPs counted alone)."""
    from treadle.engines import flops

    grads: dict[str, torch.Tensor] = {}
    engine = worker.engine
    step = engine.step

    def capture() -> dict[str, float]:
        for name, p in engine.module.named_parameters():
            g = p.grad
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
        return step()

    engine.step = capture
    clock = itertools.cycle([10.0, 12.0])
    real, flops.perf_counter = flops.perf_counter, lambda: next(clock)
    try:
        return run(), grads
    finally:
        del engine.step
        flops.perf_counter = real


def layout_facts(worker) -> dict[str, object]:
    """What the rank's engine is split into: q_proj's local rows, the attention in use."""
    lm = worker.engine.module.lm
    q = lm.get_decoder().layers[0].self_attn.q_proj.weight
    tp = getattr(worker.meshes, "tp_mesh", None)
    return {
        "q_rows": q.shape[0],
        # rows held by this rank's tensor-parallel shard (the FSDP dimension is of size 1)
        "sharded": q.to_local().shape[0] if tp is not None else q.shape[0],
        "attention": lm.config._attn_implementation,
    }


class ActorGrads(ActorRolloutRefWorker):
    @register(
        Dispatch.DP,
        Collect.LIST,
        reads=(*SEQUENCES, "advantages", "old_log_probs", "ref_log_probs"),
    )
    def update_grads(self, batch: Batch):
        return capture_grads(self, lambda: self.update(batch, PolicyGradient(self.policy())))

    @register(Dispatch.ALL, Collect.LIST)
    def facts(self):
        return layout_facts(self)


class CriticGrads(CriticWorker):
    @register(Dispatch.DP, Collect.LIST, reads=(*SEQUENCES, "values", "returns"))
    def update_grads(self, batch: Batch):
        return capture_grads(self, lambda: self.update_critic(batch))

    @register(Dispatch.ALL, Collect.LIST)
    def facts(self):
        return layout_facts(self)


def config(model, task, *overrides: str):
    return load_config(
        None,
        [
            f"model.path={model}",
            f"data.train_files=[{task['train']}]",
            "algorithm.adv_estimator=gae",
            "algorithm.kl_coef=0.01",
            "data.batch_size=2",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size=3",  # 8 rows: micro-batches of 3, 3, 2
            "actor.pack_row_tokens=16",  # several packed rows, sequence-parallel splits each
            *overrides,
        ],
    )


def rl_batch(n: int = 8, vocab: int = 100) -> Batch:
    """Left-padded prompts, right-padded responses of uneven length (one of them empty)."""
    g = torch.Generator().manual_seed(3)
    pmask = torch.ones(n, PROMPT, dtype=torch.long)
    pmask[0, :2] = 0
    pmask[5, :1] = 0
    lengths = [6, 3, 1, 5, 0, 6, 2, 4][:n]
    rmask = torch.tensor([[1] * k + [0] * (RESPONSE - k) for k in lengths])
    return Batch.from_dict(
        tensors={
            "prompts": torch.randint(3, vocab, (n, PROMPT), generator=g) * pmask,
            "prompt_mask": pmask,
            "responses": torch.randint(3, vocab, (n, RESPONSE), generator=g) * rmask,
            "response_mask": rmask,
            "advantages": torch.randn(n, RESPONSE, generator=g) * rmask,
            "returns": torch.randn(n, RESPONSE, generator=g) * rmask,
            # about log(1 / vocab): ratios near 1, some clipped
            "old_log_probs": (torch.randn(n, RESPONSE, generator=g) * 0.3 - 4.6) * rmask,
            "ref_log_probs": (torch.randn(n, RESPONSE, generator=g) * 0.3 - 4.6) * rmask,
        },
        meta={"step": 1},
    )


def run_roles(cfg, model: str, critic: str, backend: str, pool=None) -> dict[str, object]:
    """Log-probs, the actor's update and the critic's on ``rl_batch``, one group at a time."""
    world = cfg.actor.world_size
    batch = rl_batch()
    out: dict[str, object] = {}
    actor_kwargs = {"config": cfg, "actor_path": model, "with_ref": True, "optimizer_steps": 1}
    group = WorkerGroup(
        ActorGrads, world_size=world, backend=backend, pool=pool, kwargs=actor_kwargs
    )
    try:
        out["actor_facts"] = group.facts(), group.dp_ranks
        out["log_probs"] = group.compute_log_probs(batch)
        out["ref_log_probs"] = group.compute_ref_log_probs(batch)["ref_log_probs"]
        out["actor"] = group.update_grads(batch)
    finally:
        group.shutdown()
    critic_kwargs = {"config": cfg, "critic_path": critic}
    group = WorkerGroup(
        CriticGrads, world_size=world, backend=backend, pool=pool, kwargs=critic_kwargs
    )
    try:
        out["critic_facts"] = group.facts(), group.dp_ranks
        batch["values"] = out["values"] = group.compute_values(batch)["values"]
        out["critic"] = group.update_grads(batch)
    finally:
        group.shutdown()
    return out


@pytest.fixture(scope="module")
def value_model(parallel_model, tmp_path_factory):
    """The parallel model as a value model with a random score head (a zero head, a fresh
    critic's, would give its decoder no gradient to compare)."""
    model = load_value_model(parallel_model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # values of order 1, as a trained critic gives
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g) * 0.1)
    out = tmp_path_factory.mktemp("value") / "value"
    save_hf_folder(model.state_dict(), model.config, load_tokenizer(parallel_model), out)
    return out


@pytest.fixture(scope="module")
def one_rank(parallel_model, value_model, tiny_task):
    cfg = config(parallel_model, tiny_task, "trainer.backend=local")
    return run_roles(cfg, str(parallel_model), str(value_model), "local")


def assert_same_update(got, want, keys: tuple[str, ...]) -> None:
    [(metrics, grads)] = got  # one data-parallel rank answers
    [(want_metrics, want_grads)] = want
    for key in keys:
        assert metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-6), key
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(
            grads[name], g, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert all(g.abs().sum() > 0 for g in want_grads.values() if g.numel() > 1)


@pytest.fixture(scope="module")
def two_ranks(parallel_model, value_model, tiny_task, ray_session):
    """Each layout's results on 2 Ray ranks, both layouts at once (a thread each; a pool of
    two half-CPU bundles each, the session's Ray having two CPUs) and beside the one-rank
    reference (computed in this process meanwhile): the ranks' start-ups overlap. By layout, a
    future: its test gets the result or the error."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    def run(layout: str) -> dict[str, object]:
        cfg = config(parallel_model, tiny_task, "actor.world_size=2", *LAYOUTS[layout])
        pool = ResourcePool(world_size=2, cpus_per_rank=0.5)  # (a rank's threads: 1 either way)
        try:
            return run_roles(cfg, str(parallel_model), str(value_model), "ray", pool)
        finally:
            pool.remove()

    with ThreadPoolExecutor(len(LAYOUTS)) as threads:  # (waits for both at teardown)
        yield {layout: threads.submit(run, layout) for layout in LAYOUTS}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_two_ranks_match_one_rank(layout, two_ranks, one_rank):
    """(``two_ranks`` first: its ranks start while ``one_rank`` computes in this process.)"""
    got = two_ranks[layout].result()
    # Both ranks read the whole batch (one data-parallel rank, which rank 0 answers for) and
    # split the model or the rows.
    for role in ("actor_facts", "critic_facts"):
        [facts], dp_ranks = got[role]
        assert dp_ranks == [0, 0]
        if layout == "tp":
            assert facts["q_rows"] == 64 and one_rank[role][0][0]["q_rows"] == 64
            assert facts["sharded"] == 32  # the 64 rows of q_proj: 32 on each rank
        else:
            assert facts["attention"] == ULYSSES
    close = {"rtol": 1e-5, "atol": 1e-5}
    for key in ("old_log_probs", "entropy"):
        torch.testing.assert_close(got["log_probs"][key], one_rank["log_probs"][key], **close)
    torch.testing.assert_close(got["ref_log_probs"], one_rank["ref_log_probs"], **close)
    torch.testing.assert_close(got["values"], one_rank["values"], **close)
    actor_keys = ("actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm")
    assert_same_update(got["actor"], one_rank["actor"], actor_keys)
    assert_same_update(got["critic"], one_rank["critic"], ("critic/vf_loss", "critic/grad_norm"))
    # each of the group's 2 ranks does half the rows' model FLOPs, in the same (stubbed) 2 s
    for role in ("actor", "critic"):
        [(metrics, _)], [(want, _)] = got[role], one_rank[role]
        key = f"perf/tflops/{role}"
        assert want[key] > 0 and metrics[key] == pytest.approx(want[key] / 2, rel=1e-12)
