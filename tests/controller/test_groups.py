"""Dispatch and collect: how the driver's call is spread over ranks and gathered back, and
the batch fields a worker method declares."""

from __future__ import annotations

import pickle
import socket
import types
from pathlib import Path

import pytest
import torch

from treadle.controller import (
    Collect,
    Dispatch,
    Worker,
    WorkerGroup,
    collect_results,
    dispatch_args,
    free_port,
    method_spec,
    register,
)
from treadle.engines.parallel import Layout
from treadle.protocol import Batch
from treadle.runtime.errors import ConfigError


def numbered(n: int) -> Batch:
    return Batch.from_dict(tensors={"x": torch.arange(n)}, objects={"uid": list("abcdef")[:n]})


def test_dp_cuts_batches_and_broadcasts_the_rest():
    parts = dispatch_args(Dispatch.DP, 3, (numbered(6), "params"), {"flag": True})
    assert [p[0][0]["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [list(p[0][0]["uid"]) for p in parts] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert all(p[0][1] == "params" and p[1] == {"flag": True} for p in parts)


def test_dp_refuses_uneven_batches():
    with pytest.raises(ValueError, match="5 samples cannot be split evenly over 2 data-parallel"):
        dispatch_args(Dispatch.DP, 2, (numbered(5),), {})


def test_ranks_of_a_parallel_group_get_the_same_shard_and_one_answers():
    """4 ranks in 2 tensor- or sequence-parallel groups: 2 data-parallel shards."""
    parts = dispatch_args(Dispatch.DP, 4, (numbered(4), "p"), {}, dp_ranks=[0, 0, 1, 1])
    assert [p[0][0]["x"].tolist() for p in parts] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    collects = [True, False, True, False]
    results = [Batch.from_dict(tensors={"x": p[0][0]["x"] * 10}) for p in parts]
    assert collect_results(Collect.CONCAT, results, collects)["x"].tolist() == [0, 10, 20, 30]
    means = [{"a": 1.0}, {"a": 1.0}, {"a": 3.0}, {"a": 3.0}]
    assert collect_results(Collect.MEAN, means, collects) == {"a": 2.0}
    assert collect_results(Collect.LIST, [1, 1, 2, 2], collects) == [1, 2]
    assert collect_results(Collect.RANK0, [1, 1, 2, 2], collects) == 1


def test_the_ranks_metrics_are_averaged_and_their_peaks_the_highest():
    peak = "perf/max_memory_allocated_gib/update_actor"
    results = [{"actor/loss": 1.0, peak: 5.0}, {"actor/loss": 2.0, peak: 7.5}]
    assert collect_results(Collect.MEAN, results) == {"actor/loss": 1.5, peak: 7.5}


def test_a_layout_gives_each_rank_its_shard():
    layout = Layout(world_size=6, tp=3)
    assert layout.dp == 2 and layout.group_size == 3
    assert [layout.data_parallel(r) for r in range(6)] == [
        (0, True),
        (0, False),
        (0, False),
        (1, True),
        (1, False),
        (1, False),
    ]
    with pytest.raises(ConfigError, match="world_size=6 must be divisible by"):
        Layout(world_size=6, sp=4)


def test_all_sends_the_same_arguments():
    b = numbered(2)
    parts = dispatch_args(Dispatch.ALL, 2, (b,), {})
    assert parts[0][0][0] is b and parts[1][0][0] is b


def test_collect_modes():
    assert collect_results(Collect.RANK0, [1, 2]) == 1
    assert collect_results(Collect.LIST, [1, 2]) == [1, 2]
    assert collect_results(Collect.MEAN, [{"a": 1.0, "b": 4}, {"a": 3.0, "b": 0}]) == {
        "a": 2.0,
        "b": 2.0,
    }
    cat = collect_results(Collect.CONCAT, numbered(4).chunk(2))
    assert cat["x"].tolist() == [0, 1, 2, 3]


class Echo(Worker):
    """Methods that hand back what reached the rank."""

    @register(Dispatch.DP, Collect.RANK0, reads=("x",), optional=("uid", "absent"))
    def received(self, batch: Batch, other: Batch | None = None) -> tuple[list, dict, list]:
        return batch.keys(), batch.meta, other.keys() if other is not None else []

    @register(Dispatch.DP, Collect.RANK0)
    def undeclared(self, batch: Batch) -> list[str]:
        return batch.keys()

    @register(Dispatch.DP, Collect.CONCAT, reads=("x",), returns=("y",))
    def adds(self, batch: Batch, keys: list[str]) -> Batch:
        return Batch.from_dict(tensors={k: batch["x"] for k in keys})


@pytest.fixture
def echo():
    group = WorkerGroup(Echo, world_size=1, backend="local")
    yield group
    group.shutdown()


def rl_like(n: int = 4) -> Batch:
    return Batch.from_dict(
        tensors={"x": torch.arange(n), "y": torch.ones(n, 3)},
        objects={"uid": list(range(n)), "text": ["a long decoded response"] * n},
        meta={"step": 7},
    )


def test_a_method_receives_only_the_fields_it_declares(echo):
    keys, meta, other = echo.received(rl_like())
    assert keys == ["x", "uid"]  # "y" and "text" stay on the driver; "absent" is optional
    assert meta == {"step": 7}
    _, _, other = echo.received(rl_like(), other=rl_like())  # keyword batches too
    assert other == ["x", "uid"]
    assert echo.undeclared(rl_like()) == ["x", "y", "uid", "text"]  # undeclared: everything


def test_a_missing_declared_field_names_the_method_and_the_field(echo):
    batch = rl_like().pop(["uid", "text", "y"])  # has uid, text, y but no x
    with pytest.raises(KeyError, match=r"Echo.received reads \['x'\].*it has \['y', 'uid'"):
        echo.received(batch)


def test_returned_fields_are_checked_against_the_declaration(echo):
    assert echo.adds(rl_like(), ["y"]).keys() == ["y"]
    assert echo.adds(rl_like(), ["y", "x"]).keys() == ["y", "x"]  # a field it read may return
    with pytest.raises(ValueError, match=r"Echo.adds declares returns=\['y'\].*missing \['y'\]"):
        echo.adds(rl_like(), [])
    with pytest.raises(ValueError, match=r"undeclared \['z'\]"):
        echo.adds(rl_like(), ["y", "z"])


def test_the_actor_update_ships_no_rollout_text():
    """The update reads token tensors and advantages; a rollout batch also holds the prompts'
    and responses' text, the ground truth and the per-token scores: they stay on the driver."""
    from treadle.workers import ActorRolloutRefWorker

    n, p, r = 8, 16, 64
    batch = Batch.from_dict(
        tensors={
            "prompts": torch.ones(n, p, dtype=torch.long),
            "prompt_mask": torch.ones(n, p, dtype=torch.long),
            **{k: torch.ones(n, r, dtype=torch.long) for k in ("responses", "response_mask")},
            **{
                k: torch.zeros(n, r)
                for k in (
                    "rollout_log_probs",
                    "token_level_scores",
                    "token_level_rewards",
                    "advantages",
                    "returns",
                )
            },
        },
        objects={
            "uid": [str(i // 2) for i in range(n)],
            "prompt_text": [f"What is {i} + 30? Answer with a number." * 4 for i in range(n)],
            "response_text": [f"Let me think step by step, {i} times." * 8 for i in range(n)],
            "ground_truth": ["42"] * n,
            "stop_reason": ["stop"] * n,
        },
    )
    spec = method_spec(ActorRolloutRefWorker.update_actor)
    assert spec is not None
    sent = spec.narrow("update_actor", batch)
    assert sorted(sent.keys()) == sorted(
        ["prompts", "prompt_mask", "responses", "response_mask", "advantages", "rollout_log_probs"]
    )
    dropped = sum(batch[k].nbytes for k in batch.tensors if k not in sent)
    dropped += sum(len(t) for k in batch.objects for t in batch[k])
    assert len(pickle.dumps(batch)) - len(pickle.dumps(sent)) >= dropped > 0.4 * sent.nbytes


class _Handle:
    def __init__(self, actor_id: str) -> None:
        self._actor_id = bytes.fromhex(actor_id)


RAY_SIGKILL = (
    "The actor died unexpectedly before finishing this task.\n"
    "\tclass_name: ActorRolloutRefWorker\n\tactor_id: {id}\n\tpid: 4242\n\tip: 127.0.0.1\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
    "Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file."
)
RAY_OOM = (
    "The actor died unexpectedly before finishing this task.\n\tpid: 77\n"
    "Task was killed due to the node running low on memory. ... To adjust the kill threshold, "
    "set the environment variable `RAY_memory_usage_threshold` when starting Ray."
)


def _two_ranks() -> WorkerGroup:
    from treadle.workers import ActorRolloutRefWorker

    group = object.__new__(WorkerGroup)
    group.worker_cls = ActorRolloutRefWorker
    group.workers = [_Handle("aa" * 16), _Handle("bb" * 16)]
    return group


@pytest.mark.parametrize(
    ("text", "rank", "expected"),
    [
        (
            RAY_SIGKILL,
            1,
            "actor rank 1 (pid 4242) died during update_actor (its process ended without a "
            "Python error: killed (SIGKILL, the kernel's out-of-memory killer) or crashed)",
        ),
        (
            RAY_OOM,
            0,
            "actor rank 0 (pid 77) died during update_actor (killed by Ray's memory monitor: "
            "the node ran low on memory)",
        ),
    ],
)
def test_a_dead_rank_is_named_by_role_rank_pid_and_cause(text, rank, expected):
    from ray.exceptions import RayActorError

    actor_id = ["aa", "bb"][rank] * 16
    error = RayActorError(actor_id, text.format(id=actor_id))
    assert _two_ranks().died(error, "during update_actor") == expected


def test_out_of_memory_in_a_rank_names_it_and_an_unknown_actor_is_rank_unknown():
    from treadle.controller import death_cause

    group = object.__new__(WorkerGroup)
    group.worker_cls, group.workers = Worker, [_Handle("aa" * 16)]
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert death_cause(oom) == "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert (
        group.died(oom, "while starting", "cc" * 16)
        == "Worker rank ? died while starting (out of memory: CUDA out of memory. Tried to "
        "allocate 2.00 GiB)"
    )


def test_a_rendezvous_port_is_free_and_outside_the_ephemeral_range():
    # Outgoing connections take their ports from the ephemeral range: one of them could take
    # a port handed out from there before rank 0 binds it (EADDRINUSE, seen under load).
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= p < low for p in ports), ports
    assert len(ports) > 1  # drawn at random, not one port every process would pick alike
    with socket.socket() as s:
        s.bind(("", ports.pop()))  # free


# What a gloo rank's collective raised here when its peer's process was SIGKILLed / exited.
GLOO_RESET = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:21711: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application."
)
GLOO_CLOSED = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:48533. This is typically caused by a remote worker crashing."
)


