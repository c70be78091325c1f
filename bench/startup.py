"""Where the time from `treadle train` to the first step goes, SmolLM2-135M-Instruct.

    OMP_NUM_THREADS=1 python bench/startup.py [--engines vllm hf] [--repeat 1]
        [--layouts colocated split] [--before TREE] [--check-repeat 3]

Each run is `treadle train examples/arithmetic/grpo.yaml` from SmolLM2-135M-Instruct
(`treadle model fetch`, done first if missing; the data of `treadle prepare` likewise), one
short step (4 prompts x 2 samples, 8 new tokens), under Ray with the rollout replica in the
actor's process: the default layout. It reads the first step's `timing/startup` (the process's
start to the first step) and `startup/<part>` from metrics.jsonl:

- imports: the interpreter and the command's imports (torch, transformers, ...);
- check: the config loaded and `treadle check`'s checks (data rows, model folders, reward);
- trainer: the trainer's imports and its run directory;
- ray: what the driver waited for Ray (started in the background after the check, a local
  cluster or joining one: ray/background is its own seconds);
- data: its datasets read and tokenized, while the workers start (RL on Ray: the driver
  starts them first, `treadle.trainers.launch`);
- workers: what the driver then waited for the actor's worker group, of which (rank 0's own
  clock, from its process's start of the worker) process_group, actor_model, reference_model
  and rollout_engine (vLLM's start, colocated); the rest is Ray placing the actors and their
  processes' imports;
- rollout: the client over the replicas (split: what the driver still waited for the
  replicas, which start beside the actors' group); other: what no part claims.

(A driver that starts its workers after its data, the local backend's, has no `trainer`
part: its `data` holds those imports, and its `ray` and `workers` come after it.)

`--layouts split` runs the tiny model of `treadle prepare` with examples/arithmetic/
grpo_split.yaml instead (the same short step; two replicas in a pool of their own, half the
CPUs).

The table has a column per engine and, with two engines, the ratio of the first to the second
(measured in the same run of this script, one after the other). With `--before TREE` it has a
column before (``TREE``'s code) and after (this checkout's) per engine, the runs interleaved
(each repeat runs both), medians of `--repeat`.

First, `treadle check examples/arithmetic/grpo.yaml` alone (the demo's config and data; its
SFT model when `make demo` made it, else `treadle prepare`'s), wall seconds, median of
--check-repeat runs: with an empty cache of kept answers (`TREADLE_CHECK_CACHE`, a fresh
folder each run), with the answers kept by a run before it, and with only the answers of
transformers' imports kept (`imports kept`: `treadle/importcache.py`; what a new config's first
check costs where any treadle command ran before). The ratio is the speed-up over
`--before TREE` (a checkout of the code before, run in the same way, interleaved with the
others), or over the figure issue 29 recorded (12-15 s: the low end, 12 s). `--check-only`
stops there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def startup(engine: str, layout: str = "colocated", tree: Path = ROOT) -> dict[str, float]:
    """The first step's ``timing/startup`` and ``startup/<part>`` of one run, ``tree``'s code."""
    config, model = "examples/arithmetic/grpo.yaml", MODEL
    if layout == "split":  # the tiny model, two replicas in a pool of their own
        config, model = "examples/arithmetic/grpo_split.yaml", DATA / "model_init"
    with tempfile.TemporaryDirectory() as out:
        run_tree(
            tree,
            "train",
            config,
            f"model.path={model}",
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


def run_tree(tree: Path, *args: str, env: dict[str, str] | None = None) -> None:
    """``treadle ARGS`` with the code of ``tree`` (its checkout, not the installed one), run
    in ``tree``: Ray puts its driver's working directory first on its workers' ``sys.path``,
    so from another directory the workers would import that directory's treadle (measured:
    a worker-side change showed in both columns). The arguments' paths are absolute."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(tree)}
    done = subprocess.run(  # -P: the driver imports ``tree``'s treadle, by PYTHONPATH
        [sys.executable, "-P", "-m", "treadle", *args],
        cwd=tree,
        env=env,
        text=True,
        capture_output=True,
        check=False,
    )
    if done.returncode:
        sys.exit(f"treadle {args[0]} ({tree}) exited {done.returncode}:\n{done.stderr[-3000:]}")


IMPORTS = "imports kept"


def check_seconds(tree: Path, cache: str) -> float:
    """Wall seconds of `treadle check` on the demo's GRPO config, the code of ``tree``."""
    model = SFT_MODEL if SFT_MODEL.is_dir() else DATA / "model_init"
    start = time.perf_counter()
    run_tree(  # the config's own paths, relative to this checkout, made absolute
        tree,
        "check",
        "examples/arithmetic/grpo.yaml",
        f"model.path={model}",
        f"data.train_files=[{DATA / 'train.jsonl'}]",
        f"data.val_files=[{DATA / 'test.jsonl'}]",
        env={"TREADLE_CHECK_CACHE": cache},
    )
    return time.perf_counter() - start


