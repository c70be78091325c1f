"""The FSDP2 training engine: log-probs against a naive forward, 2 ranks against 1."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from treadle.controller import Collect, Dispatch, Worker, WorkerGroup, register
from treadle.engines.fsdp import TrainEngine
from treadle.models.loading import load_causal_lm
from treadle.protocol import Batch


def make_batch(vocab: int, n: int = 4, prompt: int = 5, response: int = 6) -> Batch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (n, prompt + response), generator=g)
    pmask = torch.ones(n, prompt, dtype=torch.long)
    pmask[0, :2] = 0  # left padding
    pmask[2, :1] = 0
    rmask = torch.ones(n, response, dtype=torch.long)
    rmask[1, 3:] = 0  # right padding, uneven lengths
    rmask[3, 5:] = 0
    return Batch.from_dict(
        tensors={
            "input_ids": ids,
            "attention_mask": torch.cat([pmask, rmask], 1),
            "rmask": rmask,
        }
    )


@contextlib.contextmanager
def two_seconds() -> Iterator[None]:
    """The training engine's clock says 2 s go by in its ``train_step``."""
    from treadle.engines import flops

    clock = iter([10.0, 12.0])
    real, flops.perf_counter = flops.perf_counter, lambda: next(clock)
    try:
        yield
    finally:
        flops.perf_counter = real


@contextlib.contextmanager
def counted_reads(module: Any) -> Iterator[list[tuple]]:
    """``module``'s ``load_file`` counting its calls: the files this rank read."""
    reads: list[tuple] = []
    read = module.load_file
    module.load_file = lambda *a: reads.append(a) or read(*a)
    try:
        yield reads
    finally:
        module.load_file = read


