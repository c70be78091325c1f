"""The weight-sync group of a split rollout, and how one sync over it ends.

The actor's rank 0 and every split replica form a process group of their own
(:func:`join_weight_sync`, rank 0 the actor's); a sync broadcasts the actor's weights over
it while each replica receives them (``receive_weights``). Choices: a replica that dies
during a sync breaks the group under every member, and gloo tells a member nothing of
another's death, so :func:`settle` waits for the replicas' receives (for a few seconds only
once the actor's side failed) and names as :class:`SyncBroken` every replica that did not
answer that it loaded the whole update; the restarts (:mod:`.restarts`) replace them and make
the group again.
"""

from __future__ import annotations

from typing import Any

from treadle.controller import WorkerGroup, death_cause, pid_note, ray_get
from treadle.serving.client import RolloutError


class SyncBroken(RolloutError):
    """A weight sync during which a replica died; ``broken``: the replicas (indices) that did
    not answer that they loaded the whole update (the others of the broken group may wait
    in it for good: a gloo group does not tell a member that another one died)."""

    def __init__(self, message: str, broken: list[int] | None = None) -> None:
        super().__init__(message)  # (one argument: the driver re-raises it with the step)
        self.broken = broken or []


def settle(names: list[str], receiving: list[Any], wait_s: float | None = None) -> None:
    """Wait (at most ``wait_s``) for the replicas' ``receive_weights`` calls; raise
    :class:`SyncBroken` if one of them died, else the first error one of them raised."""
    if not receiving:  # colocated: the sync was an in-memory copy in each rank
        return
    import ray

    done, _ = ray.wait(receiving, num_returns=len(receiving), timeout=wait_s)
    broken, death, error = [], "", None
    for index, (name, ref) in enumerate(zip(names, receiving, strict=True)):
        if ref not in done:
            broken.append(index)
            continue
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            broken.append(index)
            death = death or f"{name}{pid_note(e)} died during a weight sync ({death_cause(e)})"
        except Exception as e:
            broken.append(index)
            error = error or e
    if death:
        raise SyncBroken(death, broken)
    if error is not None:
        raise error


def join_weight_sync(group: WorkerGroup, replicas: list[Any]) -> None:
    """The actor's rank 0 and every replica form the weight-sync process group."""
    addr, port = group.weight_sync_address()
    world = len(replicas) + 1
    joining = [a.join_weight_sync.remote(addr, port, i + 1, world) for i, a in enumerate(replicas)]
    group.init_weight_sync(addr, port, world)
    ray_get(joining)
