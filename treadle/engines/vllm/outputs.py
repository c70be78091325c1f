"""What the engine's steps return: a generation request's new tokens, and scores.

A request added by :meth:`~treadle.engines.vllm.engine.VLLMRolloutEngine.add_request` gives
its new tokens at each step (vLLM's DELTA outputs); :func:`take_output` adds them to what the
request has so far and hands the finished ones on. :func:`score_in_queue` scores sequences
through the same queue. Choices:

- **Scoring through the engine's own queue** (`score`, the teacher of `treadle distill`). The
  engine is shared: the rollout server steps it request by request (`add_request`/`step`), so
  `LLM.generate` (which steps the engine until *everything* in it is done and drops the
  outputs of requests it did not add) must not run while requests are in flight. `score` adds
  one request per sequence (`max_tokens=1`, greedy, `prompt_logprobs=top_k`, flat log-probs,
  final output only) to the same engine and steps it until those are done; the outputs of
  the generation requests in flight that those steps produce are accumulated as `step` does,
  and the ones that finish are kept and returned by the next `step` (an `abort` of one takes
  it back). So scoring is correct at any point between two steps, and in-flight generation
  advances (batched with the scoring) meanwhile. vLLM computes prompt log-probs from the raw
  logits, `log_softmax` in float32, whatever `logprobs_mode` says ("prompt tokens skip
  sampling processors", `gpu_model_runner._get_prompt_logprobs_dict`; on CUDA its V2 model
  runner's `PromptLogprobsWorker` does the same), and never reads the prefix cache for such a
  request (`skip_reading_prefix_cache`); the top-k needs an engine started with
  `max_logprobs >= top_k` (vLLM's default is 20). A scoring request carries a seed of its own,
  never used (it is greedy), so that vLLM's CUDA runner draws none from numpy's global RNG.
"""

from __future__ import annotations

import itertools
from typing import Any

from treadle.engines.inference import Finished, Scored
from treadle.engines.vllm.slot import LiveEngine

_SCORE_IDS = itertools.count()


def take_output(live: LiveEngine, result: Any, done: list[Finished]) -> None:
    """Add a generation request's new tokens (a DELTA output) to what it has so far; a
    finished one goes to ``done``."""
    (sample,) = result.outputs
    tokens, logps = live.so_far[result.request_id]
    new = list(sample.token_ids)
    tokens += new
    logps += [step[t].logprob for step, t in zip(sample.logprobs or [], new, strict=True)]
    if result.finished:
        del live.so_far[result.request_id]
        done.append(Finished(result.request_id, tokens, logps, stop_reason(sample.finish_reason)))


def score_in_queue(
    live: LiveEngine, sequences: list[list[int]], starts: list[int], top_k: int
) -> list[Scored]:
    """Score through the engine's queue: one request per sequence, stepped to the end; the
    generation requests in flight advance meanwhile (their finished ones go to the stash)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    most = live.llm.llm_engine.model_config.max_logprobs
    if most != -1 and top_k > most:
        raise ValueError(
            f"score: top_k={top_k} is more than the vLLM engine's max_logprobs={most} (the "
            "teacher's engine is started with max_logprobs >= distill.top_k)"
        )
    params = VLLMSamplingParams(
        max_tokens=1,
        temperature=0.0,
        seed=0,  # unused (greedy); else vLLM's CUDA runner draws one from numpy's global RNG
        prompt_logprobs=top_k,
        flat_logprobs=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    out: dict[int, Scored] = {}
    pending: dict[str, int] = {}
    for i, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
        if start == len(seq):
            out[i] = Scored([], [], [])
            continue
        rid = f"treadle-score-{next(_SCORE_IDS)}"
        live.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=list(seq)), params)
        pending[rid] = i
    try:
        while pending:
            for result in live.llm.llm_engine.step():
                i = pending.pop(result.request_id, -1)
                if i >= 0:
                    out[i] = _scored(result.prompt_logprobs, sequences[i], starts[i], top_k)
                elif result.request_id in live.so_far:
                    take_output(live, result, live.stash)
    finally:
        if pending:  # an error: leave nothing of ours in the engine
            live.llm.llm_engine.abort_request(list(pending))
    return [out[i] for i in range(len(sequences))]


def _scored(flat: Any, seq: list[int], start: int, top_k: int) -> Scored:
    """Positions ``start..L-1`` of a request's flat prompt log-probs. Each position holds the
    actual token first (with its rank), then the top ``top_k`` by rank."""
    log_probs, ids, top = [], [], []
    for pos in range(start, len(seq)):
        a, b = flat.start_indices[pos], flat.end_indices[pos]
        if flat.token_ids[a] != seq[pos] or b - a != top_k + 1:
            raise RuntimeError(
                f"vLLM's prompt log-probs at position {pos}: expected token {seq[pos]} and "
                f"{top_k} top entries, got {flat.token_ids[a:b]}"
            )
        log_probs.append(flat.logprobs[a])
        ids.append(flat.token_ids[a + 1 : b])
        top.append(flat.logprobs[a + 1 : b])
    return Scored(log_probs, ids, top)


def stop_reason(finish_reason: str | None) -> str:
    """``stop`` or ``length``; any other reason vLLM finishes a sample with is an error."""
    if finish_reason in ("stop", "length"):
        return finish_reason
    raise RuntimeError(f"vLLM finished a sample with reason {finish_reason!r}")
