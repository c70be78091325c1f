"""The driver's rollout: replicas placed as the config says, a client over them, weight sync.

:class:`Rollout` is all the driver knows of generation. ``generate`` runs the agent loop
(``rollout.agent_loop``, :mod:`treadle.agents`) ``rollout.n`` times on each prompt (once when
greedy) over the :class:`~treadle.serving.client.RolloutClient` and builds the response side of
the batch from the trajectories; ``sync_weights`` pushes the actor's new weights to every
replica under a version number. ``rollout.placement=colocated``: the replicas are the actor's
own ranks, a sync an in-memory copy on each; ``split``: replicas in a placement group of their
own, the actor's rank 0 broadcasting the weights to them over a process group of their own.

The version of the weights a replica holds is the step whose update produced them: the start
weights are version ``start`` (0, or the resumed step), and the sync after step ``t`` makes
them ``t``; every response carries its version into the batch (``weight_version``).

The modules, each importing only those above it:

- :mod:`.split_pool`: the split rollout's pool and its replica actors (reserved, spawned,
  waited for, killed);
- :mod:`.sync_group`: the weight-sync group of the actor's rank 0 and the split replicas, and
  how one sync over it ends (:class:`SyncBroken`);
- :mod:`.batch`: the run's agent loops (:class:`Agents`) and the batch their trajectories make;
- :mod:`.restarts`: restarting split replicas that die, stop answering or are broken by a sync
  (:class:`Restarter`);
- :mod:`.fanout`: :class:`Rollout`, the agent loops fanned out over the client into a batch,
  and the weight sync the driver calls;
- :mod:`.start`: :func:`start_rollout`, the rollout as ``rollout.placement`` says.

The names are handed on here, where they were when this was one module.
"""

from treadle.rollout.fleet.batch import Agents
from treadle.rollout.fleet.fanout import Rollout
from treadle.rollout.fleet.restarts import Restarter
from treadle.rollout.fleet.split_pool import (
    Spawned,
    kill_replicas,
    reserve_rollout_pool,
    rollout_cpus,
    spawn_replicas,
    spawn_rollout,
    start_replicas,
)
from treadle.rollout.fleet.start import start_rollout
from treadle.rollout.fleet.sync_group import SyncBroken

__all__ = [
    "Agents",
    "Restarter",
    "Rollout",
    "Spawned",
    "SyncBroken",
    "kill_replicas",
    "reserve_rollout_pool",
    "rollout_cpus",
    "spawn_replicas",
    "spawn_rollout",
    "start_replicas",
    "start_rollout",
]
