"""Rollout as a service, request by request: the server, the client and its router.

Routing, bounds and timeouts are checked against replicas that record what they are sent (a
test double); serving, versions and determinism against real servers over the transformers
and vLLM engines on the tiny model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
import torch

from treadle.engines.inference import Finished, HFRolloutEngine, SamplingParams
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.serving import LocalReplica, Request, Response, RolloutClient, RolloutError
from treadle.serving.server import RolloutServer

SAMPLE = SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=5)
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)


class RecordingReplica:
    """Answers after ``delay`` seconds with empty responses; records what it was sent."""

    def __init__(self, name: str, delay: float = 0.0) -> None:
        self.name, self.delay = name, delay
        self.calls: list[list[Request]] = []
        self.inflight = self.peak = 0

    async def generate(self, requests: list[Request]) -> list[Response]:
        self.calls.append(list(requests))
        self.inflight += len(requests)
        self.peak = max(self.peak, self.inflight)
        await asyncio.sleep(self.delay)
        self.inflight -= len(requests)
        return [Response(r.request_id, [1], [-0.5], "stop", 0, self.name) for r in requests]


def _req(client: RolloutClient, session: str | None = None, prompt=(1, 2, 3)) -> Request:
    return Request(client.new_id(), tuple(prompt), SAMPLE, session_id=session)


def test_batch_spreads_evenly_and_keeps_request_order():
    replicas = [RecordingReplica("a"), RecordingReplica("b"), RecordingReplica("c")]
    client = RolloutClient(replicas)
    try:
        requests = [_req(client) for _ in range(7)]
        out = client.generate(requests)
        assert [r.request_id for r in out] == [r.request_id for r in requests]
        # one call per replica; least-outstanding with ties to the lowest index: 3, 2, 2
        assert [len(rep.calls) for rep in replicas] == [1, 1, 1]
        assert [len(rep.calls[0]) for rep in replicas] == [3, 2, 2]
        assert [r.replica for r in out] == ["a", "b", "c", "a", "b", "c", "a"]
        assert client.outstanding == [0, 0, 0]
    finally:
        client.close()


def test_sessions_stay_on_their_replica_and_new_work_goes_to_the_least_loaded():
    replicas = [RecordingReplica("a", delay=0.3), RecordingReplica("b", delay=0.3)]
    client = RolloutClient(replicas)

    async def scenario() -> list[Response]:
        first = asyncio.ensure_future(client.submit(_req(client, session="s1")))  # -> a
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(client.submit(_req(client)))  # a busy -> b
        await asyncio.sleep(0.05)
        # a and b have one each: the session's next turn still goes to a (now two there), a
        # new session to the least loaded b, then a plain request to a (a tie: lowest index)
        third = asyncio.ensure_future(client.submit(_req(client, session="s1")))
        fourth = asyncio.ensure_future(client.submit(_req(client, session="s2")))
        fifth = asyncio.ensure_future(client.submit(_req(client)))
        return list(await asyncio.gather(first, second, third, fourth, fifth))

    try:
        out = client.run(scenario())
        assert [r.replica for r in out] == ["a", "b", "a", "b", "a"]
        assert client.sessions == {"s1": 0, "s2": 1}
        client.end_session("s1")
        assert client.sessions == {"s2": 1}
    finally:
        client.close()


def test_the_session_map_keeps_the_most_recently_used(monkeypatch):
    """A server's callers never end their sessions: the router remembers a bounded number,
    forgetting the least recently used (whose next call is routed afresh)."""
    import treadle.serving.client as client_module

    monkeypatch.setattr(client_module, "MAX_SESSIONS", 3)
    client = RolloutClient([RecordingReplica("a"), RecordingReplica("b")])
    try:
        for session in ("s1", "s2", "s3", "s1", "s4"):
            client.route(_req(client, session=session))
        assert list(client.sessions) == ["s3", "s1", "s4"]  # s2, least recently used, is gone
    finally:
        client.close()


def test_requests_in_flight_per_replica_are_bounded():
    replica = RecordingReplica("a", delay=0.05)
    client = RolloutClient([replica], max_inflight=4)

    async def many() -> list[Response]:
        singles = [client.submit(_req(client)) for _ in range(10)]
        batch = client.submit_many([_req(client) for _ in range(9)])
        done = await asyncio.gather(batch, *singles)
        return [*done[0], *done[1:]]

    try:
        assert len(client.run(many())) == 19
        assert replica.peak == 4
        assert max(len(c) for c in replica.calls) == 4  # a batch travels in calls of <= 4
    finally:
        client.close()


def test_a_replica_that_does_not_answer_stops_with_its_name():
    client = RolloutClient([RecordingReplica("rollout replica 7", delay=5.0)], timeout_s=0.2)
    try:
        with pytest.raises(RolloutError, match=r"^rollout replica 7 did not answer 2 request"):
            client.generate([_req(client), _req(client)])
    finally:
        client.close()


# ---------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def hf_server(tiny_task):
    path = str(tiny_task["model"])
    tok = load_tokenizer(path)
    engine = HFRolloutEngine(
        load_causal_lm(path, torch.float32), [tok.eos_token_id], tok.pad_token_id
    )
    server = RolloutServer(engine, "rollout replica 0")
    return server, tok


def _prompts(tok, n: int) -> list[tuple[int, ...]]:
    return [tuple(tok(f"{i}+{i + 1}=")["input_ids"]) for i in range(n)]


def test_many_concurrent_callers_are_all_answered(hf_server):
    """Six callers at once (as agent loops would be), each a batch of eight; what arrives while
    the engine works joins it between steps."""
    server, tok = hf_server
    client = RolloutClient([LocalReplica(server)])
    prompts = _prompts(tok, 8)

    async def caller(k: int) -> list[Response]:
        await asyncio.sleep(0.01 * k)
        return await client.submit_many(
            [Request(f"t{k}-{i}", p, SAMPLE) for i, p in enumerate(prompts)]
        )

    async def everyone() -> list[list[Response]]:
        return list(await asyncio.gather(*(caller(k) for k in range(6))))

    try:
        results = client.run(everyone())
        for k, responses in enumerate(results):
            assert [r.request_id for r in responses] == [f"t{k}-{i}" for i in range(8)]
            for r in responses:
                assert 1 <= len(r.token_ids) <= 6 and len(r.log_probs) == len(r.token_ids)
                assert r.stop_reason in ("stop", "length")
                assert all(lp <= 0 for lp in r.log_probs)
        assert server.in_flight == 0
    finally:
        client.close()


def _serve(server: RolloutServer, requests: list[Request]) -> list[Response]:
    return asyncio.run(server.generate(requests))


def test_a_batch_into_an_idle_server_is_reproducible_and_leaves_the_host_rng(hf_server):
    server, tok = hf_server
    prompts = _prompts(tok, 6)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = _serve(server, [Request(f"a{i}", p, SAMPLE) for i, p in enumerate(prompts)])
    assert torch.equal(torch.random.get_rng_state(), before)  # the host's stream did not move
    b = _serve(server, [Request(f"b{i}", p, SAMPLE) for i, p in enumerate(prompts)])
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.log_probs for r in a] == [r.log_probs for r in b]


class SeedPerRequestEngine:
    """A test double sampling as treadle's vLLM engine does on CUDA: each request's seed drawn
    from the global torch RNG when it is added, its one token a function of that seed."""

    def __init__(self) -> None:
        self.running: dict[str, int] = {}

    def add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, pixel_values=None
    ) -> None:
        self.running[request_id] = int(torch.randint(0, 1 << 30, ()))

    def step(self) -> list[Finished]:
        done = [Finished(rid, [t], [-1.0], "length") for rid, t in self.running.items()]
        self.running.clear()
        return done


def test_a_batch_of_requests_seeded_one_by_one_is_reproducible_and_replicas_draw_apart():
    server = RolloutServer(SeedPerRequestEngine(), "rollout replica 0")
    torch.manual_seed(123)
    host = torch.random.get_rng_state()
    a = _serve(server, [Request(f"a{i}", (1, 2), SAMPLE) for i in range(4)])
    assert torch.equal(torch.random.get_rng_state(), host)  # the host's stream did not move
    assert len({r.token_ids[0] for r in a}) == 4
    torch.manual_seed(456)
    b = _serve(server, [Request(f"b{i}", (1, 2), SAMPLE) for i in range(4)])
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    other = RolloutServer(SeedPerRequestEngine(), "rollout replica 1", index=1)
    c = _serve(other, [Request(f"c{i}", (1, 2), SAMPLE) for i in range(4)])
    assert [r.token_ids for r in c] != [r.token_ids for r in a]  # replicas draw apart


def test_versions_rise_with_weight_updates(hf_server, tiny_task):
    server, tok = hf_server
    prompt = _prompts(tok, 1)[0]
    start = server.version
    assert _serve(server, [Request("v0", prompt, GREEDY)])[0].weight_version == start
    weights = load_causal_lm(str(tiny_task["model"]), torch.float32).state_dict()
    for version in (start + 1, start + 2):
        server.update_weights(weights.items(), version)
        (response,) = _serve(server, [Request(f"v{version}", prompt, GREEDY)])
        assert response.weight_version == version


class ThreeStepEngine:
    """A test double: every request finishes on the third step after it was added."""

    def __init__(self) -> None:
        self.running: dict[str, int] = {}
        self.loaded: list[int] = []

    def add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, pixel_values=None
    ) -> None:
        self.running[request_id] = 0

    def step(self) -> list[Finished]:
        for rid in self.running:
            self.running[rid] += 1
        done = [rid for rid, n in self.running.items() if n == 3]
        for rid in done:
            del self.running[rid]
        return [Finished(rid, [7], [-0.1], "stop") for rid in done]

    def update_weights(self, named_tensors) -> None:
        self.loaded.append(len(list(named_tensors)))


def test_no_weight_update_while_requests_are_in_flight():
    engine = ThreeStepEngine()
    server = RolloutServer(engine, "rollout replica 3", version=4)
    refused: list[str] = []

    async def update_midway() -> None:
        await asyncio.sleep(0)  # the pump has taken the batch and stepped once
        try:
            server.update_weights([("w", torch.zeros(1))], 5)
        except RuntimeError as e:
            refused.append(str(e))

    async def both() -> list[Response]:
        batch = server.generate([Request(f"w{i}", (1, 2), SAMPLE) for i in range(4)])
        responses, _ = await asyncio.gather(batch, update_midway())
        return responses

    responses = asyncio.run(both())
    assert refused == [
        "rollout replica 3: a weight update with 4 requests in flight; weights change between "
        "requests (or pass interrupt=True)"
    ]
    assert engine.loaded == [] and {r.weight_version for r in responses} == {4}
    server.update_weights([("w", torch.zeros(1))], 5)  # idle now
    assert engine.loaded == [1] and server.version == 5


class TokenEngine:
    """A test double: one token a step per request (``10 * version + position``, log-prob
    ``-position``) until ``max_new_tokens``; records every request it is given."""

    def __init__(self) -> None:
        self.version = 0
        self.running: dict[str, tuple[list[int], int]] = {}  # id -> (tokens, budget)
        self.added: list[tuple[str, list[int], int]] = []

    def add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, pixel_values=None
    ) -> None:
        self.running[request_id] = ([], params.max_new_tokens)
        self.added.append((request_id, list(prompt), params.max_new_tokens))

    def step(self) -> list[Finished]:
        done = []
        for rid, (tokens, budget) in list(self.running.items()):
            tokens.append(10 * self.version + len(tokens))
            if len(tokens) == budget:
                del self.running[rid]
                done.append(Finished(rid, tokens, [-float(i) for i in range(budget)], "length"))
        return done

    def abort(self, request_id: str) -> tuple[list[int], list[float]]:
        tokens, _ = self.running.pop(request_id)
        return tokens, [-float(i) for i in range(len(tokens))]

    def update_weights(self, named_tensors) -> None:
        self.version = int(next(iter(named_tensors))[1])


def test_a_partial_rollout_pauses_loads_and_goes_on_with_per_token_versions():
    """Two steps at version 4, a weight update with interrupt=True, three more at version 5:
    the request goes on from its prompt plus its two tokens with a budget of three."""
    engine = TokenEngine()
    engine.version = 4
    server = RolloutServer(engine, "rollout replica 0", version=4)
    params = dataclasses.replace(SAMPLE, max_new_tokens=5)

    async def update_after_two_steps() -> None:
        for _ in range(2):
            await asyncio.sleep(0)  # the pump steps once per turn of the loop
        server.update_weights([("w", torch.tensor(5))], 5, interrupt=True)

    async def both() -> list[Response]:
        batch = server.generate([Request("a", (1, 2), params), Request("b", (3,), params)])
        responses, _ = await asyncio.gather(batch, update_after_two_steps())
        return responses

    a, b = asyncio.run(both())
    assert a.token_ids == [40, 41, 50, 51, 52] and b.token_ids == [40, 41, 50, 51, 52]
    assert a.token_versions == (4, 4, 5, 5, 5) and a.versions() == [4, 4, 5, 5, 5]
    assert a.weight_version == 4 and a.stop_reason == "length"
    assert a.log_probs == [0.0, -1.0, 0.0, -1.0, -2.0]  # each piece as its engine gave it
    assert engine.added[2:] == [("a", [1, 2, 40, 41], 3), ("b", [3, 40, 41], 3)]
    assert server.in_flight == 0 and server.version == 5
    (c,) = asyncio.run(server.generate([Request("c", (1,), params)]))  # not paused
    assert c.token_versions == () and c.versions() == [5] * 5 and c.weight_version == 5


def test_duplicate_request_ids_in_flight_are_refused(hf_server):
    server, tok = hf_server
    (p,) = _prompts(tok, 1)
    with pytest.raises(ValueError, match="request id 'dup' is already in flight"):
        _serve(server, [Request("dup", p, SAMPLE), Request("dup", p, SAMPLE)])
    assert server.in_flight == 0


def test_a_stop_an_engine_turned_into_its_own_error_still_unwinds_the_server():
    """vLLM's tokenizer pool turns a Ctrl-C that lands in it into an UnboundLocalError: the
    requests in flight fail, and with the signal noted the pump raises the stop, which unwinds
    the loop (`treadle serve` served on until the grace ran out)."""
    import signal

    from treadle.runtime import errors

    class Interrupted(ThreeStepEngine):
        def step(self) -> list[Finished]:
            errors.note_signal(signal.SIGINT)  # what the handler does where the signal lands
            raise UnboundLocalError("cannot access local variable 'tok'")

    server = RolloutServer(Interrupted(), "rollout replica 0")

    async def ask() -> None:
        with contextlib.suppress(RuntimeError):  # "engine failed: ...", if it is answered first
            await server.generate([Request("r0", (1, 2), SAMPLE)])
        await asyncio.wait_for(asyncio.Event().wait(), 60)  # as `treadle serve` waits: the stop

    try:
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(ask())
    finally:
        errors.clear_signals()


def test_a_stop_signal_in_a_task_as_the_client_closes_still_closes_it(monkeypatch):
    """A Ctrl-C that lands in a request's task before the first ``cancel_all`` has run leaves
    that one pending: the retry must not be cancelled by it (the serve test caught
    "CancelledError" from ``close``, exit 1 instead of 130)."""
    from treadle.serving import client as client_module

    monkeypatch.setattr(client_module, "signalled", lambda: True)
    client = RolloutClient([RecordingReplica("a")])
    loop = client._loop
    stepped: list[str] = []

    async def interrupted() -> None:  # ready before close's first task: it steps first
        stepped.append("interrupted")
        raise KeyboardInterrupt

    async def in_flight() -> None:
        await asyncio.Event().wait()

    waiting = loop.create_task(in_flight())
    loop.create_task(interrupted())
    client.close()
    assert stepped == ["interrupted"]
    assert waiting.cancelled() and loop.is_closed()
