"""Dispatch and collect: how a driver's call on a worker group is spread over its ranks and
gathered back, declared once on the worker method.

:func:`register` puts a :class:`MethodSpec` on a worker method: the :class:`Dispatch` of its
arguments (the same to every rank, or every :class:`Batch` cut into one chunk per
data-parallel rank) and the :class:`Collect` of its results (rank 0's, concatenated,
averaged, listed). So are the batch fields the method reads and returns: only the fields it
reads cross to the ranks (a rollout's text does not travel to the actor's update), a missing
one fails on the driver naming the method and the field, and a returned batch must hold what
the method declares::

    class ActorWorker(Worker):
        @register(Dispatch.DP, Collect.CONCAT, reads=("prompts", "prompt_mask"),
                  returns=("responses", "response_mask"))
        def generate(self, batch: Batch) -> Batch: ...

Choices: pure functions of the arguments and results (:func:`dispatch_args`,
:func:`collect_results`), no Ray, so that the local backend and the Ray one spread and gather
the same way, and the rules are tested without processes. The ranks of one tensor- or
sequence-parallel group read the same chunk and only the first of them answers
(``dp_ranks``, ``collects``: what the ranks said once, after start-up).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from treadle.protocol import Batch

F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(enum.Enum):
    ALL = "all"  # every rank gets the same arguments
    # Batch arguments are cut into contiguous chunks, one per data-parallel rank; the ranks of
    # one tensor- or sequence-parallel group get the same chunk
    DP = "dp"


class Collect(enum.Enum):
    RANK0 = "rank0"  # rank 0's result
    # CONCAT, MEAN and LIST take one result per data-parallel rank (the first rank of each
    # tensor- or sequence-parallel group answers for it), in rank order
    CONCAT = "concat"  # Batch results concatenated
    MEAN = "mean"  # dicts of numbers averaged (those named PEAKS: their highest)
    LIST = "list"  # the results as a list


PEAKS = "perf/max_memory_"  # metrics that hold a rank's peak: MEAN takes the highest
_ATTR = "_treadle_dispatch"


@dataclass(frozen=True)
class MethodSpec:
    """What :func:`register` declares about a worker method (see there)."""

    dispatch: Dispatch
    collect: Collect
    reads: tuple[str, ...] | None = None
    optional: tuple[str, ...] = ()
    returns: tuple[str, ...] | None = None

    def narrow(self, method: str, batch: Batch) -> Batch:
        """The fields of ``batch`` this method reads (no copy), or all of them if undeclared."""
        if self.reads is None:
            return batch
        missing = [k for k in self.reads if k not in batch]
        if missing:
            raise KeyError(
                f"{method} reads {missing}, which the batch does not have; it has {batch.keys()}"
            )
        keys = [*self.reads, *(k for k in self.optional if k in batch)]
        return batch.only(
            [k for k in keys if k in batch.tensors], [k for k in keys if k in batch.objects]
        )

    def check_returns(self, method: str, result: Any) -> None:
        """A returned batch holds every declared field, and nothing undeclared but what the
        method read (``returns`` lists what it adds; a method may hand its input back)."""
        if self.returns is None or not isinstance(result, Batch):
            return
        missing = [k for k in self.returns if k not in result]
        allowed = {*self.returns, *(self.reads or ()), *self.optional}
        extra = [k for k in result if k not in allowed]
        if missing or extra:
            raise ValueError(
                f"{method} declares returns={list(self.returns)} but returned {result.keys()}"
                + (f"; missing {missing}" if missing else "")
                + (f"; undeclared {extra}" if extra else "")
            )


def register(
    dispatch: Dispatch = Dispatch.ALL,
    collect: Collect = Collect.RANK0,
    *,
    reads: Sequence[str] | None = None,
    optional: Sequence[str] = (),
    returns: Sequence[str] | None = None,
) -> Callable[[F], F]:
    """Declare how a worker method's input is spread over ranks and its output gathered.

    ``reads``: the batch fields (tensors or objects) the method reads from every
    :class:`Batch` argument; only those (and ``optional`` ones, when the batch has them)
    are sent, with the batch's meta, and a missing one is a ``KeyError`` naming the method
    and the field. ``None`` (the default) sends whole batches. ``returns``: the fields a
    returned batch adds, checked on the driver.
    """
    spec = MethodSpec(
        dispatch,
        collect,
        tuple(reads) if reads is not None else None,
        tuple(optional),
        tuple(returns) if returns is not None else None,
    )

    def wrap(fn: F) -> F:
        setattr(fn, _ATTR, spec)
        return fn

    return wrap


def method_spec(method: Any) -> MethodSpec | None:
    """The declaration :func:`register` put on a worker method, if any."""
    return getattr(method, _ATTR, None)


def dispatch_args(
    mode: Dispatch,
    world_size: int,
    args: tuple,
    kwargs: dict,
    dp_ranks: Sequence[int] | None = None,
) -> list[tuple]:
    """Per-rank (args, kwargs). DP cuts every Batch argument into one chunk per data-parallel
    rank; ``dp_ranks[r]`` is rank r's (default: its own rank, every rank its own chunk)."""
    if mode is Dispatch.ALL:
        return [(args, kwargs)] * world_size
    dp_ranks = list(range(world_size)) if dp_ranks is None else list(dp_ranks)
    shards = max(dp_ranks) + 1

    def cut(value: Any) -> list[Any]:
        if isinstance(value, Batch):
            if len(value) % shards:
                raise ValueError(
                    f"batch of {len(value)} samples cannot be split evenly over "
                    f"{shards} data-parallel ranks; pad it first (Batch.pad_to_multiple)"
                )
            return value.chunk(shards)
        return [value] * shards

    arg_parts = [cut(a) for a in args]
    kw_parts = {k: cut(v) for k, v in kwargs.items()}
    return [
        (tuple(p[d] for p in arg_parts), {k: v[d] for k, v in kw_parts.items()}) for d in dp_ranks
    ]


def collect_results(
    mode: Collect, results: list[Any], collects: Sequence[bool] | None = None
) -> Any:
    """The call's result from every rank's ``results``; ``collects[r]``: whether rank r answers
    for its data-parallel rank (default: every rank does)."""
    if mode is Collect.RANK0:
        return results[0]
    if collects is not None:
        results = [r for r, keep in zip(results, collects, strict=True) if keep]
    if mode is Collect.CONCAT:
        return Batch.concat(results)
    if mode is Collect.MEAN:
        keys = results[0].keys()
        return {
            k: max(float(r[k]) for r in results)
            if k.startswith(PEAKS)
            else sum(float(r[k]) for r in results) / len(results)
            for k in keys
        }
    return results
