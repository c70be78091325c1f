"""GRPO from Python: a config as a dict, a reward as a function, data as a datasets.Dataset.

    python examples/python_api.py                      # prepares data/arithmetic if needed
    python examples/python_api.py --steps 20 --backend ray

It trains the built-in arithmetic task's tiny model (``treadle prepare`` writes it) for a few
steps in this process (``trainer.backend=local``), scoring with the function below, and
prints the last step's metrics and where the model went. ``tests/test_api.py`` runs it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from datasets import Dataset

import treadle
from treadle.tasks.arithmetic import extract_answer, prepare


def exact_answer(prompt: str, response: str, ground_truth: str) -> float:
    """1 when the response's number is the answer: a per-sample reward function.

    TRL's batched form works too: ``def reward(completions, answer, **kwargs) -> list[float]``
    gets the responses and the dataset's ``answer`` column as lists.
    """
    return 1.0 if extract_answer(response) == ground_truth.strip() else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default="data/arithmetic", help="a `treadle prepare` folder")
    p.add_argument("--output-dir", default="runs/python_api")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--backend", choices=["local", "ray"], default="local")
    args = p.parse_args()

    data = Path(args.data_dir)
    if not (data / "prepare.json").is_file():
        prepare(data)
    with (data / "train.jsonl").open() as f:  # any rows with a prompt and an answer column
        train_rows = [json.loads(line) for line in f][:512]

    result = treadle.train(
        {
            "model": {"path": str(data / "model_init")},
            "data": {"batch_size": 8, "max_prompt_length": 64, "val_size": 32},
            "rollout": {"engine": "hf", "n": 4, "max_new_tokens": 12},
            "actor": {"lr": 1e-3, "ppo_mini_batch_size": 32, "micro_batch_size": 32},
            "trainer": {
                "backend": args.backend,
                "output_dir": args.output_dir,
                "total_steps": args.steps,
                "progress": False,
            },
        },
        reward=exact_answer,
        train_dataset=Dataset.from_list(train_rows),
        eval_dataset=data / "test.jsonl",  # a file works as well as a Dataset
        overrides=["reward.num_workers=1"],  # `section.key=value`, as on the command line
    )
    m = result.metrics
    print(f"steps: {args.steps}, reward/mean: {m['reward/mean']:.3f}, ", end="")
    print(f"held-out accuracy: {100 * m['eval/val/accuracy']:.1f}%")
    print(f"final model: {result.final_model}")


if __name__ == "__main__":
    main()
