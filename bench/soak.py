"""A long run with faults along the way: async GRPO on the tiny model, replicas and reward
workers killed while it trains.

    OMP_NUM_THREADS=1 python bench/soak.py [--minutes 30] [--replica-every 5] [--reward-every 7]

The run: `treadle train` of async GRPO (`trainer.mode=async`, `async.max_staleness=1`) on the
tiny arithmetic task of `treadle prepare` (made in a temporary folder), two split vLLM rollout
replicas, `reward.num_workers=2`, a checkpoint every 10 steps. While it runs, a rollout replica
is killed with SIGKILL every `--replica-every` minutes and a reward worker every
`--reward-every` minutes (the processes are found by their command lines: Ray's
`ray::RolloutReplica`, treadle's reward worker); after `--minutes` the run is stopped with
SIGTERM (as Ctrl-C), and an undisturbed run of the same number of steps is made for comparison.

It prints: the steps done, the replica and reward-worker restarts the run counted
(`rollout/replica_restarts`, `reward/worker_restarts`), the samples lost (steps whose batch was
short of `data.batch_size x rollout.n`, summed; must be 0), `async/dropped`, the worst growth
of a process's resident memory from a quarter of the run in to the end (at most 10%; the
killed ones' replacements are not compared), the open file descriptors of the driver, and the
greedy held-out accuracy (200 problems) of both runs' last evaluations. Both runs start from a
300-step SFT warm start of the tiny model (made first, about two minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _env import ROOT, ensure_project_python

BATCH, N = 8, 4
CONFIG = "examples/arithmetic/grpo.yaml"  # every setting it has is overridden below


def overrides(task: dict, out: Path, steps: int) -> list[str]:
    return [
        f"model.path={task['model']}",
        f"data.train_files=[{task['train']}]",
        f"data.val_files=[{task['test']}]",
        "data.val_size=null",
        f"data.batch_size={BATCH}",
        "data.max_prompt_length=64",
        f"rollout.n={N}",
        "rollout.max_new_tokens=48",
        "rollout.engine=vllm",
        "rollout.placement=split",
        "rollout.replicas=2",
        "rollout.max_restarts=1000",
        "reward.function=arithmetic",
        "reward.num_workers=2",
        "algorithm.kl_coef=0",
        f"actor.ppo_mini_batch_size={BATCH * N}",
        "actor.lr=5e-4",
        "trainer.mode=async",
        "trainer.backend=ray",
        f"trainer.total_steps={steps}",
        "trainer.save_every=10",
        "trainer.eval_every=10",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
    ]


def processes(driver: int) -> dict[str, list]:
    """The run's replicas and reward workers (psutil processes), by what they are."""
    import psutil

    found: dict[str, list] = {"replica": [], "reward": [], "other": []}
    for p in [*psutil.Process(driver).children(recursive=True), psutil.Process(driver)]:
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:
            continue
        kind = "replica" if "RolloutReplica" in line else "reward" if "_serve_fd" in line else ""
        found[kind or "other"].append(p)
    for p in psutil.process_iter(["cmdline"]):  # Ray's workers are the raylet's children
        line = " ".join(p.info["cmdline"] or [])
        if "ray::RolloutReplica" in line and p not in found["replica"]:
            found["replica"].append(p)
    return found


def rss(procs: dict[str, list]) -> dict[int, float]:
    out = {}
    for group in procs.values():
        for p in group:
            try:
                out[p.pid] = p.memory_info().rss / 2**20
            except Exception:
                continue
    return out


