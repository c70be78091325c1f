"""``rollout.endpoint``: the OpenAI-compatible HTTP endpoint over the rollout client.

Agents written against the OpenAI API (``openai.AsyncOpenAI``) reach the run's model through it
during training, and ``treadle serve`` serves a model with it (:mod:`treadle.rollout.endpoint`).
"""

from __future__ import annotations

from pydantic import Field

from treadle.config.base import Key, Section


class EndpointConfig(Section):
    """Where the endpoint listens and the token a client must send."""

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
