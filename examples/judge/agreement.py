"""How well an LLM judge's rewards agree with the rule, from a run's samples.jsonl.

For every step: the rule's accuracy on the trained samples (``chat_arithmetic``'s
``compute_score``, which did not train), the mean reward (the judge's, when it was the only
reward) on the right and on the wrong ones, and the AUC: the chance that a right sample got a
higher reward than a wrong one (0.5: the judge tells them apart no better than a coin).

    python examples/judge/agreement.py --run runs/judge/grpo
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from treadle.tasks.chat_arithmetic import compute_score


def auc(right: list[float], wrong: list[float]) -> float:
    """P(a right sample's reward > a wrong one's), ties counting half."""
    if not right or not wrong:
        return float("nan")
    wins = sum((r > w) + 0.5 * (r == w) for r in right for w in wrong)
    return wins / (len(right) * len(wrong))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="the run's output directory")
    args = parser.parse_args()
    rows = [json.loads(line) for line in (args.run / "samples.jsonl").read_text().splitlines()]
    steps = sorted({row["step"] for row in rows})
    print("| step | samples | rule accuracy | reward, right | reward, wrong | AUC |")
    print("| --- | --- | --- | --- | --- | --- |")
    everything: tuple[list[float], list[float]] = ([], [])
    for step in [*steps, None]:
        if step is None:
            right, wrong = everything
        else:
            right, wrong = [], []
            for row in rows:
                if row["step"] == step:
                    ok = compute_score(row["prompt"], row["response"], row["ground_truth"])
                    (right if ok >= 1.0 else wrong).append(row["reward"])
            everything[0].extend(right)
            everything[1].extend(wrong)
        n = len(right) + len(wrong)
        mean_right = sum(right) / len(right) if right else float("nan")
        mean_wrong = sum(wrong) / len(wrong) if wrong else float("nan")
        print(
            f"| {'all' if step is None else step} | {n} | {len(right) / n:.1%} | "
            f"{mean_right:.4f} | {mean_wrong:.4f} | {auc(right, wrong):.3f} |"
        )


if __name__ == "__main__":
    main()
