"""Where the time from `treadle train` to the first step goes, SmolLM2-135M-Instruct.

    OMP_NUM_THREADS=1 python bench/startup.py [--engines vllm hf] [--repeat 1]

Each run is `treadle train examples/arithmetic/grpo.yaml` from SmolLM2-135M-Instruct
(`treadle model fetch`, done first if missing; the data of `treadle prepare` likewise), one
short step (4 prompts x 2 samples, 8 new tokens), under Ray with the rollout replica in the
actor's process: the default layout. It reads the first step's `timing/startup` (the process's
start to the first step) and `startup/<part>` from metrics.jsonl:

- imports: the interpreter and the command's imports (torch, transformers, ...);
- check: the config loaded and `treadle check`'s checks (data rows, model folders, reward);
- data: the trainer's imports and its datasets read and tokenized;
- ray: what the driver waited for Ray (started in the background after the check, a local
  cluster or joining one: ray/background is its own seconds);
- workers: the actor's worker group ready, of which (rank 0's own clock)
  process_group, actor_model, reference_model and rollout_engine (vLLM's start, colocated);
  the rest of `workers` is Ray placing the actors and their processes' imports;
- rollout: the client over the replicas; other: what no part claims.

The table has a column per engine and, with two engines, the ratio of the first to the second
(measured in the same run of this script, one after the other).

First, `treadle check examples/arithmetic/grpo.yaml` alone (the demo's config and data; its
SFT model when `make demo` made it, else `treadle prepare`'s), wall seconds, median of
--check-repeat runs: with an empty cache of kept answers (`TREADLE_CHECK_CACHE`, a fresh
folder each run) and with the answers kept by a run before it. The ratio is the speed-up over
`--before TREE` (a checkout of the code before, run in the same way, interleaved with the
others), or over the figure issue 29 recorded (12-15 s: the low end, 12 s). `--check-only`
stops there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import ROOT, ensure_project_python

MODEL = Path.home() / ".cache" / "treadle" / "models" / "smollm2-135m-instruct"
DATA = ROOT / "data" / "arithmetic"
SFT_MODEL = ROOT / "runs" / "arithmetic" / "sft" / "final_model"
CHECK_RECORDED_S = 12.0  # issue 29: `treadle check` took 12-15 s per config (2-core AMD EPYC)


def treadle(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / ".venv" / "bin" / "treadle"), *args],
        cwd=ROOT,
        check=True,
        text=True,
        capture_output=True,
        **kw,
    )


def startup(engine: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        treadle(
            "train",
            "examples/arithmetic/grpo.yaml",
            f"model.path={MODEL}",
            f"data.train_files=[{DATA / 'train.jsonl'}]",
            "data.val_files=[]",
            "data.batch_size=4",
            "rollout.n=2",
            "rollout.max_new_tokens=8",
            f"rollout.engine={engine}",
            "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size=8",
            "trainer.total_steps=1",
            "trainer.progress=false",
            f"trainer.output_dir={out}",
        )
        first = json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[0])
    return {k: v for k, v in first.items() if k == "timing/startup" or k.startswith("startup/")}


def check_seconds(tree: Path, cache: str) -> float:
    """Wall seconds of `treadle check` on the demo's GRPO config, the code of ``tree``."""
    overrides = [] if SFT_MODEL.is_dir() else [f"model.path={DATA / 'model_init'}"]
    env = {**os.environ, "PYTHONPATH": str(tree), "TREADLE_CHECK_CACHE": cache}
    start = time.perf_counter()
    subprocess.run(  # -P: not the working directory's treadle first, ``tree``'s (PYTHONPATH)
        [
            sys.executable,
            "-P",
            "-m",
            "treadle",
            "check",
            "examples/arithmetic/grpo.yaml",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def check_table(repeat: int, before: Path | None) -> None:
    """The check's rows: before (``before``'s code), an empty cache, the answers kept."""
    runs: dict[str, list[float]] = {"before": [], "empty cache": [], "kept": []}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as cache:
            if before is not None:
                runs["before"].append(check_seconds(before, "off"))
            runs["empty cache"].append(check_seconds(ROOT, cache))
            runs["kept"].append(check_seconds(ROOT, cache))
    base = statistics.median(runs["before"]) if before is not None else CHECK_RECORDED_S
    against = f"vs {before}" if before is not None else f"vs {base:g} s recorded"
    print(f"{'treadle check':<28}{'s':>10}{'speed-up':>10}  ({against})")
    if before is not None:
        print(f"{'  before':<28}{base:>10.2f}")
    for name in ("empty cache", "kept"):
        median = statistics.median(runs[name])
        print(f"{'  ' + name:<28}{median:>10.2f}{base / median:>10.2f}")
    print(
        f"(median of {repeat}; each: "
        + "; ".join(f"{k} {', '.join(f'{v:.2f}' for v in vs)}" for k, vs in runs.items() if vs)
        + ")",
        flush=True,
    )


def main() -> None:
    ensure_project_python()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", nargs="+", default=["vllm", "hf"], choices=["vllm", "hf"])
    p.add_argument("--repeat", type=int, default=1, help="runs per engine (the median is shown)")
    p.add_argument("--check-repeat", type=int, default=3, help="runs of each check row")
    p.add_argument("--before", type=Path, default=None, help="a checkout of the code before")
    p.add_argument("--check-only", action="store_true", help="the check's rows only")
    args = p.parse_args()
    if not (DATA / "train.jsonl").is_file():
        treadle("prepare")
    check_table(args.check_repeat, args.before)
    if args.check_only:
        return
    if not MODEL.is_dir():
        print(treadle("model", "fetch", "smollm2-135m-instruct").stdout.strip())
    results: dict[str, dict[str, float]] = {}
    for engine in args.engines:
        runs = [startup(engine) for _ in range(args.repeat)]
        keys = sorted({k for r in runs for k in r})
        results[engine] = {k: sorted(r.get(k, 0.0) for r in runs)[len(runs) // 2] for k in keys}
        print(f"{engine}: {results[engine]['timing/startup']:.1f} s", file=sys.stderr, flush=True)
    details = [k[8:] for r in results.values() for k in r if "/" in k[8:]]
    order = []
    for part in ("imports", "check", "data", "ray", "workers", "resume", "rollout", "other"):
        own = {d for d in details if d.startswith(part + "/")}
        order += [part, *sorted(own, key=details.index)]
    engines = list(results)
    head = f"{'part':<28}" + "".join(f"{e + ' s':>10}" for e in engines)
    head += f"{engines[0] + '/' + engines[1]:>12}" if len(engines) == 2 else ""
    print(head)
    rows = [(f"startup/{name}", name) for name in order] + [("timing/startup", "total")]
    for key, label in rows:
        values = [results[e].get(key) for e in engines]
        if all(v is None for v in values):
            continue
        indent = "  " if label.count("/") else ""
        line = f"{indent + label:<28}" + "".join(f"{(v or 0.0):>10.1f}" for v in values)
        if len(values) == 2 and values[1]:
            line += f"{(values[0] or 0.0) / values[1]:>12.2f}"
        print(line)
    print(f"cpus: {os.cpu_count()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}")


if __name__ == "__main__":
    main()
