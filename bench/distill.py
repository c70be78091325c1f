"""Distillation against GRPO on the built-in task: held-out accuracy for the same minutes.

    OMP_NUM_THREADS=1 python bench/distill.py [--steps 40] [--rows sft,small]

The teacher is the GRPO-trained model of `make demo` (`runs/arithmetic/grpo/final_model`); the
demo is run first when it is missing. Each row starts every method from the same student:

- `sft`: the demo's SFT warm start (`runs/arithmetic/sft/final_model`), the teacher's own size;
- `small`: `treadle prepare`'s `model_small` (half the width and depth), after the same SFT
  warm start (`examples/arithmetic/sft.yaml`, run here once into `runs/distill/small_sft`).

The methods, each a `treadle` process of `--steps` steps, evaluated greedily on all 500
held-out problems every 2 steps:

- `grpo`: `examples/arithmetic/grpo.yaml` (the demo's RL run), the baseline;
- `on_policy`, `gkd`, `seq_kd`: `examples/distill/{on_policy,gkd,seq_kd}.yaml`.

Minutes are the summed step times (`timing/step`: generation, the teacher's pass, the update
and the weight sync; start-up and the evaluations excluded). The table gives, per run, the
accuracy at the start, the best accuracy reached within the minutes GRPO took for all its
steps (`acc@grpo_min`), the last accuracy, and the minutes until the held-out accuracy first
reached 90% of the teacher's (`min_to_90%`, "-" if never). It ends with
`speed-up on_policy/grpo (<row>): <r>`, GRPO's minutes to 90% of the teacher over on-policy
distillation's (the issue's target: at least 2).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _env import ROOT, ensure_project_python

TEACHER = Path("runs/arithmetic/grpo/final_model")
STARTS = {"sft": Path("runs/arithmetic/sft/final_model"), "small": Path("runs/distill/small_sft")}
METHODS = {
    "grpo": ("train", "examples/arithmetic/grpo.yaml"),
    "on_policy": ("distill", "examples/distill/on_policy.yaml"),
    "gkd": ("distill", "examples/distill/gkd.yaml"),
    "seq_kd": ("distill", "examples/distill/seq_kd.yaml"),
}
EVAL = ["data.val_size=null", "trainer.eval_every=2", "trainer.progress=false"]


def treadle(*args: str) -> str:
    """Run a treadle command; its stdout (it also goes to this terminal)."""
    cmd = [sys.executable, "-m", "treadle", *args]
    print("$ treadle " + " ".join(args), flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    sys.stdout.write(out.stdout)
    return out.stdout


def accuracy(model: Path) -> float:
    """Greedy held-out accuracy of ``model`` on the 500 problems."""
    text = treadle("eval", "examples/distill/on_policy.yaml", f"model.path={model}", EVAL[0])
    return float(re.findall(r"held-out accuracy: ([\d.]+)%", text)[-1])


def curve(run_dir: Path) -> list[tuple[float, float]]:
    """(minutes of steps so far, held-out accuracy) at every evaluated step."""
    points, minutes = [], 0.0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        minutes += row.get("timing/step", 0.0) / 60
        if "eval/val/accuracy" in row:
            points.append((minutes, 100 * row["eval/val/accuracy"]))
    return points


def run(method: str, row: str, steps: int) -> Path:
    kind, config = METHODS[method]
    out = Path(f"runs/distill/{row}/{method}")
    treadle(
        kind,
        config,
        f"model.path={STARTS[row]}",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        f"trainer.save_every={steps}",
        *EVAL,
        *([f"teacher.model_path={TEACHER}"] if kind == "distill" else []),
    )
    return out


def prepare(rows: list[str]) -> None:
    if not TEACHER.is_dir() or not STARTS["sft"].is_dir():
        treadle("demo")
    if "small" in rows and not (STARTS["small"] / "config.json").is_file():
        small = "data/arithmetic/model_small"
        treadle("prepare")  # (builds model_small when missing)
        treadle(
            "sft",
            "examples/arithmetic/sft.yaml",
            f"model.path={small}",
            "trainer.output_dir=runs/distill/small_sft_run",
            "trainer.progress=false",
        )
        Path(STARTS["small"]).parent.mkdir(parents=True, exist_ok=True)
        os.replace("runs/distill/small_sft_run/final_model", STARTS["small"])


def main() -> None:
    ensure_project_python()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rows", default="sft,small")
    args = p.parse_args()
    rows = args.rows.split(",")
    os.chdir(ROOT)
    prepare(rows)
    teacher = accuracy(TEACHER)
    target = 0.9 * teacher
    lines = [f"teacher {TEACHER}: {teacher:.1f}% held-out; 90% of it: {target:.1f}%", ""]
    lines += ["| start | method | start acc | acc@grpo_min | last acc | minutes | min_to_90% |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- |"]
    speedups = []
    for row in rows:
        start = accuracy(STARTS[row])
        curves = {m: curve(run(m, row, args.steps)) for m in METHODS}
        budget = curves["grpo"][-1][0]
        reach = {}
        for method, points in curves.items():
            within = [acc for minutes, acc in points if minutes <= budget + 1e-9]
            reach[method] = next((t for t, acc in points if acc >= target), None)
            lines.append(
                f"| {row} | {method} | {start:.1f}% | {max(within, default=start):.1f}% | "
                f"{points[-1][1]:.1f}% | {points[-1][0]:.2f} | "
                f"{'-' if reach[method] is None else f'{reach[method]:.2f}'} |"
            )
        if reach["grpo"] is not None and reach["on_policy"]:
            speedups.append(
                f"speed-up on_policy/grpo ({row}): {reach['grpo'] / reach['on_policy']:.2f}"
            )
    print("\n".join(["", *lines, "", *speedups]))


if __name__ == "__main__":
    main()
