"""What the vLLM engine does differently on CUDA, checked on the CPU with stand-ins for vLLM's
`LLM` (no engine starts here):

- vLLM 0.32's CUDA model runner (V2) hashes each request's sampling noise from the request's
  seed, and draws a seed from numpy's global RNG for a request without one, in the model
  runner's process (vLLM's worker process under tensor parallelism)
  (`vllm/v1/worker/gpu/sample/states.py`): on CUDA every request of treadle's carries its own
  seed, drawn from the torch RNG `params.seed` (or the rollout server) seeded, and a scoring
  request carries one too; on CPU, where per-request seeds crash vLLM 0.32, none does;
- asleep (sleep mode, CUDA only) the weights are not in device memory: a reload wakes the
  engine first and puts it back to sleep after;
- a split replica of ``rollout.tensor_parallel_size`` GPUs starts vLLM's multiprocessing
  executor (its default there, Ray's, refuses a bundle of more than one GPU).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from treadle.config import load_config
from treadle.engines.inference import SamplingParams
from treadle.engines.vllm import VLLMRolloutEngine
from treadle.engines.vllm.slot import (
    EngineSettings,
    LiveEngine,
    reload_folder,
    takes_request_seeds,
)
from treadle.serving.replica import role_engine

SETTINGS = EngineSettings("m", "bfloat16", 0, 64, 1.0, 0.5)


def v2_seed(params: Any) -> int:
    """The seed vLLM's V2 model runner samples a request with: its own, or one from numpy."""
    if params.seed is not None:
        return int(params.seed)
    return int(np.random.randint(np.iinfo(np.int64).min, np.iinfo(np.int64).max))


class CudaLikeLLM:
    """Records the calls a weight reload makes; `generate` samples as vLLM's V2 model runner
    does: a request's token a function of its seed (:func:`v2_seed`), the seeds given."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.seeds: list[int | None] = []
        self.llm_engine = SimpleNamespace(reset_encoder_cache=lambda: self.calls.append("enc"))

    def generate(self, prompts: list[Any], params: Any, use_tqdm: bool) -> list[Any]:
        each = params if isinstance(params, list) else [params] * len(prompts)
        out = []
        for p in each:
            self.seeds.append(p.seed)
            token = v2_seed(p) % 1000
            sample = SimpleNamespace(
                index=0,
                token_ids=[token],
                logprobs=[{token: SimpleNamespace(logprob=-1.0)}],
                finish_reason="length",
            )
            out.append(SimpleNamespace(outputs=[sample]))
        return out

    def reset_prefix_cache(self) -> None:
        self.calls.append("prefix")

    def wake_up(self) -> None:
        self.calls.append("wake")

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.calls.append(method)
        return [[]]  # treadle_finish_weight_update: no parameter left unset


def engine_on(llm: CudaLikeLLM, asleep: bool = False, cuda: bool = True) -> VLLMRolloutEngine:
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    engine._live = LiveEngine(SETTINGS, llm, False, 0.0, seeds_requests=cuda)
    engine._live.asleep = asleep
    engine.turn_stops = []
    return engine


@pytest.mark.slow  # imports vLLM (~7 s) for its SamplingParams
def test_on_cuda_each_prompt_s_request_carries_a_seed_drawn_from_params_seed():
    llm = CudaLikeLLM()
    engine = engine_on(llm)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=1, seed=7)
    prompts = [[1, 2], [3, 4], [5]]
    np.random.seed(123)
    torch.manual_seed(123)
    host, torch_host = np.random.get_state(), torch.random.get_rng_state()
    a = engine.generate(prompts, params)
    assert np.array_equal(np.random.get_state()[1], host[1])  # no seed drawn from numpy
    assert torch.equal(torch.random.get_rng_state(), torch_host)  # the host's stream kept
    seeds = llm.seeds[:]
    assert len(set(seeds)) == 3 and all(0 <= s < 1 << 62 for s in seeds)  # (+ n - 1: int64)
    np.random.seed(456)  # other host states: the same rollout
    torch.manual_seed(456)
    assert engine.generate(prompts, params).token_ids == a.token_ids
    other = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=1, seed=8))
    assert other.token_ids != a.token_ids
    # on CPU no request carries a seed (vLLM 0.32's CPU runner crashes on them)
    llm.seeds.clear()
    engine_on(llm, cuda=False).generate(prompts, params)
    assert llm.seeds == [None] * 3


@pytest.mark.parametrize(
    ("cuda", "v2", "seeds"), [(True, True, True), (True, False, False), (False, False, False)]
)
def test_requests_carry_seeds_under_the_cuda_v2_runner_only(cuda, v2, seeds):
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(use_v2_model_runner=v2))
    )
    assert takes_request_seeds(llm, cuda) is seeds


class RecordingQueue:
    """`llm_engine` taking requests: the seeds they carry."""

    def __init__(self) -> None:
        self.seeds: list[int | None] = []

    def add_request(self, request_id: str, prompt: Any, params: Any) -> None:
        self.seeds.append(params.seed)


@pytest.mark.slow  # imports vLLM (~7 s) for its SamplingParams
@pytest.mark.parametrize("cuda", [True, False])
def test_a_queued_request_carries_a_seed_from_the_torch_rng_on_cuda_only(cuda):
    """The rollout server seeds the torch RNG when it goes busy: the same requests get the same
    seeds (vLLM's V2 runner would otherwise draw them from numpy in its own process)."""
    llm = CudaLikeLLM()
    llm.llm_engine = RecordingQueue()  # type: ignore[assignment]
    engine = engine_on(llm, cuda=cuda)
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=1, seed=7)
    for _ in range(2):
        torch.manual_seed(5)
        engine.add_request("a", [1, 2], params)
        engine.add_request("b", [1, 2], params)
    seeds = llm.llm_engine.seeds
    if cuda:
        torch.manual_seed(5)
        assert seeds == torch.randint(0, 1 << 62, (2,)).tolist() * 2 and seeds[0] != seeds[1]
    else:
        assert seeds == [None] * 4


