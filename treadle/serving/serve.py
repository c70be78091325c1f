"""``treadle serve``: a model behind the OpenAI-compatible endpoint, outside training.

One process, no Ray: the engine ``rollout.engine`` names (hf or vllm) loads ``model.path``
into a :class:`~treadle.serving.server.RolloutServer`, a :class:`~treadle.serving.client.
LocalReplica` puts it behind a rollout client, and the endpoint
(:mod:`treadle.serving.endpoint`) serves it on the client's loop, run by this (the main)
thread, as a local engine must be. Requests sample as they ask (temperature, top_p,
max_tokens, seed, n), so an agent can be tried against the model before it trains on it;
``rollout.max_new_tokens`` is the budget of a request that names none, and a prompt plus its
completion fit in ``data.max_prompt_length + rollout.max_new_tokens`` tokens (the vLLM
engine's ``max_model_len``): raise them to serve longer conversations.
It serves until Ctrl-C or SIGTERM, which the command line turns into an exception that
unwinds through here: the server closes and the command exits with 130 or 143.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from treadle.config import Config
from treadle.models.loading import load_tokenizer
from treadle.runtime.errors import signalled
from treadle.serving.client import LocalReplica, RolloutClient
from treadle.serving.endpoint import Endpoint
from treadle.serving.replica import make_engine
from treadle.serving.server import RolloutServer
from treadle.tracking.tracker import quiet_start


def serve(cfg: Config, on_ready: Callable[[Endpoint], None]) -> None:
    """Serve ``cfg.model.path`` until interrupted; ``on_ready(endpoint)`` once it listens."""
    m, r = cfg.model, cfg.rollout
    with quiet_start():  # the engine's C-level messages and progress bars: to the log file
        tokenizer = load_tokenizer(
            m.tokenizer_path or m.path,
            allow_download=m.allow_download,
            template_kwargs=cfg.data.chat_template_kwargs,
        )
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        server = RolloutServer(make_engine(cfg, m.path, device), "local replica")
    client = RolloutClient(
        [LocalReplica(server)],
        max_inflight=r.max_inflight_per_replica,
        timeout_s=r.request_timeout_s,
    )
    # A stop signal can end a request's task mid-answer: its handler would hold the command for
    # the grace twice (before it is cut and after: 10 s with training's 5); a second is enough
    # for the others.
    endpoint = Endpoint.from_config(cfg, client, tokenizer, force_sampling=False, stop_grace_s=1.0)
    try:
        client.run(_serve(endpoint, on_ready))
    finally:
        try:
            client.run(endpoint.stop())
        except KeyboardInterrupt:  # the stop signal's, kept by a request's task (it is noted)
            if not signalled():
                raise
        finally:
            client.close()


def _quiet_interrupts(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: a stop signal that landed in a request's task is not
    reported as an error of that task (the command says it stopped)."""
    if not isinstance(context.get("exception"), KeyboardInterrupt):
        loop.default_exception_handler(context)


async def _serve(endpoint: Endpoint, on_ready: Callable[[Endpoint], None]) -> None:
    asyncio.get_running_loop().set_exception_handler(_quiet_interrupts)
    await endpoint.start()
    on_ready(endpoint)
    await asyncio.Event().wait()  # until a stop signal's exception unwinds the loop
