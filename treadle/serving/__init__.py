"""Rollout as a service: token-in, token-out servers over an inference engine, and the ways in.

- :mod:`.server`: a server that owns an inference engine and answers requests token-in,
  token-out; :mod:`.client`: the router over replicas (least outstanding, sessions).
- :mod:`.replica`: the replica actor (split placement) and the colocated serving mixin.
- :mod:`.weight_sync`: the process group that carries the actor's weights to split replicas.
- :mod:`.endpoint`: an OpenAI-compatible HTTP server over the client, recording every call by
  session (:mod:`.openai_api`: the API's shapes; :mod:`.completions`: chat template and text;
  :mod:`.parsers`: vLLM's tool and reasoning parsers); :mod:`.serve`: ``treadle serve``.

The agent loops (:mod:`treadle.agents`) call the client; the driver's rollout
(:mod:`treadle.rollout`) places the replicas and runs the loops over them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treadle.runtime.lazy import lazy

if TYPE_CHECKING:
    from treadle.serving.client import LocalReplica, RayReplica, RolloutClient, RolloutError
    from treadle.serving.server import Request, Response, RolloutServer

# imported on first use: the client imports the controller and torch, which a check of the
# endpoint's parser names (treadle.serving.parsers) does not need
_LAZY = {
    **dict.fromkeys(["LocalReplica", "RayReplica", "RolloutClient", "RolloutError"], "client"),
    **dict.fromkeys(["Request", "Response", "RolloutServer"], "server"),
}

__all__ = [
    "LocalReplica",
    "RayReplica",
    "Request",
    "Response",
    "RolloutClient",
    "RolloutError",
    "RolloutServer",
]

__getattr__ = lazy(__name__, _LAZY)