class _Futures:
    """Stand-ins for `ray.get`/`ray.wait` over two ranks' futures ("f0", "f1"): each future's
    outcome is ``errors[name]`` (an exception) or a value; calls to `ray.wait` are counted."""

    def __init__(self, monkeypatch, first: Exception, errors: dict[str, Exception]) -> None:
        import ray

        from treadle.controller.groups import group as groups

        self.waits = 0

        def ray_get(futures):
            raise first

        def get(future):
            if future in errors:
                raise errors[future]
            return future

        def wait(futures, num_returns, timeout):
            self.waits += 1
            return list(futures), []

        monkeypatch.setattr(groups, "ray_get", ray_get)
        monkeypatch.setattr(ray, "get", get)
        monkeypatch.setattr(ray, "wait", wait)


def test_a_ranks_own_error_is_raised_without_waiting_for_its_peers(monkeypatch):
    """Rank 0's full disk while rank 1 waits in a collective for it: the error is raised at
    once; waiting for rank 1 (which would never answer) took 30 s a run before."""
    from ray.exceptions import RayTaskError

    own = RayTaskError("save_checkpoint", "OSError: [Errno 28] No space left", OSError(28, "x"))
    futures = _Futures(monkeypatch, own, {"f0": own})
    with pytest.raises(RayTaskError) as raised:
        _two_ranks()._get(["f0", "f1"], "during save_checkpoint")
    assert raised.value is own and futures.waits == 0


