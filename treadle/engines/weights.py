"""Weights as safetensors buckets: the unit in which an update reaches an inference engine.

A weight update is a stream of ``(HF name, full tensor)`` pairs; :func:`weight_buckets` cuts it
into buckets of about ``rollout.weight_sync_bucket_mb``, each safetensors bytes, so names,
shapes and dtypes travel with the data and nothing is unpickled on arrival. The split path
broadcasts them to the replicas (:mod:`treadle.serving.weight_sync`), and vLLM's engine loads
them so. The colocated path hands the engine its named tensors where they are, on the device
(:meth:`treadle.workers.sender.SendsWeights.sync_weights`): the hf engine copies them
into its weights in place, with no trip through the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import save as save_safetensors_bytes


class CastTensors:
    """``(name, tensor)`` of ``named_tensors``, floats cast to ``dtype`` where each tensor is
    (on its device), the names in ``skip`` left out; one tensor at a time. ``bytes``: what it
    has yielded so far (a colocated engine's weight update, counted)."""

    def __init__(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        dtype: torch.dtype | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> None:
        self.named, self.dtype, self.skip = named_tensors, dtype, skip
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.named:
            if name in self.skip:
                continue
            t = tensor.detach()
            if self.dtype is not None and t.is_floating_point():
                t = t.to(self.dtype)
            self.bytes += t.numel() * t.element_size()
            yield name, t


def weight_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    skip: frozenset[str] = frozenset(),
) -> Iterator[bytes]:
    """safetensors bytes of consecutive groups of ~``bucket_bytes``; floats cast to ``dtype``
    (where they are: fewer bytes to the host).

    Never more than one bucket is held at once; names in ``skip`` are left out.
    """
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in CastTensors(named_tensors, dtype, skip):
        t = tensor.cpu().contiguous()
        if any(t.data_ptr() == other.data_ptr() for other in bucket.values()):
            t = t.clone()  # safetensors refuses tensors that share memory
        bucket[name] = t
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield save_safetensors_bytes(bucket)
            bucket, size = {}, 0
    if bucket:
        yield save_safetensors_bytes(bucket)
