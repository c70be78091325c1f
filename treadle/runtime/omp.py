"""How OpenMP's threads wait between parallel regions, in every process of a run.

libgomp (torch's OpenMP on Linux) lets a team's threads spin 300,000 rounds after each parallel
region before they sleep. Where the cores are shared (a rollout replica beside the trainer,
Ray's own processes, another job on a CI host) a spinning thread holds a core that the thread
its team waits for needs, and the team crawls. Measured on a 2-core Xeon (2026-11-26), one
actor update of the tiny model on 2 threads, 5 each:

- beside one busy process: 4.6-13.3 s by default, 2.6-3.2 s with 10,000 rounds, 4.1-4.6 s with
  30,000;
- on a quiet machine: 1.00-1.27 s by default, 1.06-1.28 s with 10,000 rounds, 1.25-1.61 s with
  1,000, 1.33-1.62 s waiting passively; SmolLM2's update 9.8-10.1 s against 9.3-9.9 s.

Three local-backend test files (36 tests): 58.5 s by default against 38.0 s beside one busy
process, 50.9 against 38.3 s without it. ``bench/grpo_vs_trl.py``'s treadle side on SmolLM2, two
pairs: once generation took 61.1 s a step by default against 7.3 s, then 9.2 against 9.3 s.
vLLM's SmolLM2 decode alone, three pairs in one process each: 592-761 tokens/s by default, 543-685
with 10,000 rounds, 628-686 with 100,000: perhaps a few percent slower, within the noise.

So treadle's processes take ``GOMP_SPINCOUNT=10000`` unless it is set: the command line's
process before anything imports torch (libgomp reads it once, when it is loaded), every Ray
worker through its environment (:func:`treadle.controller.placement.ray_env`).
"""

from __future__ import annotations

import os

SPIN_ROUNDS = "10000"


def openmp_env() -> dict[str, str]:
    """The OpenMP settings of a treadle process: this process's own where it sets them."""
    return {"GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", SPIN_ROUNDS)}
