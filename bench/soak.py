"""A long run with faults along the way: async GRPO on the tiny model, replicas and reward
workers killed while it trains.

    OMP_NUM_THREADS=1 python bench/soak.py [--minutes 30] [--replica-every 5] [--reward-every 7]

The run: `treadle train` of async GRPO (`trainer.mode=async`, `async.max_staleness=1`) on the
tiny arithmetic task of `treadle prepare` (made in a temporary folder), two split vLLM rollout
replicas, `reward.num_workers=2`, a checkpoint every 10 steps. While it runs, a rollout replica
is killed with SIGKILL every `--replica-every` minutes and a reward worker every
`--reward-every` minutes (the processes are found by their command lines: Ray's
`ray::RolloutReplica`, treadle's reward worker, among the driver's descendants), the minutes
counted from the run's first step (its start-up is slower on a loaded machine); after
`--minutes` of steps the run is stopped with
SIGTERM (as Ctrl-C), and an undisturbed run of the same number of steps is made for comparison.

It prints: the steps done, the replica and reward-worker restarts the run counted
(`rollout/replica_restarts`, `reward/worker_restarts`), the samples lost (steps whose batch was
short of `data.batch_size x rollout.n`, summed; must be 0), `async/dropped`, the worst growth
of a process's peak resident memory, from the second quarter of the run to its last (at most
10%; the run's own processes and Ray's daemons apart; the killed ones are not compared, nor
a process in its first 90 s, its start-up), the
open file descriptors of the driver, and the greedy held-out accuracy (200 problems) of both
runs' last evaluations. Both runs start from a
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
MAX_VALUE = 39  # operands 0..39: the tiny model learns them in a short warm start
WARM_STEPS = 300
LOOKS = 20  # at the run's memory, evenly spread
SETTLED_S = 90  # a process's memory is looked at from this age on (its start-up is over)
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
        "actor.lr=3e-5",  # (5e-4 undid the warm start within 10 steps: 70% -> 7%)
        "trainer.mode=async",
        "trainer.backend=ray",
        f"trainer.total_steps={steps}",
        "trainer.save_every=10",
        "trainer.eval_every=10",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
    ]


def processes(driver: int) -> dict[str, list]:
    """The run's replicas and reward workers (psutil processes), by what they are: the
    driver's descendants (Ray's workers are children of the raylet it started), so another
    run's on the same machine are never counted or killed."""
    import psutil

    found: dict[str, list] = {"replica": [], "reward": [], "other": []}
    for p in [*psutil.Process(driver).children(recursive=True), psutil.Process(driver)]:
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:
            continue
        kind = "replica" if "RolloutReplica" in line else "reward" if "_serve_fd" in line else ""
        found[kind or "other"].append(p)
    return found


def oldest(procs: list):  # type: ignore[no-untyped-def]
    """The process of ``procs`` started first: for reward workers, one of training's (started
    at the first step; the evaluation's start at the first evaluation), whose death the next
    step sees. Not the lowest pid: pids wrap around on a machine that starts many processes
    (the test suite: a soak once killed the evaluation's workers, whose restarts come later)."""
    import psutil

    def started(p) -> float:  # type: ignore[no-untyped-def]
        try:
            return float(p.create_time())
        except psutil.Error:  # gone since it was listed: last
            return float("inf")

    return min(procs, key=started)


def label(p, driver: int) -> str:  # type: ignore[no-untyped-def]
    """What a process is, in a word: the driver, a Ray actor (``ray::Class``), a reward
    worker, or the program (Ray's own daemons: ``gcs_server``, ``raylet``, ...)."""
    if p.pid == driver:
        return "driver"
    line = p.cmdline()
    if line and line[0].startswith("ray::"):
        return line[0].split()[0].split(".")[0]  # (Ray puts the running method after a dot)
    if "_serve_fd" in " ".join(line):
        return "reward worker"
    names = [Path(a).name for a in line[:3] if not a.startswith("-")]
    return " ".join(n for n in names if n not in ("python", "python3")) or p.name()


