"""Tests of `treadle.protocol.batch.Batch`: every operation on small integer batches, the schema
check, and transport by pickle (protocol 5) and through a real Ray actor."""

from __future__ import annotations

import copy
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import treadle.protocol.fields
from treadle.protocol import STANDARD_SHAPES, Batch

ROOT = Path(__file__).resolve().parents[1]


def make(n: int = 4) -> Batch:
    """x = [0, 1, ...], m = [[0, 0], [1, 10], ...], uid = ["a", "b", ...], meta step 3."""
    rows = torch.arange(n)
    return Batch.from_dict(
        tensors={"x": rows, "m": torch.stack([rows, 10 * rows], dim=1)},
        objects={"uid": [chr(ord("a") + i) for i in range(n)]},
        meta={"step": 3},
    )


def xs(batch: Batch) -> list[int]:
    return batch["x"].tolist()


# ---- construction and access -------------------------------------------------------------


def test_from_dict_and_access() -> None:
    b = make()
    assert len(b) == 4
    assert b.keys() == ["x", "m", "uid"]
    assert list(b) == ["x", "m", "uid"]
    assert "m" in b and "uid" in b and "nope" not in b
    assert b["m"].tolist() == [[0, 0], [1, 10], [2, 20], [3, 30]]
    assert b["uid"].dtype == object and b["uid"].tolist() == ["a", "b", "c", "d"]
    assert b.meta == {"step": 3}
    assert b.nbytes == 4 * 8 + 4 * 2 * 8
    assert "len=4" in repr(b) and "m: [4, 2] int64" in repr(b)


def test_objects_of_equal_length_lists_stay_one_per_row() -> None:
    b = Batch.from_dict(objects={"pair": [[1, 2], [3, 4]], "none": [None, {"k": 1}]})
    assert b["pair"].shape == (2,)
    assert b["pair"][1] == [3, 4]
    assert b["none"][1] == {"k": 1}


def test_empty_batch_has_length_zero() -> None:
    assert len(Batch()) == 0
    assert len(Batch.from_dict(meta={"t": 1.0})) == 0