class CudaLikeQueue:
    """`llm_engine` for scoring: a request without a seed draws one from numpy's global RNG when
    added (as vLLM's V2 model runner does); each finishes on the next step with flat prompt
    log-probs of its tokens (top_k 0: the token itself only)."""

    model_config = SimpleNamespace(max_logprobs=20)

    def __init__(self) -> None:
        self.added: list[tuple[str, list[int]]] = []

    def add_request(self, request_id: str, prompt: Any, params: Any) -> None:
        if params.seed is None:
            np.random.randint(np.iinfo(np.int64).min, np.iinfo(np.int64).max)
        self.added.append((request_id, list(prompt["prompt_token_ids"])))

    def step(self) -> list[Any]:
        done, self.added = self.added, []
        return [
            SimpleNamespace(
                request_id=rid,
                prompt_logprobs=SimpleNamespace(
                    start_indices=list(range(len(ids))),
                    end_indices=list(range(1, len(ids) + 1)),
                    token_ids=ids,
                    logprobs=[-1.0] * len(ids),
                ),
            )
            for rid, ids in done
        ]


@pytest.mark.slow  # imports vLLM (~7 s) for its SamplingParams
def test_scoring_leaves_the_numpy_rng_the_cuda_runner_draws_request_seeds_from():
    llm = CudaLikeLLM()
    llm.llm_engine = CudaLikeQueue()  # type: ignore[assignment]
    engine = engine_on(llm)
    np.random.seed(123)
    host = np.random.get_state()
    scored = engine.score([[1, 2, 3], [4, 5]], [1, 1], top_k=0)
    assert [s.log_probs for s in scored] == [[-1.0, -1.0], [-1.0]]
    assert np.array_equal(np.random.get_state()[1], host[1])  # the host's stream did not move


def test_a_reload_wakes_a_sleeping_engine_and_puts_it_back_to_sleep():
    llm = CudaLikeLLM()
    engine = engine_on(llm, asleep=True)
    reload_folder(engine._live)
    assert llm.calls == ["wake", "treadle_reload_from_disk", "prefix", "enc", "sleep 1"]
    assert engine._live.asleep and engine._live.weights_ok
    llm.calls.clear()
    engine.load_payloads([b"one", b"two"])
    assert llm.calls == [
        "wake",
        "treadle_begin_weight_update",
        "treadle_load_weight_bucket",
        "treadle_load_weight_bucket",
        "treadle_finish_weight_update",
        "prefix",
        "enc",
        "sleep 1",
    ]
    assert engine._live.asleep and engine._live.weights_ok
    llm.calls.clear()
    engine._live.asleep = False  # awake: no wake, no sleep
    reload_folder(engine._live)
    assert llm.calls == ["treadle_reload_from_disk", "prefix", "enc"]


def test_a_tensor_parallel_replica_runs_vllms_multiprocessing_executor():
    def extra(*overrides: str) -> dict[str, Any]:
        cfg = load_config(None, ["rollout.engine=vllm", "rollout.placement=split", *overrides])
        return role_engine(cfg, "rollout", "m").extra

    assert extra() == {}
    assert extra("rollout.tensor_parallel_size=2") == {
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
    }


def test_vllm_under_ray_s_noset_flag_is_refused_by_name(monkeypatch):
    """Under RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES a process sees every GPU of its node
    and vLLM takes GPU 0 whichever Ray gave it (its executor's local rank 0)."""
    from treadle.engines.vllm import slot
    from treadle.runtime.errors import ConfigError

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # (_start sets it; restored after)
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm does not run under RAY_EXP"):
        slot._start(SETTINGS)