def ours(name: str) -> bool:
    """Whether a process (by its ``label``) is the run's own, not one of Ray's daemons."""
    daemons = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::JobSupervisor")
    return name in ("driver", "reward worker") or (name.startswith("ray::") and name not in daemons)


def rss(procs: dict[str, list], driver: int) -> dict[int, tuple[str, float]]:
    """Each process's label and resident memory (MiB), by pid: those past their start-up
    (:data:`SETTLED_S` old), so that a replica restarted shortly before the early window is
    not compared from its half-loaded self (it once made a +164% "growth")."""
    out = {}
    for group in procs.values():
        for p in group:
            try:
                if time.time() - p.create_time() >= SETTLED_S:
                    out[p.pid] = (label(p, driver), p.memory_info().rss / 2**20)
            except Exception:
                continue
    return out


def growth(timeline: list[list], minutes: float) -> dict[str, float]:
    """Per process alive in both windows, its peak resident memory in the last quarter of the
    run against its peak from a quarter to half-way in, in percent (peaks: a training process
    swings by its update's working memory within a step)."""
    early: dict[str, float] = {}
    late: dict[str, float] = {}
    for at, mib in timeline:
        window = (
            early if minutes / 4 <= at <= minutes / 2 else late if at >= 3 * minutes / 4 else {}
        )
        for name, value in mib.items():
            window[name] = max(window.get(name, 0.0), value)
    return {k: 100 * (late[k] - early[k]) / early[k] for k in early if k in late}


def first_step(driver: subprocess.Popen, out: Path, limit: float = 600) -> None:
    """Wait until the run has logged its first step (or ended: the caller reports it)."""
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + limit
    while driver.poll() is None and time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().strip():
            return
        time.sleep(0.5)


def soak(task: dict, out: Path, args: argparse.Namespace) -> dict:
    """The disturbed run; what it did."""
    cmd = [sys.executable, "-m", "treadle", "train", CONFIG, *overrides(task, out, 100_000)]
    log = (out.parent / "soak.log").open("w")
    driver = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=ROOT)
    first_step(driver, out)  # the clock starts with the steps: start-up is slower under load
    start, kills = time.monotonic(), {"replica": 0, "reward": 0}
    timeline: list[list] = []  # [minutes, {"name pid": MiB}], every process of the run
    while time.monotonic() - start < args.minutes * 60 and driver.poll() is None:
        time.sleep(2)  # (a benchmark: the run's own events are what it reports)
        minutes = (time.monotonic() - start) / 60
        procs = processes(driver.pid)
        if minutes >= len(timeline) * args.minutes / LOOKS:  # looks at the run's memory
            now = rss(procs, driver.pid)
            timeline.append([round(minutes, 2), {f"{n} {p}": m for p, (n, m) in now.items()}])
        for kind, every in (("replica", args.replica_every), ("reward", args.reward_every)):
            due = every * (kills[kind] + 1)  # (none in the last half minute: its restart
            if procs[kind] and minutes >= due and due <= args.minutes - 0.5:  # is counted)
                os.kill(oldest(procs[kind]).pid, signal.SIGKILL)
                kills[kind] += 1
    if driver.poll() is not None:  # it ended by itself: why
        tail = (out.parent / "soak.log").read_text().splitlines()[-60:]
        raise SystemExit(f"the run ended early (exit {driver.returncode}):\n" + "\n".join(tail))
    fds = len(os.listdir(f"/proc/{driver.pid}/fd")) if driver.poll() is None else -1
    driver.send_signal(signal.SIGTERM)
    code = driver.wait(timeout=300)
    return {"kills": kills, "timeline": timeline, "fds": fds, "code": code}


