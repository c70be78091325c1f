"""`Batch`: the record that crosses every seam of an RL step.

The driver hands a `Batch` to a worker group, the group splits it by data-parallel rank, each
rank adds fields, and the pieces are concatenated back. A `Batch` holds three things:

- ``tensors``: named torch tensors that all share dim 0, the batch dimension;
- ``objects``: per-sample Python objects (prompt text, ground truth, the prompt id ``uid``)
  as 1-D numpy arrays of dtype object, so they select, split and concatenate like tensors;
- ``meta``: batch-level values (temperature, step, ...), never split, copied to every piece.

The standard fields of one RL step, and the shape names ``check`` reads, are in
:mod:`treadle.protocol.fields`.

Choices:

- Every operation returns a new `Batch`; only ``update``, ``batch[key] = value`` and ``pop``
  change a batch in place. ``slice``, ``split`` and ``chunk`` return views of the tensors
  (like ``torch.split``); ``select``, ``repeat``, ``pad_to_multiple`` and ``concat`` copy.
  ``meta`` is copied shallowly into every new batch.
- The sizes are validated on construction and on every mutation, with the key and both sizes
  in the error, because a wrong batch size found three phases later is hard to trace.
- Transport: Ray pickles a batch (protocol 5) when it crosses processes. Each tensor is sent as
  a contiguous numpy array, which pickle 5 hands over as an out-of-band buffer (no copy into
  the pickle stream; Ray maps it from its object store). Torch's own tensor pickling is far
  slower, and a view would drag its whole storage along. Dtypes numpy lacks (bfloat16,
  float8, complex32) travel as their raw bits viewed as an integer type of the same width,
  with the dtype recorded, so they come back bit-identical. Arrays delivered by Ray are
  read-only (measured: even small, inlined ones), so a read-only array is copied on arrival;
  a writable one (plain ``pickle.loads``) is used in place. Tensors always arrive on the CPU
  without autograd history; ``deepcopy`` goes through the same path.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["Batch", "response_attention"]


# Integer types of the same width, used to carry the bits of dtypes numpy does not have.
_BITS_BY_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Indices = Sequence[int] | Sequence[bool] | torch.Tensor | np.ndarray
Tensors = Mapping[str, torch.Tensor] | None
Objects = Mapping[str, Sequence[Any] | np.ndarray] | None  # lists become 1-D object arrays
Meta = Mapping[str, Any] | None


@dataclass(eq=False)
class Batch:
    """Named tensors sharing dim 0, per-sample objects of the same length, and batch meta."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tensors = dict(self.tensors)
        self.objects = {k: _object_array(k, v) for k, v in self.objects.items()}
        self.meta = dict(self.meta)
        _validate(self.tensors, self.objects)

    @classmethod
    def from_dict(
        cls, tensors: Tensors = None, objects: Objects = None, meta: Meta = None
    ) -> Batch:
        """Build a batch; objects may be lists (each becomes a 1-D object array)."""
        objs = {k: _object_array(k, v) for k, v in (objects or {}).items()}
        return cls(dict(tensors or {}), objs, dict(meta or {}))

    # ---- access -------------------------------------------------------------------------

    def __len__(self) -> int:
        for t in self.tensors.values():
            return int(t.shape[0])
        for a in self.objects.values():
            return len(a)
        return 0

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.objects:
            return self.objects[key]
        raise KeyError(f"batch has no key {key!r}; it has {self.keys()}")

    def __setitem__(self, key: str, value: torch.Tensor | Sequence[Any] | np.ndarray) -> None:
        """A tensor is stored in ``tensors``; anything else becomes a per-sample object array."""
        if isinstance(value, torch.Tensor):
            self.update(tensors={key: value})
        else:
            self.update(objects={key: value})

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.objects

    def __iter__(self) -> Iterator[str]:
        """Keys, as for a dict."""
        return iter(self.keys())

    def keys(self) -> list[str]:
        """Tensor keys, then object keys."""
        return [*self.tensors, *self.objects]

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors (objects are not counted)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{k}: {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            for k, t in self.tensors.items()
        )
        return (
            f"Batch(len={len(self)}, tensors={{{tensors}}}, objects={list(self.objects)}, "
            f"meta={self.meta!r})"
        )

    # ---- in-place changes -----------------------------------------------------------------

    def update(self, tensors: Tensors = None, objects: Objects = None, meta: Meta = None) -> None:
        """Add or replace fields in place; nothing changes if any new field has the wrong size."""
        new_t = dict(tensors or {})
        new_o = {k: _object_array(k, v) for k, v in (objects or {}).items()}
        both = new_t.keys() & new_o.keys()
        if both:
            raise ValueError(f"keys given both as tensors and as objects: {sorted(both)}")
        replaced = new_t.keys() | new_o.keys()
        # The fields that stay come first, so a size error names the new field.
        kept_t = {k: v for k, v in self.tensors.items() if k not in replaced}
        kept_o = {k: v for k, v in self.objects.items() if k not in replaced}
        checked = Batch({**kept_t, **new_t}, {**kept_o, **new_o}, {**self.meta, **(meta or {})})
        self.tensors, self.objects, self.meta = checked.tensors, checked.objects, checked.meta

    def pop(self, keys: str | Iterable[str]) -> Batch:
        """Remove ``keys`` from this batch (in place, like ``dict.pop``); return them as a batch."""
        names = [keys] if isinstance(keys, str) else list(keys)
        self._require(names)
        tensors = {k: self.tensors.pop(k) for k in names if k in self.tensors}
        objects = {k: self.objects.pop(k) for k in names if k in self.objects}
        return Batch(tensors, objects, dict(self.meta))

    # ---- new batches from this one ---------------------------------------------------------

    def only(self, tensor_keys: Iterable[str] = (), object_keys: Iterable[str] = ()) -> Batch:
        """A batch with just these fields (no copy of the data), e.g. what a phase needs."""
        t_keys, o_keys = list(tensor_keys), list(object_keys)
        missing = [k for k in t_keys if k not in self.tensors]
        missing += [k for k in o_keys if k not in self.objects]
        if missing:
            raise KeyError(
                f"batch has no {missing}; tensors {list(self.tensors)}, "
                f"objects {list(self.objects)}"
            )
        return Batch(
            {k: self.tensors[k] for k in t_keys},
            {k: self.objects[k] for k in o_keys},
            dict(self.meta),
        )

    def select(self, indices: Indices) -> Batch:
        """Rows by integer indices (any order, repeats allowed) or by a boolean mask; copies."""
        idx = _as_index(indices, len(self))
        tensors = {
            k: t.index_select(0, torch.from_numpy(idx).to(t.device))
            for k, t in self.tensors.items()
        }
        objects = {k: a[idx] for k, a in self.objects.items()}
        return Batch(tensors, objects, dict(self.meta))

    def slice(self, start: int, stop: int | None = None) -> Batch:
        """Rows ``start:stop`` as views (no copy)."""
        tensors = {k: t[start:stop] for k, t in self.tensors.items()}
        objects = {k: a[start:stop] for k, a in self.objects.items()}
        return Batch(tensors, objects, dict(self.meta))

    def split(self, size: int | Sequence[int]) -> list[Batch]:
        """Contiguous pieces of at most ``size`` rows, or of exactly the given sizes (views)."""
        n = len(self)
        if isinstance(size, int):
            if size < 1:
                raise ValueError(f"split size must be at least 1, got {size}")
            sizes = [min(size, n - start) for start in range(0, n, size)]
        else:
            sizes = list(size)
            if sum(sizes) != n or any(s < 0 for s in sizes):
                raise ValueError(f"split sizes {sizes} do not add up to the batch size {n}")
        bounds = np.cumsum([0, *sizes]).tolist()
        return [self.slice(a, b) for a, b in itertools.pairwise(bounds)]

    def chunk(self, n: int) -> list[Batch]:
        """``n`` contiguous pieces whose sizes differ by at most one, larger ones first (views)."""
        if n < 1 or n > len(self):
            raise ValueError(f"cannot chunk a batch of {len(self)} rows into {n} pieces")
        q, r = divmod(len(self), n)
        return self.split([q + 1] * r + [q] * (n - r))

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times: a,a,b,b with ``interleave``, else a,b,a,b."""
        if n < 1:
            raise ValueError(f"repeat count must be at least 1, got {n}")
        rows = np.arange(len(self))
        return self.select(np.repeat(rows, n) if interleave else np.tile(rows, n))

    def pad_to_multiple(self, k: int) -> tuple[Batch, int]:
        """Append copies of the first rows until the size divides by ``k``; return the count.

        Used to split a batch evenly over ``k`` ranks; `unpad` drops the padding afterwards.
        """
        if k < 1:
            raise ValueError(f"pad multiple must be at least 1, got {k}")
        n = len(self)
        pad = -n % k
        if pad == 0:
            return self.slice(0), 0
        return self.select(np.concatenate([np.arange(n), np.arange(pad) % n])), pad

    def unpad(self, count: int) -> Batch:
        """Drop the last ``count`` rows (the padding added by `pad_to_multiple`)."""
        if not 0 <= count <= len(self):
            raise ValueError(f"cannot unpad {count} rows from a batch of {len(self)}")
        return self.slice(0, len(self) - count)

    def union(self, other: Batch) -> Batch:
        """Fields of both batches; a key in both must hold the same content (and kind)."""
        if len(self) != len(other) and self.keys() and other.keys():
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        for key in other:
            if key in self and not _same_field(self[key], other[key]):
                raise ValueError(f"key {key!r} is in both batches with different contents")
        for key, value in other.meta.items():
            if key in self.meta and not _same_value(self.meta[key], value):
                raise ValueError(f"meta {key!r} differs: {self.meta[key]!r} vs {value!r}")
        return Batch(
            {**self.tensors, **other.tensors},
            {**self.objects, **other.objects},
            {**self.meta, **other.meta},
        )

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order; keys must match; meta is taken from the first."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        _check_concatenable(batches)
        first = batches[0]
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        objects = {k: np.concatenate([b.objects[k] for b in batches]) for k in first.objects}
        return Batch(tensors, objects, dict(first.meta))

    def to(self, device: torch.device | str) -> Batch:
        """Tensors moved to ``device``; objects and meta shared."""
        tensors = {k: t.to(device) for k, t in self.tensors.items()}
        return Batch(tensors, dict(self.objects), dict(self.meta))

    # ---- schema ----------------------------------------------------------------------------

    def check(self, required: Mapping[str, tuple[str, ...]]) -> None:
        """Check that each key exists with the named dimensions, consistent across keys.

        ``required`` maps a key to names of its dimensions, e.g.
        ``{"responses": ("batch", "response"), "uid": ("batch",)}``. Dimensions with the same
        name must have the same size in every key that names them.
        """
        self._require(list(required), ValueError)
        _check_dims({key: tuple(self[key].shape) for key in required}, required)

    def _require(self, keys: Iterable[str], error: type[Exception] = KeyError) -> None:
        missing = [k for k in keys if k not in self]
        if missing:
            raise error(f"batch is missing {missing}; it has {self.keys()}")

    # ---- transport -------------------------------------------------------------------------

    def __reduce__(self) -> tuple[Any, ...]:
        packed = {k: _pack_tensor(t) for k, t in self.tensors.items()}
        return (_unpack_batch, (packed, self.objects, self.meta))


# ---- helpers ---------------------------------------------------------------------------------


def _object_array(key: str, values: Sequence[Any] | np.ndarray) -> np.ndarray:
    """A 1-D object array of ``values``; nested lists stay one object per row."""
    if isinstance(values, np.ndarray) and values.dtype == object:
        if values.ndim != 1:
            raise ValueError(f"object field {key!r} must be 1-D, got shape {values.shape}")
        return values
    if isinstance(values, torch.Tensor):
        raise TypeError(f"object field {key!r} got a tensor; store tensors in `tensors`")
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element-wise so that equal-length lists do not become 2-D
        out[i] = v
    return out


def _validate(tensors: Mapping[str, torch.Tensor], objects: Mapping[str, np.ndarray]) -> None:
    both = tensors.keys() & objects.keys()
    if both:
        raise ValueError(f"keys are both tensors and objects: {sorted(both)}")
    ref: tuple[str, int] | None = None
    rows = [(f"tensor {k!r}", t.shape[0] if t.ndim else None) for k, t in tensors.items()]
    rows += [(f"object {k!r}", len(a)) for k, a in objects.items()]
    for name, n in rows:
        if n is None:
            raise ValueError(f"{name} is 0-d; tensors need a batch dimension")
        if ref is None:
            ref = (name, n)
        elif n != ref[1]:
            raise ValueError(f"{name} has batch size {n}, but {ref[0]} has {ref[1]}")


def _as_index(indices: Indices, n: int) -> np.ndarray:
    """Integer row indices (int64, 1-D) from ints or a boolean mask, bounds-checked."""
    if isinstance(indices, torch.Tensor):
        arr = indices.detach().cpu().numpy()
    else:
        arr = np.asarray(indices)
    if arr.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {arr.shape}")
    if arr.dtype == bool:
        if len(arr) != n:
            raise ValueError(f"boolean mask has {len(arr)} entries for a batch of {n}")
        return np.flatnonzero(arr)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"indices must be integers or booleans, got dtype {arr.dtype}")
    bad = arr[(arr < -n) | (arr >= n)]
    if bad.size:
        raise IndexError(f"index {bad[0]} is out of range for a batch of {n}")
    return arr.astype(np.int64) % max(n, 1)


def _same_field(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b.to(a.device)))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    return False


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # arrays and tensors have no single truth
        return False


def _check_dims(
    shapes: Mapping[str, tuple[int, ...]], names: Mapping[str, tuple[str, ...]]
) -> None:
    """Each key's shape has its named dimensions, of one size per name across keys."""
    seen: dict[str, tuple[int, str]] = {}
    for key, shape in shapes.items():
        if len(shape) != len(names[key]):
            raise ValueError(
                f"{key!r} has shape {list(shape)}, expected {len(names[key])} dims {names[key]}"
            )
        for dim, (name, size) in enumerate(zip(names[key], shape, strict=True)):
            first_size, first_key = seen.setdefault(name, (size, key))
            if size != first_size:
                raise ValueError(
                    f"{key!r} dim {dim} ({name!r}) is {size}, "
                    f"but {first_key!r} has {name!r} = {first_size}"
                )


