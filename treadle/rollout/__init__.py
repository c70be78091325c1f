"""Rollout as a service, and all of the driver's rollout.

- :mod:`.server`: a server that owns an inference engine and answers requests token-in,
  token-out; :mod:`.client`: the router over replicas (least outstanding, sessions).
- :mod:`.replica`: the replica actor (split placement) and the colocated serving mixin.
- :mod:`.weight_sync`: the process group that carries the actor's weights to split replicas.
- :mod:`.fleet`: the trainer side: replicas placed as the config says, agent loops to a batch,
  weight sync under a version.
- :mod:`.endpoint`: an OpenAI-compatible HTTP server over the client, recording every call by
  session (:mod:`.openai_api`: the API's shapes; :mod:`.completions`: chat template and text;
  :mod:`.parsers`: vLLM's tool and reasoning parsers); :mod:`.serving`: ``treadle serve``.
- :mod:`.sources`: what the driver takes its batches from (:class:`~.sources.RolloutSource`),
  synchronous or generated ahead (one_step_off, async), and DAPO's group filter.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.rollout.client import LocalReplica, RayReplica, RolloutClient, RolloutError
    from treadle.rollout.server import Request, Response, RolloutServer

# imported on first use: the client imports the controller and torch, which a check of the
# endpoint's parser names (treadle.rollout.parsers) does not need
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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
