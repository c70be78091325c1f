"""Two-step RL runs of the tiny task through `treadle train`, for the end-to-end tests of agent
loops, black-box agents and environments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treadle.cli import main
from treadle.tracking.tracker import read_metrics

# A reward function file that kills its worker process the first time it is called in a run (a
# marker file beside it says it did), and scores like the built-in afterwards.
DIES_ONCE = """import os, pathlib, signal
from treadle.tasks.arithmetic import compute_score

def score(prompt, response, ground_truth):
    marker = pathlib.Path(__file__).with_name("died")
    if not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return compute_score(prompt, response, ground_truth)
"""


def overrides(
    task: dict[str, Path], out: Path, *extra: str, prompts: int = 2, samples: int = 2
) -> list[str]:
    """A run of ``prompts`` x ``samples`` (2 x 2 unless given) of ``task`` into ``out``, the
    whole batch one mini- and one micro-batch; ``extra`` comes last (a key given again there
    wins)."""
    return [
        f"model.path={task['model']}",
        f"data.train_files=[{task['train']}]",
        f"data.batch_size={prompts}",
        f"rollout.n={samples}",
        f"actor.ppo_mini_batch_size={prompts * samples}",
        f"actor.micro_batch_size={prompts * samples}",
        "algorithm.kl_coef=0",
        "reward.function=arithmetic",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        *extra,
    ]


def train(out: Path, args: list[str]) -> tuple[int, list[dict[str, Any]]]:
    """``treadle train`` on an empty config file with ``args``; its exit code and the metrics
    it wrote to ``out`` (none if it wrote none)."""
    empty = out.parent / f"{out.name}.yaml"
    empty.write_text("")
    code = main(["train", str(empty), *args])
    metrics = read_metrics(out) if (out / "metrics.jsonl").is_file() else []
    return code, metrics