def _check_concatenable(batches: Sequence[Batch]) -> None:
    """The same keys in every batch, and each tensor's dims after 0 alike."""
    first = batches[0]
    for i, b in enumerate(batches[1:], start=1):
        _check_same_keys(first, b, i)
    for key, t in first.tensors.items():
        for i, b in enumerate(batches[1:], start=1):
            if b.tensors[key].shape[1:] != t.shape[1:]:
                raise ValueError(
                    f"cannot concat tensor {key!r}: batch 0 has shape {list(t.shape)}, "
                    f"batch {i} has {list(b.tensors[key].shape)} (dims after 0 differ)"
                )


def _check_same_keys(first: Batch, other: Batch, i: int) -> None:
    for kind, a, b in (
        ("tensor", first.tensors, other.tensors),
        ("object", first.objects, other.objects),
    ):
        if a.keys() != b.keys():
            raise ValueError(
                f"cannot concat: batch {i} has different {kind} keys than batch 0: "
                f"missing {sorted(a.keys() - b.keys())}, extra {sorted(b.keys() - a.keys())}"
            )


def _pack_tensor(t: torch.Tensor) -> tuple[np.ndarray, torch.dtype | None]:
    """A contiguous CPU numpy array of ``t``'s bits, and the dtype to view it as on arrival."""
    t = t.detach().cpu().contiguous()
    try:
        return t.numpy(), None
    except TypeError:  # numpy has no such dtype (bfloat16, float8, complex32): send the bits
        return t.view(_BITS_BY_WIDTH[t.element_size()]).numpy(), t.dtype


def _unpack_tensor(arr: np.ndarray, dtype: torch.dtype | None) -> torch.Tensor:
    if not arr.flags.writeable:  # Ray hands out read-only views of its object store
        arr = arr.copy()
    t = torch.from_numpy(arr)
    return t if dtype is None else t.view(dtype)


def _unpack_batch(
    packed: Mapping[str, tuple[np.ndarray, torch.dtype | None]],
    objects: dict[str, np.ndarray],
    meta: dict[str, Any],
) -> Batch:
    tensors = {k: _unpack_tensor(arr, dtype) for k, (arr, dtype) in packed.items()}
    return Batch(tensors, objects, meta)


def response_attention(batch: Batch) -> torch.Tensor:
    """Which response tokens are attended to: ``response_attention_mask`` when the batch has
    one (trajectories with tool tokens), else ``response_mask``."""
    return batch.tensors.get("response_attention_mask", batch["response_mask"])
