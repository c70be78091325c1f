"""The command line: one-line errors for bad config, SFT end to end in local mode."""

from __future__ import annotations

import subprocess
import sys

import pytest

from treadle.cli import main
from treadle.tracking.tracker import read_metrics


@pytest.mark.slow
def test_misspelt_key_exits_nonzero_with_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "treadle",
            "train",
            "examples/arithmetic/grpo.yaml",
            "trainer.totl_steps=2",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "trainer.totl_steps" in lines[0]
    assert "did you mean 'trainer.total_steps'" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing started


def test_missing_model_folder_is_named(tmp_path, capsys):
    code = main(
        [
            "eval",
            "examples/arithmetic/grpo.yaml",
            f"model.path={tmp_path / 'nope'}",
            "trainer.backend=local",
        ]
    )
    assert code == 2
    assert "model.path" in capsys.readouterr().err


@pytest.mark.slow
def test_sft_local_lowers_loss_and_exports(tiny_task, tmp_path, capsys):
    out = tmp_path / "sft"
    code = main(
        [
            "sft",
            "examples/arithmetic/sft.yaml",
            f"model.path={tiny_task['model']}",
            f"data.train_files=[{tiny_task['train']}]",
            f"data.val_files=[{tiny_task['test']}]",
            "data.batch_size=16",
            "data.val_size=8",
            "actor.lr=1e-2",
            "actor.warmup_steps=0",
            "actor.micro_batch_size=8",
            "trainer.backend=local",
            "rollout.engine=hf",  # the session's one in-process vLLM engine serves another model
            "trainer.total_steps=12",
            "trainer.progress=false",
            f"trainer.output_dir={out}",
        ]
    )
    assert code == 0
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert metrics[-1]["sft/loss"] < 0.7 * metrics[0]["sft/loss"]
    assert all(m["perf/tflops/sft"] > 0 for m in metrics)  # the update's model FLOP rate
    assert (out / "final_model" / "model.safetensors").is_file()
    assert (out / "checkpoints" / "step_12" / "optimizer.safetensors").is_file()
    assert "held-out accuracy:" in capsys.readouterr().out


def test_overrides_may_follow_the_options(capsys):
    """``treadle eval MODEL_DIR --config C eval.n=8``: overrides after an option are overrides,
    in order; anything else left over is still refused by name."""
    from treadle.cli import parse

    args = parse(["eval", "model", "a.b=1", "--config", "c.yaml", "eval.n=8", "eval.top_p=0.9"])
    assert (args.config, args.overrides) == ("c.yaml", ["a.b=1", "eval.n=8", "eval.top_p=0.9"])
    for extra in ("--nope", "stray"):
        with pytest.raises(SystemExit) as exit_:
            parse(["eval", "model", "--config", "c.yaml", extra])
        assert exit_.value.code == 2
        assert f"unrecognized arguments: {extra}" in capsys.readouterr().err
