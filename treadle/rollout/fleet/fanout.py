"""The driver's rollout: agent loops fanned out over the client into a batch, weight sync.

:class:`Rollout` is all the driver knows of generation. ``generate`` runs the agent loop
(``rollout.agent_loop``, :mod:`treadle.agents`) ``rollout.n`` times on each prompt (once when
greedy, the samples then copies) over the :class:`~treadle.serving.client.RolloutClient` and
builds the response side of the batch from the trajectories (:mod:`.batch`; single_turn: one
request per sample, all sent at once); ``sync_weights`` pushes the actor's new weights to
every replica under a version number. Choices:

- A prompt's rows stay consecutive and a failed run has none; ``sample_index`` says which
  sample of which prompt a row is (the segments of one split session share it).
- Failed runs and broken sessions are counted (``agent/errors``, ``agent/prefix_breaks``)
  and taken by the driver with :meth:`Rollout.take_counters`, under a lock: the async modes
  generate in the client's thread.
- With restarts on, a sync first makes the weight-sync group again for the replicas restarted
  since the last one, and a replica's death during it restarts the broken ones and sends the
  update once more (:mod:`.restarts`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from treadle.agents.loops import AgentRuns, Sample, run_agents, single_turn
from treadle.agents.trajectory import Trajectory
from treadle.controller import ResourcePool, WorkerGroup
from treadle.data.images import PIXELS
from treadle.engines.inference import SamplingParams
from treadle.protocol import Batch
from treadle.rollout.fleet.batch import Agents, left_trim, trajectory_batch
from treadle.rollout.fleet.restarts import Restarter
from treadle.rollout.fleet.sync_group import SyncBroken, settle
from treadle.serving.client import RolloutClient, held

if TYPE_CHECKING:
    from treadle.serving.endpoint import Endpoint


class Rollout:
    """Generation and weight sync for the driver; see the module docstring."""

    def __init__(
        self,
        group: WorkerGroup,
        client: RolloutClient,
        decode: Callable[[list[list[int]]], list[str]],
        pad_id: int,
        agents: Agents,
        replicas: list[Any] | None = None,
        pool: ResourcePool | None = None,
        endpoint: Endpoint | None = None,
    ) -> None:
        """``replicas``, ``pool``: the split pool's Ray actors and placement group;
        ``endpoint``: the OpenAI-compatible endpoint over ``client`` (black-box agents)."""
        self.group, self.client = group, client
        self.decode, self.pad_id, self.agents = decode, pad_id, agents
        self.replicas, self.pool = replicas or [], pool
        self.names = [h.name for h in client.replicas] if self.replicas else []
        self.endpoint = endpoint
        self.counters: dict[str, float] = {}
        self._counting = threading.Lock()
        self.version = 0  # of the weights the replicas hold (set by start_rollout, each sync)
        self.restarter: Restarter | None = None  # split replicas, rollout.max_restarts > 0

    # ------------------------------------------------------------------ generate

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """``params.n`` samples per prompt (consecutive rows), each a trajectory of the agent
        loop, with the response-side fields: responses, response_mask (the loss mask),
        rollout_log_probs, response_text, stop_reason, weight_version (the oldest of the
        sample's tokens), token_versions (per token; -1 where the model did not sample),
        sample_index (``i x params.n + j`` for the j-th sample of prompt i: the segments of
        one split session share it, a failed run has no row); for
        agent loops other than single_turn also response_attention_mask, turns and
        agent_<info key>."""
        return self.client.run(self.agenerate(prompts, params))

    async def agenerate(self, prompts: Batch, params: SamplingParams, count: bool = True) -> Batch:
        """:meth:`generate` as a coroutine on the client's loop; ``count``: its failed runs
        and broken sessions count in :meth:`take_counters` (not an evaluation's)."""
        copies = params.n if params.temperature == 0 else 1  # greedy samples are all equal
        a = self.agents
        pictures = prompts[PIXELS] if PIXELS in prompts else [None] * len(prompts)
        samples = [
            Sample(uid, list(ids), text, truth, row, pixel_values)
            for uid, ids, text, truth, row, pixel_values in zip(
                prompts["uid"],
                left_trim(prompts["prompts"], prompts["prompt_mask"]),
                prompts["prompt_text"],
                prompts["ground_truth"],
                prompts.objects.get("row", [{}] * len(prompts)),
                pictures,
                strict=True,
            )
        ]
        if self.endpoint is not None:
            await self.endpoint.start()  # (again: a no-op)
        runs = await run_agents(
            a.loop,
            self.client,
            samples,
            params.n // copies,
            params,
            tokenizer=a.tokenizer,
            tools=a.tools,
            limits=a.limits(params),
            max_concurrent=a.max_concurrent,
            failures=a.failures,
            endpoint=self.endpoint,
            parse_calls=a.parse_calls,
        )
        if count:
            self._count(runs)
        runs.trajectories = [ts for ts in runs.trajectories for _ in range(copies)]
        rows = runs.rows()  # a prompt's rows stay consecutive; a failed run has none
        batch = prompts.select([i // params.n for i, _ in rows])
        batch = self.trajectory_batch(batch, [t for _, t in rows], a.width(params))
        batch["sample_index"] = torch.tensor([i for i, _ in rows])  # prompt x n + its sample
        return batch

    def _count(self, runs: AgentRuns) -> None:
        with self._counting:  # (the async modes generate in the client's thread)
            for key, value in runs.counters().items():
                self.counters[key] = self.counters.get(key, 0.0) + value

    def count(self, key: str, value: float = 1.0) -> None:
        with self._counting:
            self.counters[key] = self.counters.get(key, 0.0) + value

    def take_counters(self) -> dict[str, float]:
        """``agent/errors``, ``agent/prefix_breaks`` and, when replicas may be restarted,
        ``rollout/replica_restarts`` since the last call (0 when none)."""
        with self._counting:
            counted, self.counters = self.counters, {}
        zeros = {}
        if self.agents.loop is not single_turn:  # single_turn never fails nor splits
            zeros = {"agent/errors": 0.0, "agent/prefix_breaks": 0.0}
        if self.restarter is not None:
            zeros["rollout/replica_restarts"] = 0.0
        return {**zeros, **counted}

    def trajectory_batch(self, batch: Batch, trajectories: list[Trajectory], width: int) -> Batch:
        """The response side of ``batch`` (one row per trajectory) padded to ``width``."""
        return trajectory_batch(batch, trajectories, width, self.agents, self.pad_id, self.decode)

    # ------------------------------------------------------------------ weights

    def sync_weights(self, version: int, interrupt: bool = False) -> dict[str, float]:
        """Push the actor's weights to every replica as ``version``; the bytes sent (the time
        is the driver's ``timing/sync_weights``). ``interrupt``: split replicas pause the
        requests in flight instead of refusing them (partial rollouts). Replicas restarted
        since the last sync join a new weight-sync group first (:mod:`.restarts`). Else the
        requests in flight (an outside process's, rollout.endpoint.enabled) finish first."""
        with contextlib.nullcontext() if interrupt else held(self.client):
            return self._sync_weights(version, interrupt)

    def _sync_weights(self, version: int, interrupt: bool) -> dict[str, float]:
        if self.restarter is None:
            return self.broadcast(version, interrupt)
        self.restarter.revive()
        with self.restarter.lock:
            pending = self.restarter.rejoin_pending()
            try:
                out = self.broadcast(version, interrupt)
            except SyncBroken as e:  # once: a second death in the same sync stops the run
                pending |= self.restarter.replace_broken(e.broken, e)
                self.restarter.rejoin_pending()
                out = self.broadcast(version, interrupt)
            self.client.mark_up(pending)
            return out

    def broadcast(self, version: int, interrupt: bool = False) -> dict[str, float]:
        """:meth:`sync_weights` over the weight-sync group as it is; a replica's death
        during it is a :class:`SyncBroken`."""
        receiving = [r.receive_weights.remote(version, interrupt) for r in self.replicas]
        try:
            sent = self.group.sync_weights(version)
        except Exception:  # a replica that died mid-broadcast breaks the sender's group
            settle(self.names, receiving, wait_s=5.0)  # (those that loaded it all are done)
            raise  # no replica died: the actor's own error
        settle(self.names, receiving)
        self.version = version
        return {"rollout/weight_sync_bytes": float(sent)}

    def start_profile(self, folder: str) -> None:
        """Profile every split replica's process until :meth:`stop_profile`
        (``trainer.profile_steps``; colocated replicas are the actor's ranks, profiled as
        such)."""
        import ray

        ray.get([r.start_profile.remote(folder) for r in self.replicas])

    def stop_profile(self) -> list[str]:
        """Stop the split replicas' profiles; the files they wrote."""
        import ray

        return [
            p for paths in ray.get([r.stop_profile.remote() for r in self.replicas]) for p in paths
        ]

    def busy_seconds(self) -> list[float | None]:
        """Per split replica, the seconds its engine has had requests in flight (None: the
        replica died, its restart is the rollout's to make)."""
        import ray

        out: list[float | None] = []
        for future in [r.busy_seconds.remote() for r in self.replicas]:
            try:
                out.append(float(ray.get(future)))
            except ray.exceptions.RayActorError:
                out.append(None)
        return out

    def close(self) -> None:
        if self.endpoint is not None:
            self.client.run(self.endpoint.stop())
        self.client.close()
        self.agents.tools.close()
        if self.replicas:
            import ray

            for r in self.replicas:
                ray.kill(r)
        if self.pool is not None:
            self.pool.remove()
