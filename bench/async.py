"""Asynchronous training against synchronous, on the same cores and the same workload.

    OMP_NUM_THREADS=1 python bench/async.py [--steps 20] [--runs async async_drop]

The workload is `examples/arithmetic/grpo_async.yaml`: GRPO on the built-in arithmetic task
from the SFT warm start, vLLM rollout, 32 prompts x 8 samples a step, one optimizer step on
all 256, no reference model. If the warm start `runs/arithmetic/sft/final_model` is missing it
is made first (`treadle prepare`, then `examples/arithmetic/sft.yaml`, about two minutes).
Five runs (or those `--runs` names), one after the other, each a `treadle train` process of its
own for `--steps` steps (the same number of trained samples):

- `sync_colocated`: trainer.mode=sync, the replica inside the actor's process: all cores for
  each phase in turn (the default of `grpo.yaml`);
- `sync_split`: trainer.mode=sync, the replica in a pool of its own (the cores divided between
  actor and replica: `rollout.num_cpus`, half by default);
- `one_step_off`: split, step t+1 generated while step t trains;
- `async`: split, the config's `async` section (max_staleness 1, partial rollouts, TIS), with
  `async.admission: bounded` (the default): a group starts only when it will be trained within
  the bound, and the trainer takes the oldest first, so nothing is dropped;
- `async_drop`: the same with `async.admission: drop`: the trainer takes the groups that finished
  first and drops those that fell outside the bound (`async/dropped_total`, in the table).

Trained tokens/s is the response tokens of every trained batch over the summed step times
(`timing/step`: generation, or waiting for it, plus training and weight sync; start-up,
checkpoint and evaluation excluded); the median step time is the steadier number on a shared
machine, where a few steps slowed by other load move the sum. Held-out accuracy is greedy, on
all 500 held-out problems, after the last step. The table is followed by
`ratio async/sync_split: <r>`, `ratio async/sync_colocated: <r>`,
`ratio one_step_off/sync_split: <r>`, `ratio async/async_drop: <r>` (tokens/s),
`accuracy async-sync: <points>` (async minus sync_split, the run that differs from it only in
the mode) and `accuracy async-async_drop: <points>`, each where both runs ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = "examples/arithmetic/grpo_async.yaml"
WARM_START = Path("runs/arithmetic/sft/final_model")
RUNS = {
    "sync_colocated": ["trainer.mode=sync", "rollout.placement=colocated"],
    "sync_split": ["trainer.mode=sync", "rollout.placement=split"],
    "one_step_off": ["trainer.mode=one_step_off", "rollout.placement=split"],
    "async": ["trainer.mode=async", "rollout.placement=split", "async.admission=bounded"],
    "async_drop": ["trainer.mode=async", "rollout.placement=split", "async.admission=drop"],
}


def treadle(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "treadle", *args], check=True)


def warm_start() -> None:
    if (WARM_START / "config.json").is_file():
        return
    from treadle.tasks.arithmetic import prepare

    print(f"making the SFT warm start {WARM_START} ...", flush=True)
    prepare("data/arithmetic")
    treadle("sft", "examples/arithmetic/sft.yaml", "trainer.progress=false")


def run(name: str, steps: int, out: Path) -> dict[str, float]:
    started = time.perf_counter()
    treadle(
        "train",
        CONFIG,
        *RUNS[name],
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={out}",
        "trainer.save_every=0",
        "trainer.progress=false",
        "data.val_size=null",
    )
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = sum(m["timing/step"] for m in metrics)
    tokens = sum(m["throughput/tokens_per_s"] * m["timing/step"] for m in metrics)
    return {
        "steps": len(metrics),
        "tokens": tokens,
        "seconds": seconds,
        "median_step": statistics.median(m["timing/step"] for m in metrics),
        "tokens_per_s": tokens / seconds,
        "accuracy": 100 * metrics[-1]["eval/val/accuracy"],
        "dropped": metrics[-1].get("async/dropped_total", 0.0),
        "staleness": sum(m.get("async/staleness_mean", 0.0) for m in metrics) / len(metrics),
        "rollout_idle": _mean(metrics, "async/rollout_idle_frac"),
        "trainer_idle": _mean(metrics, "async/trainer_idle_frac"),
        "wall": time.perf_counter() - started,
    }


def _mean(metrics: list[dict], key: str) -> float:
    values = [m[key] for m in metrics if key in m]
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warm_start()
    results = {}
    with tempfile.TemporaryDirectory(prefix="treadle-bench-async-") as tmp:
        for name in args.runs:
            print(f"[{name}] {args.steps} steps ...", flush=True)
            results[name] = run(name, args.steps, Path(tmp) / name)
    report(results)


def report(results: dict[str, dict[str, float]]) -> None:
    print()
    print(
        "| run | trained tokens | step time (s) | median step (s) | trained tokens/s "
        "| held-out accuracy "
        "| staleness mean | dropped | replica idle | trainer idle |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(
            f"| {name} | {r['tokens']:.0f} | {r['seconds']:.1f} | {r['median_step']:.2f} "
            f"| {r['tokens_per_s']:.0f} "
            f"| {r['accuracy']:.1f}% | {r['staleness']:.2f} | {r['dropped']:.0f} "
            f"| {_pct(r['rollout_idle'])} | {_pct(r['trainer_idle'])} |"
        )
    for a, b in [
        ("async", "sync_split"),
        ("async", "sync_colocated"),
        ("one_step_off", "sync_split"),
        ("async", "async_drop"),
    ]:
        if a in results and b in results:
            print(f"ratio {a}/{b}: {results[a]['tokens_per_s'] / results[b]['tokens_per_s']:.2f}")
    for a, b, label in [("async", "sync_split", "async-sync"), ("async", "async_drop", None)]:
        if a in results and b in results:
            gap = results[a]["accuracy"] - results[b]["accuracy"]
            print(f"accuracy {label or f'{a}-{b}'}: {gap:+.1f}")


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.0f}%"


if __name__ == "__main__":
    main()