class GradWorker(Worker):
    def __init__(self, rank, world_size, addr, port, *, model_path: str, **options) -> None:
        super().__init__(rank, world_size, addr, port)
        torch.set_num_threads(1)
        self.engine = TrainEngine(load_causal_lm(model_path), chunk_size=4, lr=1e-3, **options)

    @register(Dispatch.DP, Collect.LIST)
    def loss_and_grads(self, batch: Batch) -> tuple[float, dict[str, torch.Tensor]]:
        rmask = batch["rmask"].float()
        total = rmask.sum()
        dist.all_reduce(total)
        logp, _ = self.engine.log_probs(batch["input_ids"], batch["attention_mask"], rmask.shape[1])
        # FSDP2 averages gradients over ranks: scale so the sum over ranks is the batch loss.
        loss = -(logp * rmask).sum() / total * self.world_size
        loss.backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in self.engine.module.named_parameters()}
        value = loss.detach() / self.world_size
        dist.all_reduce(value)
        return float(value), grads

    @register(Dispatch.ALL, Collect.RANK0)
    def train_step_grads(self, batch: Batch, micro: int) -> tuple[dict, dict[str, torch.Tensor]]:
        """``TrainEngine.train_step`` over micro-batches of ``micro`` samples: its metrics and
        the gradients its optimizer step applied."""
        total = float(batch["rmask"].sum())
        grads: dict[str, torch.Tensor] = {}
        step = self.engine.step

        def capture() -> dict[str, float]:
            for n, p in self.engine.module.named_parameters():
                grads[n] = p.grad.full_tensor().clone()
            return step()

        def loss_fn(mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            rmask = mb["rmask"].float()
            logp, _ = self.engine.log_probs(mb["input_ids"], mb["attention_mask"], rmask.shape[1])
            loss = -(logp * rmask).sum() / total
            return loss, {"nll": float(loss.detach()), "tokens": float(rmask.sum())}

        self.engine.step = capture
        try:
            return self.engine.train_step(batch.split(micro), loss_fn, prefix="x/"), grads
        finally:
            del self.engine.step

    def _weights(self) -> list[torch.Tensor]:
        return [p.full_tensor().detach().clone() for p in self.engine.module.parameters()]

    def _nll(self, mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        logp, _ = self.engine.log_probs(mb["input_ids"], mb["attention_mask"], 6)
        return -(logp * mb["rmask"]).sum() / mb["rmask"].sum(), {}

    @register(Dispatch.ALL, Collect.RANK0)
    def step_weights(self, batch: Batch, decay: float) -> tuple[float, list[torch.Tensor], list]:
        """Two optimizer steps (AdamW's bias corrections differ in the second), the second with
        weight decay ``decay``: its ``update_ratio`` and the weights before and after it."""
        mb = batch.split(len(batch))
        self.engine.train_step(mb, self._nll)
        self.engine.optimizer.param_groups[0]["weight_decay"] = decay
        before = self._weights()
        ratio = self.engine.train_step(mb, self._nll)["update_ratio"]
        return ratio, before, self._weights()

    @register(Dispatch.ALL, Collect.RANK0)
    def waiting_steps(self, batch: Batch, forget: bool = False) -> tuple[list, list[set], list]:
        """Three optimizer steps under the device double, the engine waiting after each as a
        worker has it wait (:meth:`TrainEngine.offload`): the weights after them, where the
        optimizer's state was between steps, whether the weights were away. ``forget``: the
        moments are not brought back before a step."""
        from device_double import TwoDevices, place  # (tests/: not on a Ray worker's path)

        if forget:
            self.engine.residence.moments_in = lambda optimizer: None
        places, away = [], []
        with TwoDevices():
            for _ in range(3):
                self.engine.train_step(batch.split(2), self._nll)
                self.engine.offload()
                states = self.engine.optimizer.state.values()
                places.append({place(v) for state in states for v in state.values()})
                away.append(self.engine.residence.weights_away)
        return self._weights(), places, away

    @register(Dispatch.ALL, Collect.RANK0)
    def zero_gradient_step(self, batch: Batch) -> tuple[dict, list, list, list, list]:
        """A step with a gradient, then one whose gradient is exactly 0: the second's metrics,
        the weights and AdamW's state before and after it."""
        state = lambda: [  # noqa: E731
            {k: getattr(v, "full_tensor", v.clone)().clone() for k, v in s.items()}
            for s in self.engine.optimizer.state.values()
        ]

        def nothing_to_learn(mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            loss, metrics = self._nll(mb)
            return loss * 0.0, metrics  # (every advantage 0: the loss and its gradient exactly 0)

        mb = batch.split(len(batch))
        self.engine.optimizer.param_groups[0]["weight_decay"] = 0.1
        self.engine.train_step(mb, self._nll)
        before, adam = self._weights(), state()
        metrics = self.engine.train_step(mb, nothing_to_learn)
        return metrics, before, self._weights(), adam, state()

    @register(Dispatch.ALL, Collect.RANK0)
    def timed_step(self, batch: Batch, micro: int) -> dict[str, float]:
        """``train_step`` in micro-batches of ``micro`` rows, each loss with a gradient-free
        forward beside (a reference's, say), on a clock that says 2 s went by."""

        def loss_fn(mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            with torch.no_grad():
                self._nll(mb)
            return self._nll(mb)

        with two_seconds():
            return self.engine.train_step(batch.split(micro), loss_fn, prefix="x/")

    @register(Dispatch.ALL, Collect.LIST)
    def optimizer_round_trip(self, folder: str, unstepped: int = 0) -> tuple[bool, int, bool]:
        """The optimizer state saved, emptied and loaded again, the first ``unstepped``
        parameters' state dropped before the save (parameters that never had a gradient):
        whether this rank's other shards came back as they were, how many times this rank read
        the saved file, and whether the dropped ones came back fresh (moments of 0)."""
        from treadle.engines import state

        e = self.engine
        shards = lambda: [  # noqa: E731
            {k: getattr(v, "to_local", v.clone)().clone() for k, v in e.optimizer.state[p].items()}
            for p in e.params
        ]
        for p in e.params[:unstepped]:
            del e.optimizer.state[p]
        state.save_optimizer(e.module, e.optimizer, e.scheduler, Path(folder), self.rank)
        dist.barrier()
        before = shards()[unstepped:]
        e.optimizer.state.clear()
        with counted_reads(state) as reads:
            state.load_optimizer(e.module, e.optimizer, e.scheduler, Path(folder))
        after = shards()
        same = all(
            b.keys() == a.keys() and all(torch.equal(b[k], a[k]) for k in b)
            for b, a in zip(before, after[unstepped:], strict=True)
        )
        fresh = all(not a[k].any() for a in after[:unstepped] for k in ("exp_avg", "exp_avg_sq"))
        return same and len(before) > 0, len(reads), fresh

    @register(Dispatch.ALL, Collect.LIST)
    def weights_round_trip(self, folder: str) -> tuple[bool, int]:
        """The weights written by rank 0 as a model folder's safetensors, moved away, then
        loaded back (as evaluating a checkpoint does): whether this rank's shards are as they
        were, and how many files this rank read."""
        from safetensors.torch import save_file

        from treadle.engines import full_weights

        e = self.engine
        full = {name: t.clone() for name, t in full_weights.full_tensors(e.module)}
        if self.rank == 0:
            save_file(full, str(Path(folder) / "model.safetensors"))
        dist.barrier()
        shards = lambda: [p.to_local().clone() for p in e.module.parameters()]  # noqa: E731
        before = shards()
        with torch.no_grad():
            for p in e.module.parameters():
                p.add_(1.0)
        with counted_reads(full_weights) as reads:
            full_weights.load_full_weights(e.module, Path(folder))
        return all(torch.equal(b, a) for b, a in zip(before, shards(), strict=True)), len(reads)

    @register(Dispatch.ALL, Collect.RANK0)
    def saved_and_loaded_back(self, folder: str) -> tuple[list[str], bool]:
        """The names ``full_state(as_saved=True)`` sends vLLM, and whether the weights of a
        checkpoint, loaded back over changed weights (as ``treadle eval`` does), are as they
        were."""
        from treadle.engines.checkpoint import load_weights, save_checkpoint

        e = self.engine
        sent = [name for name, _ in e.full_state(as_saved=True)]
        save_checkpoint(e, Path(folder), self.rank, None, with_optimizer=False)
        before = [p.to_local().clone() for p in e.module.parameters()]
        with torch.no_grad():
            for p in e.module.parameters():
                p.add_(1.0)
        load_weights(e, Path(folder))
        after = [p.to_local() for p in e.module.parameters()]
        return sent, all(torch.equal(b, a) for b, a in zip(before, after, strict=True))

    @register(Dispatch.ALL, Collect.RANK0)
    def weights_load_error(self, folder: str) -> str:
        from treadle.engines.full_weights import load_full_weights

        try:
            load_full_weights(self.engine.module, Path(folder))
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    @register(Dispatch.ALL, Collect.LIST)
    def load_a_damaged_optimizer(self, folder: str) -> str:
        """``optimizer.safetensors`` cut short: what ``load_optimizer`` raises on this rank."""
        from treadle.engines import state

        file = Path(folder) / "optimizer.safetensors"
        if self.rank == 0:
            file.write_bytes(file.read_bytes()[:100])
        dist.barrier()
        try:
            state.load_optimizer(self.engine.module, self.engine.optimizer, None, Path(folder))
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    @register(Dispatch.ALL, Collect.RANK0)
    def reduced_before_each_micro_batch(self, batch: Batch) -> list[bool]:
        """A ``train_step`` in micro-batches of one row: whether the parameters held a reduced
        (sharded) gradient as each began."""
        seen: list[bool] = []

        def loss_fn(mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            seen.append(any(p.grad is not None for p in self.engine.module.parameters()))
            return self._nll(mb)

        self.engine.train_step(batch.split(1), loss_fn)
        return seen

    @register(Dispatch.ALL, Collect.RANK0)
    def gathered(self) -> tuple[list[str], int, int, bool]:
        """``full_tensors``' names, the sharded tensors it gathered, the model's distinct
        parameters, and whether the embedding it yields is the output head's weight."""
        from torch.distributed.tensor import DTensor

        from treadle.engines.full_weights import full_tensors

        gathers: list[torch.Size] = []
        real = DTensor.full_tensor
        DTensor.full_tensor = lambda t, *a, **k: gathers.append(t.shape) or real(t, *a, **k)  # type: ignore[method-assign]
        try:
            full = dict(full_tensors(self.engine.module))
        finally:
            DTensor.full_tensor = real  # type: ignore[method-assign]
        head = self.engine.module.lm.lm_head.weight.full_tensor()
        tied = torch.equal(full["model.embed_tokens.weight"], head)
        return list(full), len(gathers), len(list(self.engine.module.parameters())), tied

    @register(Dispatch.DP, Collect.CONCAT)
    def log_probs(self, batch: Batch) -> Batch:
        with torch.no_grad():
            logp, ent = self.engine.log_probs(
                batch["input_ids"],
                batch["attention_mask"],
                batch["rmask"].shape[1],
                temperature=0.7,
            )
        return Batch.from_dict(tensors={"logp": logp, "ent": ent})


def test_chunked_log_probs_equal_naive_forward(tiny_task):
    path = str(tiny_task["model"])
    batch = make_batch(vocab=100)
    group = WorkerGroup(GradWorker, world_size=1, backend="local", kwargs={"model_path": path})
    try:
        out = group.log_probs(batch)
    finally:
        group.shutdown()
    model = load_causal_lm(path)
    mask = batch["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = (
            model(
                input_ids=batch["input_ids"], attention_mask=mask, position_ids=pos
            ).logits.float()
            / 0.7
        )
    r = batch["rmask"].shape[1]
    logprobs = torch.log_softmax(logits[:, -r - 1 : -1], -1)
    want = logprobs.gather(-1, batch["input_ids"][:, -r:, None]).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    valid = batch["rmask"].bool()
    torch.testing.assert_close(out["logp"][valid], want[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["ent"][valid], entropy[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_fsdp_two_ranks_match_one_process(tiny_task, ray_session, tmp_path):
    from ray import cloudpickle

    from treadle.controller import ResourcePool

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    path = str(tiny_task["model"])
    batch = make_batch(vocab=100)
    # the two ranks' processes start while the one-process reference is computed here
    pool = ResourcePool(world_size=2, cpus_per_rank=1.0)
    group = WorkerGroup(
        GradWorker, world_size=2, backend="ray", pool=pool, kwargs={"model_path": path}, wait=False
    )
    try:
        local = WorkerGroup(GradWorker, world_size=1, backend="local", kwargs={"model_path": path})
        try:
            [(loss1, grads1)] = local.loss_and_grads(batch)
            ratio1, _, _ = local.step_weights(batch, 5.0)
        finally:
            local.shutdown()
        group.ready()
        results = group.loss_and_grads(batch)
        ratio2, _, _ = group.step_weights(batch, 5.0)
        # resuming: rank 0 alone reads the optimizer's file, each rank gets its shards back
        assert group.optimizer_round_trip(str(tmp_path)) == [(True, 1, True), (True, 0, True)]
        weights = tmp_path / "weights"
        weights.mkdir()
        assert group.weights_round_trip(str(weights)) == [(True, 1), (True, 0)]
        # a file rank 0 cannot read fails every rank (rank 1 would wait for its broadcast)
        first, second = group.load_a_damaged_optimizer(str(tmp_path))
        assert first.startswith("SafetensorError") and "rank 0 could not read" not in first
        assert second == f"CheckpointError: rank 0 could not read the checkpoint: {first}"
    finally:
        group.shutdown()
        pool.remove()
    # the update size's sums over each rank's shards, added over the ranks
    assert ratio2 == pytest.approx(ratio1, rel=1e-5)
    (loss2, grads2), (loss2b, _) = results
    assert loss2 == pytest.approx(loss1, rel=1e-6)
    assert loss2b == pytest.approx(loss1, rel=1e-6)
    assert grads1.keys() == grads2.keys()
    for name in grads1:
        torch.testing.assert_close(grads2[name], grads1[name], atol=1e-6, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in grads1.values())


class CheckpointedGradWorker(GradWorker):
    def __init__(self, rank, world_size, addr, port, *, model_path: str, **options) -> None:
        options["gradient_checkpointing"] = True
        super().__init__(rank, world_size, addr, port, model_path=model_path, **options)

    @register(Dispatch.ALL, Collect.RANK0)
    def checkpointing_active(self) -> bool:
        layers = self.engine.module.lm.get_decoder().layers
        return all(layer.gradient_checkpointing and layer.training for layer in layers)


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_task, compute_dtype):
    """Also in bf16 mixed precision, where the layers re-run in the backward must compute in
    bf16 again (torch 2.11's FSDP2 left their inputs uncast there: float32 rotary tables met
    bf16 values, "Expected query, key, and value to have the same dtype")."""
    path = str(tiny_task["model"])
    batch = make_batch(vocab=100)
    results = []
    kwargs = {"model_path": path, "compute_dtype": compute_dtype}
    for cls in (GradWorker, CheckpointedGradWorker):
        group = WorkerGroup(cls, world_size=1, backend="local", kwargs=kwargs)
        try:
            if cls is CheckpointedGradWorker:
                assert group.checkpointing_active()
            [(loss, grads)] = group.loss_and_grads(batch)
        finally:
            group.shutdown()
        results.append((loss, grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-6, rtol=1e-5)


def test_train_step_sums_micro_batches_into_one_optimizer_step(tiny_task):
    """The one update loop of every role: micro-batches of 1 give the full batch's gradient
    and loss, metrics are summed, the optimizer step's norm and rate come back prefixed."""
    path = str(tiny_task["model"])
    batch = make_batch(vocab=100)
    runs = []
    for micro in (4, 1):
        group = WorkerGroup(GradWorker, world_size=1, backend="local", kwargs={"model_path": path})
        try:
            runs.append(group.train_step_grads(batch, micro))
        finally:
            group.shutdown()
    (whole, grads_a), (parts, grads_b) = runs
    assert set(parts) == {
        "nll",
        "tokens",
        "x/grad_norm",
        "x/lr",
        "x/update_ratio",
        "perf/tflops/x",  # (no perf/mfu/x: a CPU has no known peak)
    }
    assert parts["tokens"] == whole["tokens"] == float(batch["rmask"].sum())
    assert parts["nll"] == pytest.approx(whole["nll"], rel=1e-6)
    assert parts["x/grad_norm"] == pytest.approx(whole["x/grad_norm"], rel=1e-5)
    assert whole["x/grad_norm"] > 0 and whole["x/lr"] == pytest.approx(1e-3)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("defer", [True, False])
def test_gradients_are_reduced_after_the_last_micro_batch_or_after_each(tiny_task, defer):
    """actor.defer_gradient_sync: FSDP2 reduces (and shards) the gradients once, after the
    last micro-batch, or after every one; the step's gradient is the same either way."""
    kwargs = {"model_path": str(tiny_task["model"]), "defer_gradient_sync": defer}
    batch = make_batch(vocab=100)

    def run(call: str, *args):
        group = WorkerGroup(GradWorker, world_size=1, backend="local", kwargs=kwargs)
        try:
            return getattr(group, call)(batch, *args)
        finally:
            group.shutdown()

    assert run("reduced_before_each_micro_batch") == [False] + [not defer] * (len(batch) - 1)
    (_, whole), (_, parts) = run("train_step_grads", 4), run("train_step_grads", 1)
    for name in whole:
        torch.testing.assert_close(parts[name], whole[name], atol=1e-6, rtol=1e-5)


def test_a_tied_output_embedding_is_gathered_once(tiny_task):
    """The tiny model ties its output head to its embedding: the state dict lists the one
    parameter twice, and ``full_tensors`` (a weight sync, a save) gathers and yields it once,
    as the embedding; every other parameter once too."""
    kwargs = {"model_path": str(tiny_task["model"])}
    group = WorkerGroup(GradWorker, world_size=1, backend="local", kwargs=kwargs)
    try:
        names, gathers, params, tied = group.gathered()
    finally:
        group.shutdown()
    assert tied and "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(set(names)) == len(names) == gathers == params


def test_a_parameter_without_optimizer_state_resumes_with_a_fresh_one(tiny_task, tmp_path):
    """A trainable parameter that never had a gradient (a vision tower trained on text alone)
    has no AdamW state to save; resuming gives it a fresh one, the others theirs, instead of
    torch's strict refusal (raised on rank 0 alone, the others left in its broadcast)."""
    kwargs = {"model_path": str(tiny_task["model"])}
    group = WorkerGroup(GradWorker, world_size=1, backend="local", kwargs=kwargs)
    try:
        group.step_weights(make_batch(vocab=100), 0.0)  # two steps: AdamW's state
        assert group.optimizer_round_trip(str(tmp_path), 2) == [(True, 1, True)]
    finally:
        group.shutdown()


def test_weights_that_are_not_the_model_s_are_refused_by_name(tiny_task, tmp_path):
    from safetensors.torch import save_file

    group = WorkerGroup(
        GradWorker, world_size=1, backend="local", kwargs={"model_path": str(tiny_task["model"])}
    )
    try:
        assert group.weights_load_error(str(tmp_path)) == (
            f"CheckpointError: {tmp_path} holds no *.safetensors weights"
        )
        save_file(
            {"model.norm.weight": torch.ones(3), "extra.bias": torch.ones(1)},
            str(tmp_path / "m.safetensors"),
        )
        error = group.weights_load_error(str(tmp_path))
    finally:
        group.shutdown()
    assert error.startswith(f"CheckpointError: {tmp_path} does not hold this model's weights")
    assert "unknown: ['lm.extra.bias']" in error and error.endswith("is it the run's model?")


def test_a_mixture_of_experts_goes_out_as_its_files_and_loads_back(tiny_task, tmp_path):
    """transformers 5 holds a Mixtral's experts fused (and ``block_sparse_moe`` as ``mlp``):
    the weights vLLM is sent are named as the model's files, and a checkpoint's folder loads
    back into the engine (raw names, it was refused as not the run's model)."""
    from safetensors.torch import load_file
    from tiny_models import tiny_family

    folder = tiny_family(tmp_path / "moe", tiny_task["model"])
    group = WorkerGroup(
        GradWorker, world_size=1, backend="local", kwargs={"model_path": str(folder)}
    )
    try:
        sent, same = group.saved_and_loaded_back(str(tmp_path / "checkpoint"))
    finally:
        group.shutdown()
    assert sorted(sent) == sorted(load_file(str(folder / "model.safetensors")))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in sent
    assert same


def test_train_step_rates_the_model_flops_of_its_forwards(tiny_task):
    """``perf/tflops/<role>``: the rows the step's graph-building forwards took (the batch's
    lengths 9, 8, 10, 10, in one micro-batch or four; the gradient-free forward beside each
    not counted), by treadle's count, over the step's 2 s."""
    from transformers import AutoConfig

    from treadle.engines.flops import update_flops

    path = str(tiny_task["model"])
    batch = make_batch(vocab=100)
    assert batch["attention_mask"].sum(-1).tolist() == [9, 8, 10, 10]
    want = update_flops(AutoConfig.from_pretrained(path), 37, 81 + 64 + 100 + 100) / 2 / 1e12
    group = WorkerGroup(GradWorker, world_size=1, backend="local", kwargs={"model_path": path})
    try:
        for micro in (4, 1):
            got = group.timed_step(batch, micro)
            assert got["perf/tflops/x"] == pytest.approx(want, rel=1e-12)
            assert "perf/mfu/x" not in got
    finally:
        group.shutdown()


@pytest.mark.parametrize("decay", [0.0, 5.0])  # 5: lr·wd as large as the Adam step
def test_update_ratio_is_the_step_s_change_over_the_weights(tiny_task, decay):
    """``update_ratio``, rebuilt from AdamW's state, against ||after - before|| / ||before||."""
    group = WorkerGroup(
        GradWorker, world_size=1, backend="local", kwargs={"model_path": str(tiny_task["model"])}
    )
    try:
        ratio, before, after = group.step_weights(make_batch(vocab=100), decay)
    finally:
        group.shutdown()
    change = sum(
        float((a.double() - b.double()).square().sum()) for a, b in zip(after, before, strict=True)
    )
    weights = sum(float(b.double().square().sum()) for b in before)
    assert change > 0 and ratio == pytest.approx((change / weights) ** 0.5, rel=1e-4)


def test_update_ratio_of_a_step_at_lr_0_is_0():
    """A schedule's lr of 0 (a warm-up's first step, a decay to 0): AdamW moves nothing, and the
    ratio says 0 rather than dividing by the lr."""
    from treadle.engines.fsdp import update_ratio

    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = torch.optim.AdamW([w], lr=0.0, weight_decay=0.1)
    w.grad = torch.tensor([1.0, -1.0])
    opt.step()
    assert w.tolist() == [3.0, 4.0] and update_ratio(opt) == 0.0
    opt.param_groups[0]["lr"] = 0.5  # and a step that moves, by hand: the same g twice makes
    opt.step()  # Adam's bias-corrected step lr·g/|g|, after the decay θ·(1 - lr·wd)
    before = torch.tensor([3.0, 4.0])
    torch.testing.assert_close(w.detach(), before * 0.95 - 0.5 * torch.tensor([1.0, -1.0]))
    assert update_ratio(opt) == pytest.approx(float((w.detach() - before).norm() / 5.0), rel=1e-5)


def test_a_step_whose_gradient_is_zero_moves_nothing(tiny_task):
    """A batch with nothing to learn from (every advantage 0, no KL or entropy term) after one
    that had: AdamW would still move the weights by its momentum and weight decay (a run from
    the base model whose groups all scored 0 drifted that way for 28 steps); the step is
    skipped."""
    group = WorkerGroup(
        GradWorker, world_size=1, backend="local", kwargs={"model_path": str(tiny_task["model"])}
    )
    try:
        metrics, before, after, adam, adam_after = group.zero_gradient_step(make_batch(vocab=100))
    finally:
        group.shutdown()
    assert metrics["grad_norm"] == 0.0 and metrics["update_ratio"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert len(adam) == len(adam_after) == len(before)
    for s, t in zip(adam, adam_after, strict=True):  # the step count and the moments as they were
        assert s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s)


def test_weights_and_moments_that_wait_on_the_host_train_as_resident_ones(tiny_task):
    """actor.offload_params and actor.offload_optimizer: the weights go to host memory where the
    engine waits, the moments after every step, and each comes back for its use; the weights
    of three steps are those of an engine that kept them. Under the device double the moments
    are on the host between steps (a GPU's memory freed), and a step they are not brought back
    for fails, as it would on a GPU ("cuda:0 and cpu")."""
    from device_double import DeviceMixError

    batch, path = make_batch(vocab=100), str(tiny_task["model"])

    def run(offload: bool, forget: bool = False):
        options = {"offload_params": offload, "offload_optimizer": offload}
        kwargs = {"model_path": path, **options}
        group = WorkerGroup(GradWorker, world_size=1, backend="local", kwargs=kwargs)
        try:
            return group.waiting_steps(batch, forget)
        finally:
            group.shutdown()

    kept, places, away = run(False)
    assert places == [{"device"}] * 3 and away == [False] * 3
    weights, places, away = run(True)
    assert places == [{"host"}] * 3 and away == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(weights, kept, strict=True))
    with pytest.raises(DeviceMixError, match="_fused_adamw_ mixes host and device"):
        run(True, forget=True)


def test_a_checkpoint_s_rng_state_holds_the_gpu_s(monkeypatch, tmp_path):
    """On a GPU dropout (LoRA's) draws from the GPU's generator: a checkpoint keeps its state
    beside the CPU's, and a resume restores it (a stand-in GPU here); a checkpoint without it
    (saved on a CPU) restores the CPU's alone; a rank without one is named."""
    from safetensors.torch import save_file

    from treadle.engines.state import load_rng_state, save_rng_state
    from treadle.models.checkpoint import CheckpointError

    gpu = {"state": torch.arange(16, dtype=torch.uint8)}

    def get_gpu_state() -> torch.Tensor:
        return gpu["state"].clone()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", get_gpu_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: gpu.update(state=s.clone()))
    save_rng_state(tmp_path, 0)
    cpu = torch.get_rng_state()
    torch.rand(3)
    gpu["state"] = torch.zeros(16, dtype=torch.uint8)
    load_rng_state(tmp_path, 0)
    assert torch.equal(torch.get_rng_state(), cpu)
    assert torch.equal(gpu["state"], torch.arange(16, dtype=torch.uint8))
    save_file({"torch": cpu}, str(tmp_path / "rng_rank1.safetensors"))  # a CPU's checkpoint
    load_rng_state(tmp_path, 1)  # the GPU's state is left as it is
    assert torch.equal(gpu["state"], torch.arange(16, dtype=torch.uint8))
    with pytest.raises(CheckpointError, match=r"rng_rank2\.safetensors is missing: .* by fewer"):
        load_rng_state(tmp_path, 2)  # (a run resumed on more ranks than saved it)