@pytest.mark.parametrize("peer_error", [GLOO_RESET, GLOO_CLOSED])
def test_a_peer_lost_seen_first_names_the_rank_that_died(monkeypatch, peer_error):
    from ray.exceptions import RayActorError, RayTaskError

    from treadle.runtime.errors import WorkerDied

    lost = RayTaskError("update_actor", f"Traceback ...\n{peer_error}", RuntimeError(peer_error))
    dead = RayActorError("bb" * 16, RAY_SIGKILL.format(id="bb" * 16))
    futures = _Futures(monkeypatch, lost, {"f0": lost, "f1": dead})
    with pytest.raises(WorkerDied, match=r"^actor rank 1 \(pid 4242\) died during update_actor"):
        _two_ranks()._get(["f0", "f1"], "during update_actor")
    assert futures.waits == 1


class _Pinged(_Handle):
    """A rank whose ping (``__ray_ready__``) is the future ``name``."""

    def __init__(self, actor_id: str, name: str) -> None:
        super().__init__(actor_id)
        self.__ray_ready__ = types.SimpleNamespace(remote=lambda: name)


def test_find_dead_names_the_rank_whose_ping_says_its_process_is_gone(monkeypatch):
    from ray.exceptions import RayActorError

    group = _two_ranks()
    group.backend = "ray"
    group.workers = [_Pinged("aa" * 16, "f0"), _Pinged("bb" * 16, "f1")]
    dead = RayActorError("bb" * 16, RAY_SIGKILL.format(id="bb" * 16))
    futures = _Futures(monkeypatch, dead, {"f1": dead})
    died = group.find_dead("during rollout_generate")
    assert str(died).startswith("actor rank 1 (pid 4242) died during rollout_generate (its ")
    assert futures.waits == 1
    _Futures(monkeypatch, dead, {})
    assert group.find_dead("during rollout_generate") is None  # both answered


