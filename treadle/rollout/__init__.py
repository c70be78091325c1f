"""Rollout as a service: servers that own an inference engine and answer requests token-in,
token-out (:mod:`.server`), a client that routes requests over replicas (:mod:`.client`), and
the weight-sync path from the actor to every replica (:mod:`.weight_sync`)."""

from treadle.rollout.client import LocalReplica, RayReplica, RolloutClient, RolloutError
from treadle.rollout.server import Request, Response, RolloutServer

__all__ = [
    "LocalReplica",
    "RayReplica",
    "Request",
    "Response",
    "RolloutClient",
    "RolloutError",
    "RolloutServer",
]