def check_table(repeat: int, before: Path | None) -> None:
    """The check's rows: before (``before``'s code), an empty cache, the answers kept, and the
    import answers kept without the check's own (treadle.runtime.importcache: a new config's
    check on a machine where treadle ran before)."""
    runs: dict[str, list[float]] = {"before": [], "empty cache": [], "kept": [], IMPORTS: []}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as cache:
            if before is not None:
                runs["before"].append(check_seconds(before, "off"))
            runs["empty cache"].append(check_seconds(ROOT, cache))
            runs["kept"].append(check_seconds(ROOT, cache))
            for kind in Path(cache).iterdir():
                if kind.name != "imports":
                    shutil.rmtree(kind)
            runs[IMPORTS].append(check_seconds(ROOT, cache))
    base = statistics.median(runs["before"]) if before is not None else CHECK_RECORDED_S
    against = f"vs {before}" if before is not None else f"vs {base:g} s recorded"
    print(f"{'treadle check':<28}{'s':>10}{'speed-up':>10}  ({against})")
    if before is not None:
        print(f"{'  before':<28}{base:>10.2f}")
    for name in ("empty cache", "kept", IMPORTS):
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
    p.add_argument(
        "--layouts",
        nargs="+",
        default=["colocated"],
        choices=["colocated", "split"],
        help="colocated: SmolLM2, the replica in the actor's process; split: the tiny model, "
        "two replicas in a pool of their own",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs of each column (the median)")
    p.add_argument("--check-repeat", type=int, default=3, help="runs of each check row (0: none)")
    p.add_argument("--before", type=Path, default=None, help="a checkout of the code before")
    p.add_argument("--check-only", action="store_true", help="the check's rows only")
    args = p.parse_args()
    if not (DATA / "train.jsonl").is_file():
        treadle("prepare")
    if args.check_repeat:
        check_table(args.check_repeat, args.before)
    if args.check_only:
        return
    if not MODEL.is_dir():
        print(treadle("model", "fetch", "smollm2-135m-instruct").stdout.strip())
    trees = {"before": args.before, "after": ROOT} if args.before else {"": ROOT}
    runs: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for _ in range(args.repeat):  # interleaved: each repeat runs every tree once
        for layout in args.layouts:
            for engine in args.engines:
                for which, tree in trees.items():
                    one = startup(engine, layout, tree)
                    runs.setdefault((layout, engine, which), []).append(one)
                    label = " ".join(x for x in (layout, engine, which) if x)
                    parts = ", ".join(
                        f"{k.replace('timing/startup', 'total').removeprefix('startup/')} {v:.1f}"
                        for k, v in sorted(one.items())
                    )
                    print(f"{label}: {parts}", file=sys.stderr, flush=True)
    for layout in args.layouts:
        columns = {
            " ".join(x for x in (engine, which) if x): runs[(layout, engine, which)]
            for engine in args.engines
            for which in trees
        }
        print(f"{layout}, median of {args.repeat}:")
        print_table({name: medians(rs) for name, rs in columns.items()})
    print(f"cpus: {os.cpu_count()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}")


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each key's median over ``runs`` (0 where a run lacks it)."""
    keys = sorted({k for r in runs for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


def print_table(results: dict[str, dict[str, float]]) -> None:
    """A row per part (its details indented under it), a column per run; with two columns,
    the ratio of the first to the second."""
    details = [k[8:] for r in results.values() for k in r if "/" in k[8:]]
    order = []
    parts = ("imports", "check", "trainer", "data", "ray", "workers", "resume", "rollout", "other")
    for part in parts:
        own = {d for d in details if d.startswith(part + "/")}
        order += [part, *sorted(own, key=details.index)]
    names = list(results)
    head = f"{'part':<28}" + "".join(f"{n + ' s':>14}" for n in names)
    head += f"{names[0] + '/' + names[1]:>16}" if len(names) == 2 else ""
    print(head)
    rows = [(f"startup/{name}", name) for name in order] + [("timing/startup", "total")]
    for key, label in rows:
        values = [results[n].get(key) for n in names]
        if all(v is None for v in values):
            continue
        indent = "  " if label.count("/") else ""
        line = f"{indent + label:<28}" + "".join(f"{(v or 0.0):>14.1f}" for v in values)
        if len(values) == 2 and values[1]:
            line += f"{(values[0] or 0.0) / values[1]:>16.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