def test_a_peer_lost_in_a_rollout_is_the_dead_rank_on_the_drivers_line():
    """A colocated rollout's rank 0 fails in FSDP's all-gather before rank 1's death reaches the
    driver (seen in CI): the driver names rank 1 and the call, not rank 0's gloo error."""
    from ray.exceptions import RayTaskError

    from treadle.runtime.errors import WorkerDied
    from treadle.trainers.base import Trainer

    lost = RayTaskError(
        "rollout_generate",
        f"Traceback ...\n{GLOO_RESET}",
        RuntimeError(GLOO_RESET),
        proctitle="ray::ActorRolloutRefWorker.rollout_generate",
    ).as_instanceof_cause()
    asked = []

    class Group:
        def __init__(self, died):
            self.died = died

        def find_dead(self, when):
            asked.append(when)
            return self.died and WorkerDied(f"actor rank 1 died {when}")

    trainer = object.__new__(Trainer)
    trainer.group, trainer.side = Group(None), {"ref": Group("yes")}
    assert str(trainer.dead_peer(lost)) == "actor rank 1 died during rollout_generate"
    assert asked == ["during rollout_generate"] * 2
    assert trainer.dead_peer(RuntimeError("No space left on device")) is None
    trainer.side = {}
    assert trainer.dead_peer(lost) is None  # no rank found dead: the error stands


# ---------------------------------------------------------------- GPUs of a rank


@pytest.mark.parametrize(
    ("noset", "visible", "ids", "index"),
    [
        ("", None, [0], 0),  # Ray's default: CUDA_VISIBLE_DEVICES is the rank's one GPU
        ("1", None, [3], 3),  # every GPU of the node visible: the id is the index
        ("1", "4,5,6,7", ["6"], 2),  # ids among a visible list the node was started with
        ("true", "0,1", [], 0),  # no GPU given (a driver's process)
    ],
)
def test_a_rank_takes_the_gpu_ray_gave_it(monkeypatch, noset, visible, ids, index):
    from treadle.controller.groups import worker

    fake = types.SimpleNamespace(is_initialized=lambda: True, get_gpu_ids=lambda: ids)
    monkeypatch.setitem(__import__("sys").modules, "ray", fake)
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", noset)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert worker.gpu_index() == index


def test_a_process_given_no_gpu_sees_none():
    """Ray 2.60 leaves every GPU of its node visible to an actor with num_gpus=0 (measured with
    declared GPUs: CUDA_VISIBLE_DEVICES unset there); the run hides them itself."""
    from treadle.controller import ray_env

    assert ray_env(1, 0.0)["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in ray_env(1, 0.5)  # Ray sets it to the bundle's GPU