def soak(task: dict, out: Path, args: argparse.Namespace) -> dict:
    """The disturbed run; what it did."""
    cmd = [sys.executable, "-m", "treadle", "train", CONFIG, *overrides(task, out, 100_000)]
    log = (out.parent / "soak.log").open("w")
    driver = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=ROOT)
    start, kills = time.monotonic(), {"replica": 0, "reward": 0}
    warm: dict[int, float] = {}
    while time.monotonic() - start < args.minutes * 60 and driver.poll() is None:
        time.sleep(2)  # (a benchmark: the run's own events are what it reports)
        minutes = (time.monotonic() - start) / 60
        procs = processes(driver.pid)
        if not warm and minutes >= args.minutes / 4:  # warmed up: a quarter of the run in
            warm = rss(procs)
        for kind, every in (("replica", args.replica_every), ("reward", args.reward_every)):
            if procs[kind] and minutes >= every * (kills[kind] + 1):
                os.kill(procs[kind][0].pid, signal.SIGKILL)
                kills[kind] += 1
    if driver.poll() is not None:  # it ended by itself: why
        tail = (out.parent / "soak.log").read_text().splitlines()[-15:]
        raise SystemExit(f"the run ended early (exit {driver.returncode}):\n" + "\n".join(tail))
    end = rss(processes(driver.pid))
    fds = len(os.listdir(f"/proc/{driver.pid}/fd")) if driver.poll() is None else -1
    driver.send_signal(signal.SIGTERM)
    code = driver.wait(timeout=300)
    return {"kills": kills, "warm": warm, "end": end, "fds": fds, "code": code}


def warm_start(task: dict, out: Path) -> Path:
    """300 SFT steps on the worked answers (as `make demo` starts GRPO from): the model both
    runs start from, so that their held-out accuracy says something."""
    sft = [
        f"model.path={task['model']}",
        f"data.train_files=[{task['train']}]",
        f"data.val_files=[{task['test']}]",
        "trainer.total_steps=300",
        "trainer.backend=local",
        "rollout.engine=hf",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
    ]
    cmd = [sys.executable, "-m", "treadle", "sft", "examples/arithmetic/sft.yaml", *sft]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return out / "final_model"


def steps_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last_accuracy(rows: list[dict]) -> float:
    accs = [r["eval/val/accuracy"] for r in rows if "eval/val/accuracy" in r]
    return 100 * accs[-1] if accs else float("nan")


def main() -> None:
    ensure_project_python()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--replica-every", type=float, default=5)
    p.add_argument("--reward-every", type=float, default=7)
    args = p.parse_args()
    from treadle.tasks.arithmetic import prepare

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        task = prepare(work / "tiny", n_train=2000, n_test=200)
        task = {**task, "model": warm_start(task, work / "sft")}
        run = soak(task, work / "soak", args)
        rows = steps_of(work / "soak")
        steps = max(r["step"] for r in rows)
        calm = work / "calm"
        subprocess.run(
            [sys.executable, "-m", "treadle", "train", CONFIG, *overrides(task, calm, steps)],
            check=True, capture_output=True, cwd=ROOT,
        )  # fmt: skip
        calm_rows = steps_of(calm)
        log = (work / "soak.log").read_text()
    lost = sum(BATCH * N - int(r["rollout/samples"]) for r in rows)
    grown = [
        100 * (run["end"][pid] - mib) / mib for pid, mib in run["warm"].items() if pid in run["end"]
    ]
    restarts = sum(r.get("rollout/replica_restarts", 0) for r in rows)
    workers = max((r.get("reward/worker_restarts", 0) for r in rows), default=0)
    dropped = max((r.get("async/dropped_total", 0) for r in rows), default=0)
    accuracy = f"{last_accuracy(rows):.1f}% / {last_accuracy(calm_rows):.1f}%"
    table = [
        ("minutes, exit code", f"{args.minutes:g}, {run['code']}"),
        ("steps done", str(steps)),
        (
            "replicas / reward workers killed",
            f"{run['kills']['replica']} / {run['kills']['reward']}",
        ),
        ("replica / reward-worker restarts counted", f"{restarts:g} / {workers:g}"),
        ("samples lost (short batches)", str(lost)),
        ("async/dropped (all)", f"{dropped:g}"),
        ("RSS growth, warm-up to end, worst process", f"{max(grown, default=0):+.1f}%"),
        ("driver open fds at the end", str(run["fds"])),
        ("held-out accuracy, soak / undisturbed", accuracy),
        ("lines of the log about restarts", str(len(re.findall(r"restart", log)))),
    ]
    print("\n| measure | value |\n| --- | --- |")
    for name, value in table:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
