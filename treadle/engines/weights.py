"""Weights as safetensors buckets: the unit in which an update reaches an inference engine.

A weight update is a stream of ``(HF name, full tensor)`` pairs; :func:`weight_buckets` cuts it
into buckets of about ``rollout.weight_sync_bucket_mb``, each safetensors bytes, so names,
shapes and dtypes travel with the data and nothing is unpickled on arrival. The split path
broadcasts them to the replicas (:mod:`treadle.serving.weight_sync`), and vLLM's engine loads
them so. The colocated path hands the engine its named tensors where they are, on the device
(:meth:`treadle.workers.actor.ActorRolloutRefWorker.sync_weights`): the hf engine copies them
into its weights in place, with no trip through the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import save as save_safetensors_bytes


def weight_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    skip: frozenset[str] = frozenset(),
) -> Iterator[bytes]:
    """safetensors bytes of consecutive groups of ~``bucket_bytes``; floats cast to ``dtype``.

    Never more than one bucket is held at once; names in ``skip`` are left out.
    """
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in named_tensors:
        if name in skip:
            continue
        t = tensor.detach()
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        t = t.to(dtype=cast).cpu().contiguous()  # cast where it is: fewer bytes to the host
        if any(t.data_ptr() == other.data_ptr() for other in bucket.values()):
            t = t.clone()  # safetensors refuses tensors that share memory
        bucket[name] = t
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield save_safetensors_bytes(bucket)
            bucket, size = {}, 0
    if bucket:
        yield save_safetensors_bytes(bucket)