def warm_start(task: dict, out: Path, steps: int) -> Path:
    """``steps`` SFT steps on the worked answers (as `make demo` starts GRPO from): the model both
    runs start from, so that their held-out accuracy says something."""
    sft = [
        f"model.path={task['model']}",
        f"data.train_files=[{task['train']}]",
        f"data.val_files=[{task['test']}]",
        f"trainer.total_steps={steps}",
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


def measure(args: argparse.Namespace) -> dict:
    """The soak and, unless ``args.no_compare``, the undisturbed run: what they did."""
    from treadle.tasks.arithmetic import prepare

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        task = prepare(work / "tiny", n_train=2000, n_test=200, max_value=MAX_VALUE)
        if args.warm_model:
            task = {**task, "model": args.warm_model}
        elif args.warm_steps:
            task = {**task, "model": warm_start(task, work / "sft", args.warm_steps)}
        run = soak(task, work / "soak", args)
        rows = steps_of(work / "soak")
        steps = max(r["step"] for r in rows)
        calm_rows: list[dict] = []
        if not args.no_compare:
            calm = work / "calm"
            subprocess.run(
                [sys.executable, "-m", "treadle", "train", CONFIG, *overrides(task, calm, steps)],
                check=True, capture_output=True, cwd=ROOT,
            )  # fmt: skip
            calm_rows = steps_of(calm)
        log = (work / "soak.log").read_text()
    grown = growth(run["timeline"], args.minutes)
    worst = max((k for k in grown if ours(k.rsplit(" ", 1)[0])), key=grown.get, default="")
    worst_ray = max((k for k in grown if not ours(k.rsplit(" ", 1)[0])), key=grown.get, default="")
    return {
        "minutes": args.minutes,
        "exit_code": run["code"],
        "steps": steps,
        "kills": run["kills"],
        "replica_restarts": sum(r.get("rollout/replica_restarts", 0) for r in rows),
        "reward_restarts": max((r.get("reward/worker_restarts", 0) for r in rows), default=0),
        "lost": sum(BATCH * N - int(r["rollout/samples"]) for r in rows),
        "dropped": max((r.get("async/dropped_total", 0) for r in rows), default=0),
        "rss_growth_pct": grown.get(worst, 0.0),  # the run's own processes, the worst
        "rss_growth_worst": worst,
        "rss_growth_ray_pct": grown.get(worst_ray, 0.0),  # Ray's daemons, the worst
        "rss_growth_ray_worst": worst_ray,
        "rss_mib": run["timeline"],
        "fds": run["fds"],
        "accuracy": last_accuracy(rows),
        "accuracy_undisturbed": last_accuracy(calm_rows),
        "restart_lines": len(re.findall(r"restart", log)),
    }


def main() -> None:
    ensure_project_python()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--replica-every", type=float, default=5)
    p.add_argument("--reward-every", type=float, default=7)
    p.add_argument("--warm-steps", type=int, default=WARM_STEPS, help="SFT steps first (0: none)")
    p.add_argument(
        "--warm-model", type=Path, help="the warm start of an earlier run (its SFT model folder)"
    )
    p.add_argument("--no-compare", action="store_true", help="no undisturbed run")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    m = measure(args)
    if args.json:
        args.json.write_text(json.dumps(m, indent=1))
    table = [
        ("minutes, exit code", f"{m['minutes']:g}, {m['exit_code']}"),
        ("steps done", str(m["steps"])),
        ("replicas / reward workers killed", f"{m['kills']['replica']} / {m['kills']['reward']}"),
        (
            "replica / reward-worker restarts counted",
            f"{m['replica_restarts']:g} / {m['reward_restarts']:g}",
        ),
        ("samples lost (short batches)", str(m["lost"])),
        ("async/dropped (all)", f"{m['dropped']:g}"),
        (
            "peak RSS growth, 2nd to 4th quarter, worst of the run's processes",
            f"{m['rss_growth_pct']:+.1f}% ({m['rss_growth_worst']})",
        ),
        (
            "peak RSS growth, 2nd to 4th quarter, worst of Ray's daemons",
            f"{m['rss_growth_ray_pct']:+.1f}% ({m['rss_growth_ray_worst']})",
        ),
        ("driver open fds at the end", str(m["fds"])),
        (
            "held-out accuracy, soak / undisturbed",
            f"{m['accuracy']:.1f}% / {m['accuracy_undisturbed']:.1f}%",
        ),
        ("lines of the log about restarts", str(m["restart_lines"])),
    ]
    print("\n| measure | value |\n| --- | --- |")
    for name, value in table:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
