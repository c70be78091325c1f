"""What the vLLM engine does differently on CUDA, checked on the CPU with stand-ins for vLLM's
`LLM` (no engine starts here):

- vLLM 0.32's CUDA model runner (V2) samples with a seed per request, drawn from numpy's
  global RNG when a request without one is added (`vllm/v1/worker/gpu/sample/states.py`), not
  from the torch RNG the CPU runner draws from: `generate` seeds numpy too, and a scoring
  request carries a seed;
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

from treadle.config import load_config
from treadle.engines.inference import SamplingParams
from treadle.engines.vllm import VLLMRolloutEngine
from treadle.engines.vllm.slot import EngineSettings, LiveEngine, reload_folder
from treadle.serving.replica import role_engine

SETTINGS = EngineSettings("m", "bfloat16", 0, 64, 1.0, 0.5)


class CudaLikeLLM:
    """Records the calls a weight reload makes; `generate` samples as vLLM's V2 model runner
    does: each request's seed drawn from numpy's global RNG when it is added, its token a
    function of that seed."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.llm_engine = SimpleNamespace(reset_encoder_cache=lambda: self.calls.append("enc"))

    def generate(self, prompts: list[Any], params: Any, use_tqdm: bool) -> list[Any]:
        out = []
        for _ in prompts:
            seed = np.random.randint(np.iinfo(np.int64).min, np.iinfo(np.int64).max)
            token = int(seed % 1000)
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


def engine_on(llm: CudaLikeLLM, asleep: bool = False) -> VLLMRolloutEngine:
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    engine._live = LiveEngine(SETTINGS, llm, tied_embeddings=False, start_seconds=0.0)
    engine._live.asleep = asleep
    return engine


@pytest.mark.slow  # imports vLLM (~7 s) for its SamplingParams
def test_generate_seeds_the_numpy_rng_the_cuda_runner_draws_request_seeds_from():
    engine = engine_on(CudaLikeLLM())
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=1, seed=7)
    np.random.seed(123)
    host = np.random.get_state()
    a = engine.generate([[1, 2], [3, 4], [5]], params)
    assert np.array_equal(np.random.get_state()[1], host[1])  # the host's stream did not move
    np.random.seed(456)  # another host state: the same rollout
    assert engine.generate([[1, 2], [3, 4], [5]], params).token_ids == a.token_ids
    other = engine.generate([[1, 2], [3, 4], [5]], SamplingParams(n=1, max_new_tokens=1, seed=8))
    assert other.token_ids != a.token_ids


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
