"""A reward service: the samples of a batch POSTed to an HTTP endpoint (``reward.url``), their
rewards read from its answer.

The shape is OpenRLHF's ``--remote_rm_url`` (a batch per request, ``{"rewards": [...]}`` back)
with slime's ``--rm-url`` fields per sample (prompt, response, label)::

    POST reward.url
    {"samples": [{"prompt": "...", "response": "...", "ground_truth": "...", "row": {...}}, ...]}

    200 {"rewards": [1.0, 0.0, ...]}

One reward per sample, in order: a number, or a dict of named numbers (its components, summed,
as a reward function's dict). ``row`` is the whole data row (every column, JSON; values JSON
cannot hold are sent as their text). A service is a few lines of any web framework
(docs/data-and-rewards.md shows one with aiohttp).

- **Batches and concurrency.** The samples go in requests of ``reward.url_batch_size``, at most
  ``reward.url_concurrency`` of them in flight at once, over one connection pool kept for the
  run.
- **Time limit and retries.** Each request may take ``reward.url_timeout_s`` seconds. A request
  that times out, cannot connect, or is answered 429 or 5xx is tried again after
  ``reward.url_backoff_s`` seconds, doubling each time (with a little jitter), up to
  ``reward.url_retries`` more times. A service that stays down stops the run with one
  :class:`~treadle.runtime.errors.RewardError` line naming ``reward.url``, what happened and how
  many tries over how long. Any other answer (4xx, not JSON, the wrong number of rewards) is not
  retried: it is that one line at once.
- **Authorization.** ``reward.url_auth_env`` names an environment variable; its value is sent as
  ``Authorization: Bearer <value>``. The secret never sits in the YAML (nor in the resolved
  config the run writes, nor in an error message).
- **Threads.** The requests run on an event loop in a thread of this object's own, so scoring
  works from any thread, the asynchronous producer's (inside the rollout client's loop) too.

:meth:`RewardService.probe` is what ``treadle check`` sends: one request with an empty batch,
``{"samples": []}``, answered ``{"rewards": []}`` by a service written as above. It reaches the
service once (address, path, token, answer's shape) without inventing a sample.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treadle.rewards.results import RowSample
from treadle.runtime.errors import ConfigError, RewardError

RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class ServiceOptions:
    """How to reach a reward service (``reward.url`` and its ``url_*`` keys)."""

    url: str
    batch_size: int = 32
    concurrency: int = 4
    timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 1.0
    auth_env: str | None = None
    weight: float = 1.0


class _Retry(Exception):
    """A try that may succeed if made again: what happened, in words."""


class RewardService:
    """Scores batches with the reward service ``options.url`` (see the module docstring).
    Close it (or use ``with``) to stop its thread."""

    def __init__(self, options: ServiceOptions) -> None:
        self.options = options
        self.headers = {"Content-Type": "application/json"}
        if options.auth_env is not None:
            token = os.environ.get(options.auth_env)
            if not token:
                raise ConfigError(
                    f"reward.url_auth_env={options.auth_env}: the environment variable "
                    f"{options.auth_env} is not set (or empty): export the reward service's "
                    "token in it before the run starts"
                )
            self.headers["Authorization"] = f"Bearer {token}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: Any = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the caller's side

    def __call__(self, samples: Sequence[RowSample]) -> list[Any]:
        """What the service returned for each sample (prompt, response, ground truth and data
        row, as :func:`~treadle.rewards.results.with_rows` pairs them), in order (checked by the
        caller); a RewardError when it cannot be had."""
        sent = [
            {"prompt": p, "response": r, "ground_truth": g, "row": dict(row)}
            for p, r, g, row in samples
        ]
        if not sent:
            return []
        size = self.options.batch_size
        batches = [sent[k : k + size] for k in range(0, len(sent), size)]
        answers = self._run(self._score_all(batches))
        return [value for answer in answers for value in answer]

    def probe(self) -> None:
        """One request with an empty batch, tried once; a RewardError saying what went wrong."""
        self._run(self._post([], tries=1))

    def close(self) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        if self._session is not None:
            asyncio.run_coroutine_threadsafe(self._session.close(), loop).result(timeout=10)
            self._session = None
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Any) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="treadle reward service", daemon=True
                )
                self._thread.start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    # ------------------------------------------------------------------ the loop's side

    async def _score_all(self, batches: list[list[dict[str, Any]]]) -> list[list[Any]]:
        """Every batch's rewards, at most ``concurrency`` requests in flight; the first
        failure cancels the rest."""
        gate = asyncio.Semaphore(self.options.concurrency)

        async def one(batch: list[dict[str, Any]]) -> list[Any]:
            async with gate:
                return await self._post(batch, tries=self.options.retries + 1)

        tasks = [asyncio.ensure_future(one(batch)) for batch in batches]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _post(self, batch: list[dict[str, Any]], tries: int) -> list[Any]:
        """``batch``'s rewards, ``tries`` tries at most with backoff between them."""
        body = json.dumps({"samples": batch}, default=_as_json, ensure_ascii=False).encode()
        began, wait = time.monotonic(), self.options.backoff_s
        for attempt in range(1, tries + 1):
            try:
                return await self._try(body, len(batch))
            except _Retry as e:
                if attempt == tries:
                    spent = time.monotonic() - began
                    tried = "1 try" if tries == 1 else f"{tries} tries over {spent:.1f} s"
                    raise RewardError(
                        f"reward.url={self.options.url}: {e} ({tried}; is the reward service "
                        "running and reward.url right?)"
                    ) from None
            await asyncio.sleep(wait * random.uniform(1.0, 1.25))
            wait *= 2
        raise AssertionError("unreachable")

    async def _try(self, body: bytes, count: int) -> list[Any]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=self.options.timeout_s)
        try:
            async with self._session.post(
                self.options.url, data=body, headers=self.headers, timeout=timeout
            ) as response:
                status, text = response.status, await response.text(errors="replace")
        except TimeoutError:
            raise _Retry(
                f"no answer within reward.url_timeout_s={self.options.timeout_s:g} s"
            ) from None
        except aiohttp.ClientError as e:
            raise _Retry(f"cannot reach it ({type(e).__name__}: {_first_line(e)})") from None
        if status in RETRIED_STATUS:
            raise _Retry(f"it answered HTTP {status}: {_first_line(text)}")
        if status != 200:
            hint = "; check reward.url_auth_env's token" if status in (401, 403) else ""
            raise RewardError(
                f"reward.url={self.options.url}: it answered HTTP {status}: {_first_line(text)} "
                f"(not retried{hint})"
            )
        return self._rewards(text, count)

    def _rewards(self, text: str, count: int) -> list[Any]:
        """The ``rewards`` list of an answer, or the RewardError that says what is wrong."""
        try:
            answer = json.loads(text)
        except json.JSONDecodeError:
            answer = None
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list) or len(rewards) != count:
            got = f"{len(rewards)} rewards" if isinstance(rewards, list) else _first_line(text, 80)
            raise RewardError(
                f"reward.url={self.options.url}: it answered {got!s} for {count} samples; a "
                'reward service answers {"rewards": [one number (or dict of numbers) per '
                "sample, in order]}"
            )
        return rewards


def _as_json(value: Any) -> Any:
    """What ``json`` cannot write itself: arrays as lists, anything else as its text."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)


def _first_line(value: Any, limit: int = 200) -> str:
    lines = str(value).strip().splitlines()
    line = lines[0] if lines else "(empty)"
    return line if len(line) <= limit else line[: limit - 3] + "..."
