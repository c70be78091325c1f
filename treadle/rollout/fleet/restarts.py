"""Restarting the split replicas that die or stop answering, and those a weight sync broke.

A split replica that dies or stops answering (``rollout.request_timeout_s``) is restarted, at
most ``rollout.max_restarts`` times in a run (:class:`Restarter`, called by the client, which
sends the requests it held again to the replicas that are up, see
:mod:`treadle.serving.client`): one warning line naming it and the cause, the old actor
killed, a new one started on its bundle, then the weight-sync group made again from scratch on
a new port (a dead member breaks a gloo/NCCL group for good: every replica and the actor's
rank 0 join the new one) and the current weights and version broadcast over it, before any
request reaches it. The actor is idle while the synchronous driver generates, so that happens
at once; while the asynchronous producer generates (the client's loop in a thread of its own,
the actor training), the new replica waits, down, for the driver's next ``sync_weights``,
which makes the group again first. A teacher (or judge) replica has no weights to sync: it
starts again from ``teacher.model_path`` (``reward.judge.model_path``) and is up at once. Each
restart counts in ``rollout/replica_restarts``. An agent loop never sees the failure: its call
is answered by another replica. A colocated replica (an actor rank) is not restarted.

A replica that dies *during* a weight sync breaks the group under every member: the actor's
rank 0 fails (and walks the rest of the update, so that its other ranks finish their gathers),
while the live replicas may wait in their receive for good (gloo tells a member nothing of
another's death; measured, FINDINGS). So every replica that has not loaded the whole update a
few seconds after the failure is restarted with the dead one (:meth:`Restarter.replace_broken`,
each a restart), the group is made again and the update sent once more; a second death in
the same sync stops the run. That is gloo's case: on NCCL the actor's rank 0 waits for the
group's timeout instead, and torch then ends its process (:mod:`treadle.serving.weight_sync`).

The restarter reads and calls the rollout through :class:`Fleet`, what it needs of
:class:`~treadle.rollout.fleet.fanout.Rollout`, so that this module sits below the rollout's
(which holds a restarter) and neither imports the other.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Protocol

from treadle.config import Config
from treadle.controller import ResourcePool, WorkerGroup, death_cause, pid_note
from treadle.rollout.fleet.split_pool import start_replica
from treadle.rollout.fleet.sync_group import SyncBroken, join_weight_sync
from treadle.serving.client import RayReplica, RolloutClient, RolloutError
from treadle.serving.replica import Role

log = logging.getLogger("treadle")


class Fleet(Protocol):
    """What a :class:`Restarter` reads and calls of the rollout whose replicas it restarts
    (:class:`~treadle.rollout.fleet.fanout.Rollout`)."""

    group: WorkerGroup
    client: RolloutClient
    replicas: list[Any]
    names: list[str]
    pool: ResourcePool | None
    version: int
    restarter: Restarter | None

    def count(self, key: str, value: float = 1.0) -> None: ...

    def broadcast(self, version: int, interrupt: bool = False) -> dict[str, float]: ...


class Restarter:
    """Restarts the split replicas of ``rollout`` for its client (see the module docstring);
    ``path``: the weights a new replica starts from (the actor's start, or the teacher's)."""

    def __init__(self, rollout: Fleet, cfg: Config, path: str, role: Role) -> None:
        self.rollout, self.cfg, self.path, self.role = rollout, cfg, path, role
        self.lock = threading.Lock()  # one restart or weight sync at a time
        self.pending: set[int] = set()  # restarted, not in the weight-sync group yet

    @classmethod
    def attach(cls, rollout: Fleet, cfg: Config, path: str, role: Role = "rollout") -> None:
        """Let ``rollout``'s client restart its replicas (when ``rollout.max_restarts`` > 0)."""
        if cfg.rollout.max_restarts > 0 and rollout.replicas:
            rollout.restarter = cls(rollout, cfg, path, role)
            rollout.client.restarts.restart = rollout.restarter.restart

    async def restart(self, index: int, error: Exception) -> None:
        """Replica ``index`` failed with ``error``: start it again (on the client's loop)."""
        client, budget = self.rollout.client, self.rollout.client.restarts
        log.warning(
            "%s; restarting it (restart %d of rollout.max_restarts=%d)",
            error,
            budget.max_restarts - budget.left,
            budget.max_restarts,
        )
        failed = self.rollout.replicas[index]
        loop = asyncio.get_running_loop()
        up = await loop.run_in_executor(None, self._restart, index, failed)
        if up is None:  # a weight sync restarted it meanwhile (and counted it)
            return
        name = self.rollout.names[index]
        client.replace(index, RayReplica(self.rollout.replicas[index], name), up)
        self.rollout.count("rollout/replica_restarts")

    def _restart(self, index: int, failed: Any) -> bool | None:
        """Kill and start replica ``index`` (the actor ``failed``) again; whether it is up
        (has the weights), None if a weight sync restarted it already."""
        import ray

        r = self.rollout
        assert r.pool is not None
        with self.lock:
            if r.replicas[index] is not failed:
                return None
            ray.kill(r.replicas[index])  # (a replica that stopped answering may be alive)
            actor = start_replica(self.cfg, r.pool, index, self.path, r.version, self.role)
            _get(actor.treadle_check.remote(), r.names[index], "its restart")
            r.replicas[index] = actor
            if self.role != "rollout":  # a teacher or judge: frozen, nothing to sync
                return True
            self.pending.add(index)
            if r.client.background:  # the actor may be training: at the next sync
                return False
            self.rejoin_pending()
            r.broadcast(r.version, interrupt=True)  # the others keep their requests
            return True

    def replace_broken(self, broken: list[int], error: SyncBroken) -> set[int]:
        """Kill and start again the replicas ``broken`` by a weight sync (``error``), under
        ``lock``; they wait, down, for the group to be made again (``pending``). Each is a
        restart, counted and charged to ``rollout.max_restarts``, unless the client's own
        restart of it is under way (that one then finds it done, :meth:`_restart`)."""
        import ray

        r = self.rollout
        assert r.pool is not None
        log.warning("%s; restarting %s", error, ", ".join(r.names[i] for i in broken))
        r.client.run(self._take_down(broken, error))
        for index in broken:
            ray.kill(r.replicas[index])
        started = [
            start_replica(self.cfg, r.pool, i, self.path, r.version, self.role) for i in broken
        ]
        for index, actor in zip(broken, started, strict=True):
            _get(actor.treadle_check.remote(), r.names[index], "its restart")
            r.replicas[index] = actor
            r.count("rollout/replica_restarts")
        r.client.run(self._rehandle(broken))
        self.pending.update(broken)
        return set(broken)

    async def _take_down(self, broken: list[int], error: SyncBroken) -> None:
        """On the client's loop: charge the restarts of ``broken``, route nothing to them,
        and give each a new handle (a call that fails on the old one is then not a restart,
        see :meth:`~treadle.serving.client.Restarts.failed`)."""
        budget = self.rollout.client.restarts
        charged = [i for i in broken if i not in budget.tasks]
        if len(charged) > budget.left:
            raise RolloutError(
                f"{error}; rollout.max_restarts={budget.max_restarts} restarts used already"
            )
        budget.left -= len(charged)
        await self._rehandle(broken)

    async def _rehandle(self, indices: list[int]) -> None:
        """On the client's loop: new handles of the actors at ``indices``, down."""
        r = self.rollout
        for index in indices:
            r.client.down.add(index)
            r.client.replace(index, RayReplica(r.replicas[index], r.names[index]), up=False)

    def revive(self) -> None:
        """Restart the replicas that died since their last call (before a weight sync, whose
        group a dead member would break)."""
        import ray

        r = self.rollout
        pings = [a.busy_seconds.remote() for a in r.replicas]
        for index, ref in enumerate(pings):
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                dead = f"{r.names[index]}{pid_note(e)} died between rollouts ({death_cause(e)})"
                r.client.run(r.client.restarts.now(index, RolloutError(dead)))

    def rejoin_pending(self) -> set[int]:
        """Make the weight-sync group again if a replica was restarted since it was made;
        the replicas restarted (under ``lock``)."""
        pending, self.pending = self.pending, set()
        if pending:
            join_weight_sync(self.rollout.group, self.rollout.replicas)
        return pending


def _get(ref: Any, name: str, what: str) -> Any:
    """``ray.get(ref)``; a dead replica is a RolloutError naming it (``name``, pid, cause)."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as e:
        dead = f"{name}{pid_note(e)} died during {what}"
        raise RolloutError(f"{dead} ({death_cause(e)})") from None
