"""What a dead rank or replica looks like from the driver, in words.

A rank's process that is gone reaches the driver as one of Ray's long errors, or as its
peers' failed collectives ("connection reset by peer"). These read them: :func:`ray_get`
re-raises a worker's user-fixable error as itself, :func:`peer_lost` tells a peer's death
from a rank's own error, :func:`pid_note` and :func:`death_cause` make the one line a
message names (the pid, and out of memory, killed or the error's last line). The worker
group and the rollout's replicas both name their dead with them.
"""

from __future__ import annotations

from typing import Any

import torch

from treadle.runtime.errors import TreadleError


def ray_get(futures: list[Any]) -> list[Any]:
    """``ray.get`` that re-raises a worker's user-fixable error as itself, not wrapped."""
    import ray

    try:
        return list(ray.get(futures))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, TreadleError):
            raise e.cause from None
        raise


# What a rank's collective raises when a peer's process is gone (gloo's TCP pair, NCCL).
PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ncclRemoteError",
)


def peer_lost(error: BaseException) -> bool:
    """Whether a rank's error says one of its peers is gone (the peer's death is the cause)."""
    said = f"{error} {getattr(error, 'cause', '')}"  # a Ray task error: the rank's traceback
    return any(text in said for text in PEER_LOST)


def pid_note(error: BaseException) -> str:
    """`` (pid N)`` of the process a Ray actor error names, or nothing."""
    lines = [line.strip() for line in str(error).splitlines()]
    pid = next((line.split()[-1] for line in lines if line.startswith("pid:")), None)
    return f" (pid {pid})" if pid else ""


def death_cause(error: BaseException) -> str:
    """Why a Ray actor's process is gone, in words, from Ray's long message."""
    text = str(error)
    if "RAY_memory_usage_threshold" in text:
        return "killed by Ray's memory monitor: the node ran low on memory"
    if "unexpectedly exits" in text or "SIGKILL" in text:
        return (
            "its process ended without a Python error: killed (SIGKILL, the kernel's "
            "out-of-memory killer) or crashed"
        )
    if isinstance(error, MemoryError | torch.OutOfMemoryError):
        return f"out of memory: {str(error).splitlines()[0][:200] if text else 'MemoryError'}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__).rstrip(".")[:300]
