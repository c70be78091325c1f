"""``rollout.endpoint``: the OpenAI-compatible HTTP endpoint over the rollout client.

Agents written against the OpenAI API (``openai.AsyncOpenAI``) reach the run's model through it
during training, and ``treadle serve`` serves a model with it (:mod:`treadle.serving.endpoint`).
"""

from __future__ import annotations

import errno
import socket

from pydantic import Field

from treadle.config.base import Key, Section


class EndpointConfig(Section):
    """Where the endpoint listens and the token a client must send."""

    enabled: bool = Field(
        False,
        description="Serve the endpoint for the whole run, in every trainer.mode, whatever "
        "the agent loop: an outside process can call the model (the replicas' weights, "
        "synced after each update) between steps too. Its URL (and a random token) are "
        "logged at start; weight syncs wait for its requests in flight.",
    )
    host: Key = Field(
        "127.0.0.1",
        description="Address the endpoint listens on (the loopback by default: agents run on "
        "this machine; another address exposes the model to the network, token-protected).",
    )
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0: a free port, chosen per run.")
    api_key: str | None = Field(
        None,
        min_length=1,
        description="Bearer token every request must carry (`Authorization: Bearer ...`); "
        "null: a random token per run, printed by `treadle serve` and handed to agents.",
    )
    model_name: str | None = Field(
        None,
        min_length=1,
        description="The model's name in /v1/models and in responses; null: the last part of "
        "model.path. Requests may name any model: they all reach the one served.",
    )


def listen_problem(host: str, port: int) -> str | None:
    """Why the endpoint could not listen on ``host:port`` (a port taken, an address not this
    machine's), found by binding it as the endpoint will (``SO_REUSEADDR``, as aiohttp), or
    None; port 0 (a free one) always can."""
    if not port:
        return None
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"rollout.endpoint.host={host}: it does not resolve ({e}): give an address"
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(address)
        except OSError as e:
            return listen_error(host, port, e)
    return None


def listen_error(host: str, port: int, error: OSError) -> str:
    """The one line for an endpoint that could not listen on ``host:port``."""
    if error.errno == errno.EADDRINUSE:
        return (
            f"rollout.endpoint.port={port}: {host}:{port} is in use by another process: "
            "choose another port, or 0 for a free one"
        )
    if error.errno == errno.EADDRNOTAVAIL:
        return (
            f"rollout.endpoint.host={host}: not an address of this machine: give one of its "
            "addresses (127.0.0.1: this machine only; 0.0.0.0: every interface)"
        )
    if error.errno == errno.EACCES:
        return (
            f"rollout.endpoint.port={port}: this user may not listen on it (ports below 1024 "
            "need privileges): choose a port from 1024 up, or 0 for a free one"
        )
    return f"rollout.endpoint: cannot listen on {host}:{port} ({error.strerror or error})"