def test_construction_rejects_mismatched_sizes() -> None:
    with pytest.raises(ValueError, match="tensor 'b' has batch size 3, but tensor 'a' has 4"):
        Batch.from_dict(tensors={"a": torch.zeros(4), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="object 'u' has batch size 2, but tensor 'a' has 4"):
        Batch.from_dict(tensors={"a": torch.zeros(4)}, objects={"u": ["p", "q"]})
    with pytest.raises(ValueError, match="tensor 's' is 0-d"):
        Batch.from_dict(tensors={"s": torch.tensor(1.0)})
    with pytest.raises(ValueError, match=re.escape("both tensors and objects: ['k']")):
        Batch.from_dict(tensors={"k": torch.zeros(2)}, objects={"k": [1, 2]})
    with pytest.raises(ValueError, match="object field 'o' must be 1-D"):
        Batch.from_dict(objects={"o": np.empty((2, 2), dtype=object)})


def test_getitem_missing_key() -> None:
    with pytest.raises(KeyError, match="batch has no key 'y'"):
        make()["y"]


# ---- in-place changes --------------------------------------------------------------------


def test_setitem_adds_tensor_or_objects() -> None:
    b = make()
    b["y"] = torch.tensor([7, 8, 9, 10])
    b["text"] = ["p", "q", "r", "s"]
    assert b["y"].tolist() == [7, 8, 9, 10]
    assert b.objects["text"].tolist() == ["p", "q", "r", "s"]
    b["uid"] = torch.tensor([1, 2, 3, 4])  # a key may change kind: it moves to tensors
    assert "uid" in b.tensors and "uid" not in b.objects


def test_setitem_wrong_size_names_key_and_sizes_and_changes_nothing() -> None:
    b = make()
    with pytest.raises(ValueError, match="tensor 'y' has batch size 3, but tensor 'x' has 4"):
        b["y"] = torch.zeros(3)
    with pytest.raises(ValueError, match="object 'uid' has batch size 5, but tensor 'x' has 4"):
        b["uid"] = ["a", "b", "c", "d", "e"]
    assert b.keys() == ["x", "m", "uid"]
    assert b["uid"].tolist() == ["a", "b", "c", "d"]


def test_update_is_all_or_nothing() -> None:
    b = make()
    b.update(tensors={"y": torch.ones(4)}, objects={"t": list("wxyz")}, meta={"temp": 0.7})
    assert b["t"].tolist() == ["w", "x", "y", "z"]
    assert b.meta == {"step": 3, "temp": 0.7}
    with pytest.raises(ValueError, match="object 'bad' has batch size 2"):
        b.update(tensors={"z": torch.ones(4)}, objects={"bad": [1, 2]})
    assert "z" not in b
    b.update(tensors={"x": torch.arange(4) * 5})  # replacing a key keeps the rest
    assert xs(b) == [0, 5, 10, 15]


def test_replacing_the_only_key_may_change_the_size() -> None:
    b = Batch.from_dict(tensors={"x": torch.arange(3)})
    b["x"] = torch.arange(5)
    assert len(b) == 5


def test_pop_removes_and_returns() -> None:
    b = make()
    popped = b.pop(["m", "uid"])
    assert popped.keys() == ["m", "uid"]
    assert popped["m"][3].tolist() == [3, 30]
    assert popped.meta == {"step": 3}
    assert b.keys() == ["x"]
    assert b.pop("x").keys() == ["x"]
    with pytest.raises(KeyError, match=re.escape("batch is missing ['q']")):
        make().pop(["x", "q"])


# ---- new batches -------------------------------------------------------------------------


def test_only() -> None:
    b = make()
    sub = b.only(["m"], ["uid"])
    assert sub.keys() == ["m", "uid"]
    assert sub.meta == {"step": 3}
    assert b.keys() == ["x", "m", "uid"]
    assert make().only(tensor_keys=["x"]).keys() == ["x"]
    with pytest.raises(KeyError, match=re.escape("batch has no ['uid']")):
        b.only(tensor_keys=["uid"])


@pytest.mark.parametrize(
    "indices",
    [
        [3, 0, 0],
        [-1, 0, -4],
        torch.tensor([3, 0, 0]),
        np.array([3, 0, 0], dtype=np.int32),
    ],
)
def test_select_by_indices(indices: object) -> None:
    s = make().select(indices)  # type: ignore[arg-type]
    assert xs(s) == [3, 0, 0]
    assert s["m"].tolist() == [[3, 30], [0, 0], [0, 0]]
    assert s["uid"].tolist() == ["d", "a", "a"]
    assert s.meta == {"step": 3}


@pytest.mark.parametrize(
    "mask",
    [[True, False, False, True], torch.tensor([1, 0, 0, 1]).bool(), np.array([1, 0, 0, 1]) > 0],
)
def test_select_by_mask(mask: object) -> None:
    s = make().select(mask)  # type: ignore[arg-type]
    assert xs(s) == [0, 3]
    assert s["uid"].tolist() == ["a", "d"]


def test_select_copies_and_checks() -> None:
    b = make()
    s = b.select([1, 2])
    s["x"][0] = 99
    assert xs(b) == [0, 1, 2, 3]
    assert len(b.select([])) == 0
    with pytest.raises(IndexError, match="index 4 is out of range for a batch of 4"):
        b.select([0, 4])
    with pytest.raises(ValueError, match="boolean mask has 3 entries for a batch of 4"):
        b.select([True, False, True])
    with pytest.raises(TypeError, match="indices must be integers or booleans"):
        b.select(np.array([0.0, 1.0]))


def test_slice_is_a_view() -> None:
    b = make()
    s = b.slice(1, 3)
    assert xs(s) == [1, 2]
    assert s["uid"].tolist() == ["b", "c"]
    s["x"][0] = 99  # views, like torch.split: documented
    assert xs(b) == [0, 99, 2, 3]
    assert xs(b.slice(2)) == [2, 3]


def test_split_by_size() -> None:
    parts = make(7).split(3)
    assert [xs(p) for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [p["uid"].tolist() for p in parts] == [["a", "b", "c"], ["d", "e", "f"], ["g"]]
    assert all(p.meta == {"step": 3} for p in parts)
    assert [xs(p) for p in make(4).split(10)] == [[0, 1, 2, 3]]


def test_split_by_sizes() -> None:
    parts = make(7).split([2, 0, 5])
    assert [xs(p) for p in parts] == [[0, 1], [], [2, 3, 4, 5, 6]]
    with pytest.raises(ValueError, match=re.escape("split sizes [2, 4] do not add up to")):
        make(7).split([2, 4])
    with pytest.raises(ValueError, match="split size must be at least 1, got 0"):
        make(7).split(0)


def test_chunk() -> None:
    parts = make(7).chunk(3)
    assert [xs(p) for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [p["m"][:, 1].tolist() for p in parts] == [[0, 10, 20], [30, 40], [50, 60]]
    assert [xs(p) for p in make(4).chunk(4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="cannot chunk a batch of 7 rows into 8 pieces"):
        make(7).chunk(8)
    with pytest.raises(ValueError, match="cannot chunk a batch of 7 rows into 0 pieces"):
        make(7).chunk(0)


def test_concat() -> None:
    a, b = make(2), make(3)
    b.meta["step"] = 4
    c = Batch.concat([a, b])
    assert xs(c) == [0, 1, 0, 1, 2]
    assert c["m"][:, 1].tolist() == [0, 10, 0, 10, 20]
    assert c["uid"].tolist() == ["a", "b", "a", "b", "c"]
    assert c.meta == {"step": 3}
    assert xs(Batch.concat(make(7).chunk(3))) == list(range(7))


def test_concat_errors() -> None:
    a, b = make(2), make(2)
    b.pop("m")
    b["z"] = torch.zeros(2)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "batch 1 has different tensor keys than batch 0: missing ['m'], extra ['z']"
        ),
    ):
        Batch.concat([a, b])
    c = make(2)
    c["m"] = torch.zeros(2, 3)
    with pytest.raises(
        ValueError,
        match=re.escape("cannot concat tensor 'm': batch 0 has shape [2, 2], batch 1 has [2, 3]"),
    ):
        Batch.concat([a, c])
    with pytest.raises(ValueError, match="concat needs at least one batch"):
        Batch.concat([])


def test_repeat() -> None:
    b = make(2)
    r = b.repeat(3)
    assert xs(r) == [0, 0, 0, 1, 1, 1]
    assert r["uid"].tolist() == ["a", "a", "a", "b", "b", "b"]
    t = b.repeat(2, interleave=False)
    assert xs(t) == [0, 1, 0, 1]
    assert t["m"].tolist() == [[0, 0], [1, 10], [0, 0], [1, 10]]
    assert t["uid"].tolist() == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="repeat count must be at least 1, got 0"):
        b.repeat(0)


def test_pad_to_multiple_and_unpad() -> None:
    padded, count = make(6).pad_to_multiple(4)
    assert count == 2
    assert xs(padded) == [0, 1, 2, 3, 4, 5, 0, 1]
    assert padded["uid"].tolist() == list("abcdefab")
    assert xs(padded.unpad(count)) == [0, 1, 2, 3, 4, 5]

    padded, count = make(2).pad_to_multiple(5)  # more padding than rows: cycle through them
    assert (xs(padded), count) == ([0, 1, 0, 1, 0], 3)

    same, count = make(4).pad_to_multiple(2)
    assert (xs(same), count) == ([0, 1, 2, 3], 0)
    assert xs(make(4).unpad(0)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot unpad 5 rows from a batch of 4"):
        make(4).unpad(5)


def test_union() -> None:
    a = make()
    b = Batch.from_dict(
        tensors={"x": torch.arange(4), "y": torch.tensor([5, 6, 7, 8])},
        objects={"uid": list("abcd"), "gt": [1, 2, 3, 4]},
        meta={"temp": 1.0},
    )
    u = a.union(b)
    assert u.keys() == ["x", "m", "y", "uid", "gt"]
    assert u["y"].tolist() == [5, 6, 7, 8]
    assert u.meta == {"step": 3, "temp": 1.0}
    assert a.keys() == ["x", "m", "uid"]


def test_union_conflicts() -> None:
    a = make()
    other = Batch.from_dict(tensors={"x": torch.tensor([0, 1, 2, 9])})
    with pytest.raises(ValueError, match="key 'x' is in both batches with different contents"):
        a.union(other)
    with pytest.raises(ValueError, match="key 'uid' is in both batches"):
        a.union(Batch.from_dict(objects={"uid": list("abce")}))
    with pytest.raises(ValueError, match="key 'x' is in both batches"):  # same values, other dtype
        a.union(Batch.from_dict(tensors={"x": torch.arange(4).float()}))
    with pytest.raises(ValueError, match="cannot union batches of 4 and 3 rows"):
        a.union(make(3))
    with pytest.raises(ValueError, match="meta 'step' differs: 3 vs 4"):
        a.union(Batch.from_dict(meta={"step": 4}))


def test_to_device() -> None:
    b = make().to("cpu")
    assert b["x"].device.type == "cpu"
    assert b.to(torch.device("cpu"))["uid"].tolist() == list("abcd")


# ---- schema ------------------------------------------------------------------------------


def rl_batch(b: int = 2, p: int = 3, r: int = 5) -> Batch:
    return Batch.from_dict(
        tensors={
            "prompts": torch.zeros(b, p, dtype=torch.long),
            "responses": torch.zeros(b, r, dtype=torch.long),
            "response_mask": torch.ones(b, r),
            "values": torch.zeros(b, r + 1),
        },
        objects={"uid": ["q0", "q1"][:b]},
    )


def test_check_passes_on_consistent_fields() -> None:
    rl_batch().check({k: STANDARD_SHAPES[k] for k in ("prompts", "responses", "uid")})
    rl_batch().check({"response_mask": ("batch", "response")})


def test_check_names_missing_key() -> None:
    with pytest.raises(ValueError, match=re.escape("batch is missing ['advantages']")):
        rl_batch().check(
            {"responses": STANDARD_SHAPES["responses"], "advantages": ("batch", "response")}
        )


def test_check_names_mismatched_dimension() -> None:
    spec = {k: STANDARD_SHAPES[k] for k in ("responses", "response_mask", "values")}
    with pytest.raises(
        ValueError,
        match=re.escape("'values' dim 1 ('response') is 6, but 'responses' has 'response' = 5"),
    ):
        rl_batch().check(spec)
    with pytest.raises(ValueError, match=re.escape("'uid' has shape [2], expected 2 dims")):
        rl_batch().check({"uid": ("batch", "response")})


def test_standard_shapes_are_documented() -> None:
    doc = treadle.protocol.fields.__doc__ or ""
    for key, names in STANDARD_SHAPES.items():
        assert re.search(rf"^    {key} +\[B", doc, re.MULTILINE), key
        assert names[0] == "batch"


# ---- transport ---------------------------------------------------------------------------


def transport_batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(3, 4, generator=g)
    f32[0, 0] = float("nan")
    bf16 = torch.tensor([[1.5, -0.0, float("inf")], [float("nan"), 1e-40, 3.0e38]]).to(
        torch.bfloat16
    )
    return Batch.from_dict(
        tensors={
            "f32": f32[:2],
            "i64": torch.tensor([[-(2**62), 7], [1, 2**62]]),
            "flag": torch.tensor([True, False]),
            "bf16": bf16,
            "strided": torch.arange(6.0).reshape(3, 2).t(),  # non-contiguous [2, 3]
        },
        objects={"uid": ["p0", "p1"], "gt": [[1, 2], {"answer": None}]},
        meta={"temperature": 0.7, "step": 12},
    )


def assert_same_bits(got: Batch, want: Batch) -> None:
    assert got.keys() == want.keys()
    for key, w in want.tensors.items():
        g = got.tensors[key]
        assert g.dtype == w.dtype and g.shape == w.shape, key
        if w.dtype.is_floating_point:
            width = {2: torch.int16, 4: torch.int32}[w.element_size()]
            assert torch.equal(g.view(width), w.contiguous().view(width)), key
        else:
            assert torch.equal(g, w), key
    for key, w_obj in want.objects.items():
        assert got.objects[key].dtype == object
        assert got.objects[key].tolist() == w_obj.tolist()
    assert got.meta == want.meta


def assert_writable(batch: Batch) -> None:
    for t in batch.tensors.values():
        assert t.is_contiguous()
        t.copy_(t.clone())  # in place, whatever the dtype


def test_pickle_round_trip_keeps_bits() -> None:
    want = transport_batch()
    got = pickle.loads(pickle.dumps(want, protocol=5))
    assert_same_bits(got, want)
    assert got["bf16"].view(torch.int16).tolist() == want["bf16"].view(torch.int16).tolist()
    assert got["strided"].tolist() == [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
    assert_writable(got)


def test_pickle_out_of_band_buffers_arrive_writable() -> None:
    want = transport_batch()
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(want, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(want.tensors)  # every tensor travels out of band
    # As Ray delivers them: read-only memory, which must be copied before torch gets it.
    received = [bytes(b.raw()) for b in buffers]
    before = [bytearray(r) for r in received]  # copies (bytes(r) would be r itself)
    got = pickle.loads(data, buffers=received)
    assert_same_bits(got, want)
    for t in got.tensors.values():
        t.zero_()
    # The writes went to copies, not into the read-only buffers.
    assert [bytearray(r) for r in received] == before


def test_autograd_tensors_travel_detached() -> None:
    w = torch.ones(2, 3, requires_grad=True)
    got = pickle.loads(pickle.dumps(Batch.from_dict(tensors={"w": w * 2}), protocol=5))
    assert not got["w"].requires_grad
    assert got["w"].tolist() == [[2.0] * 3] * 2


def test_deepcopy_is_independent() -> None:
    b = make()
    c = copy.deepcopy(b)
    c["x"][0] = 99
    c["uid"][0] = "z"
    assert xs(b) == [0, 1, 2, 3] and b["uid"][0] == "a"


def test_pickled_size_is_the_tensor_bytes() -> None:
    b = Batch.from_dict(tensors={"x": torch.zeros(1024, 1024)}, objects={"uid": list(range(1024))})
    assert b.nbytes == 4 * 2**20
    size = len(pickle.dumps(b, protocol=5))
    assert 4 * 2**20 < size < 4 * 2**20 + 16 * 1024
    # A piece sends only its own rows, not the storage it views.
    piece = b.chunk(4)[1]
    assert 2**20 < len(pickle.dumps(piece, protocol=5)) < 2**20 + 16 * 1024
    # Out of band (as Ray pickles): the stream itself stays small.
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    assert len(data) < 16 * 1024
    assert sum(memoryview(buf).nbytes for buf in buffers) == 4 * 2**20


# ---- Ray ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_actor() -> Iterator[object]:
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        ray.init(
            num_cpus=1,
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )

    # Defined here so that Ray ships the class by value; the worker imports treadle itself.
    @ray.remote(num_cpus=0.5)
    class Worker:
        def add_double(self, batch: Batch) -> Batch:
            batch["x"].add_(100)  # arrived tensors must be writable
            batch["double"] = batch["big"][:, :1] * 2
            batch.meta["seen_by"] = "worker"
            return batch

    yield Worker.remote()
    if started:
        ray.shutdown()


def test_ray_actor_round_trip(ray_actor: object) -> None:
    import ray

    b = transport_batch()
    b["x"] = torch.tensor([1, 2])
    b["big"] = torch.arange(2 * 65536, dtype=torch.float32).reshape(2, 65536)  # 512 KB: plasma
    got = ray.get(ray_actor.add_double.remote(b))  # type: ignore[attr-defined]
    assert got["x"].tolist() == [101, 102]
    assert b["x"].tolist() == [1, 2]  # the sender's batch is untouched
    assert got["double"].tolist() == [[0.0], [131072.0]]
    assert got.meta == {"temperature": 0.7, "step": 12, "seen_by": "worker"}
    rest = b.only([k for k in b.tensors if k != "x"], list(b.objects))
    rest.meta["seen_by"] = "worker"
    assert_same_bits(got.only(list(rest.tensors), list(rest.objects)), rest)
    assert_writable(got)
    ref = ray.put(b)
    for _ in range(2):  # the worker's in-place add must not reach the shared copy in the store
        again = ray.get(ray_actor.add_double.remote(ref))  # type: ignore[attr-defined]
        assert again["x"].tolist() == [101, 102]


def test_ray_object_store_round_trip_is_writable(ray_actor: object) -> None:
    import ray

    b = transport_batch()
    ref = ray.put(b)
    got = ray.get(ref)
    assert_same_bits(got, b)
    assert_writable(got)
    # Without the copy on arrival these writes would land in Ray's shared object store
    # (measured): every later reader of `ref` would see them.
    got["i64"].zero_()
    assert_same_bits(ray.get(ref), b)
