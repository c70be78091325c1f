"""The console of a run whose output is not a terminal (a pipe, nohup, ``ray job submit``):
a few start-up lines, one plain line per step, the final model and the report command, and
nothing else; samples go to samples.jsonl."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from treadle.config import load_config
from treadle.tracking.sinks import ConsoleLogger
from treadle.tracking.tracker import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_a_plain_console_prints_one_line_per_step_with_eta():
    out = io.StringIO()  # not a terminal
    console = ConsoleLogger(total=10, start=4, headline="sft/loss", stream=out)
    console.begin(10, 4)
    console.log(5, {"sft/loss": 1.23456, "timing/step": 2.0})
    console.log(6, {"sft/loss": 1.1, "eval/val/accuracy": 0.25})
    console.close()
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"step 5/10  sft/loss 1\.235  \d+\.\d s  eta \dm\d\ds", lines[0])
    assert re.fullmatch(
        r"step 6/10  sft/loss 1\.100  eval/val/accuracy 0\.250  \d+\.\d s  eta \dm\d\ds", lines[1]
    )
    assert len(lines) == 2


@pytest.mark.slow
def test_a_piped_rl_run_prints_a_line_per_step_and_logs_samples(tiny_task, length_reward, tmp_path):
    """The run is examples/plugins' (the README's custom advantage estimator, named in its
    config): its process also shows that a plug-in trains from the command line."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "treadle",
            "train",
            "examples/plugins/grpo.yaml",
            f"model.path={tiny_task['model']}",
            f"data.train_files=[{tiny_task['train']}]",
            f"data.val_files=[{tiny_task['test']}]",
            "data.val_size=4",
            "data.batch_size=4",
            "rollout.n=2",
            "rollout.engine=hf",
            "rollout.max_new_tokens=8",
            f"reward.function={length_reward}",
            "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size=8",
            "trainer.backend=local",
            "trainer.total_steps=3",
            "trainer.eval_every=2",
            "trainer.log_samples_every=2",
            "trainer.log_samples=3",
            f"trainer.output_dir={run}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", proc.stdout)  # no colour codes, no \r
    lines = proc.stdout.splitlines()
    headline = "treadle: RL (my_baseline advantages, ppo loss, rollout hf colocated, "
    assert lines[0].startswith(headline)
    assert lines[0].endswith("3 steps, in this process (trainer.backend=local)")
    assert lines[1] == f"  writes to {run}: config.yaml, logs/, metrics.jsonl"
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/3", "2/3", "3/3"]
    assert "eval/val/accuracy" in steps[1] and "eval/val/accuracy" not in steps[0]
    assert lines[-3:] == [
        f"final model: {run / 'final_model'}",
        f"report: treadle report {run}",
        f"held-out accuracy: {100 * read_metrics(run)[-1]['eval/val/accuracy']:.1f}%",
    ]
    assert len(lines) == 2 + 3 + 3  # nothing else
    assert proc.stderr == ""
    cfg = load_config(run / "config.yaml")
    assert cfg.algorithm.adv_estimator == "my_baseline"
    assert cfg.algorithm.plugins == [str(ROOT / "examples" / "plugins" / "my_estimator.py")]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 2, 2, 3, 3, 3]
    for s in samples:
        assert set(s) == {"step", "prompt", "response", "reward", "ground_truth"}
        assert s["reward"] == pytest.approx((len(s["response"]) % 7) / 6)  # the reward fn's
        assert s["prompt"] and s["ground_truth"]


def test_library_messages_go_to_the_run_logs_and_come_back_after(tmp_path, capfd):
    import logging
    import warnings

    from treadle.tracking.tracker import LOG_DIR_ENV, quiet_start, route_logs, worker_env

    # An earlier test's in-process vLLM (tests/engines/) can leave the "vllm" logger at ERROR;
    # what is routed here is the level a fresh process has.
    levels = {name: logging.getLogger(name).level for name in ("vllm", "ray")}
    for name in levels:
        logging.getLogger(name).setLevel(logging.NOTSET)
    restore = route_logs(tmp_path, verbose=False)
    try:
        logging.getLogger("vllm.engine").warning("vllm says hello")
        logging.getLogger("ray._private.worker").warning("ray says hello")
        warnings.warn("torch says hello", UserWarning, stacklevel=1)
        with quiet_start():  # C-level writes too, while the workers start
            os.write(2, b"a C++ warning\n")
            print("a progress bar", flush=True)
        assert worker_env()[LOG_DIR_ENV] == str((tmp_path / "logs").resolve())
    finally:
        restore()
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""
    text = (tmp_path / "logs" / "driver.log").read_text()
    for message in ("vllm says hello", "ray says hello", "torch says hello", "a C++ warning"):
        assert message in text
    assert "a progress bar" in text
    assert worker_env() == {LOG_DIR_ENV: ""}  # a verbose run's workers write to Ray's logs
    logging.getLogger("vllm.engine").warning("after the run")
    assert "after the run" not in (tmp_path / "logs" / "driver.log").read_text()


def test_a_ray_worker_writes_its_output_to_the_run_logs(tmp_path):
    code = (
        "import os, sys; from treadle.tracking.tracker import redirect_output; "
        "redirect_output('reward model'); print('from python'); sys.stdout.flush(); "
        "os.write(2, b'from C\\n')"
    )
    env = {**os.environ, "TREADLE_LOG_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == proc.stderr == ""
    (log,) = tmp_path.glob("reward_model-*.log")
    assert log.read_text() == "from python\nfrom C\n"


def test_a_terminal_shows_a_progress_bar_with_eta_and_the_key_metrics():
    out = io.StringIO()
    console = ConsoleLogger(total=4, start=0, headline="reward/mean", bar=True, stream=out)
    console.begin(4, 0)
    console.log(1, {"reward/mean": 0.5})
    console.log(2, {"reward/mean": 0.75, "eval/val/accuracy": 0.125})
    console.close()
    last = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue()).splitlines()[-1]
    assert re.search(r"treadle .* 2/4 reward/mean 0\.750  eval/val/accuracy 0\.125 .* eta ", last)
    assert "step 1/4" not in out.getvalue()  # no plain lines besides the bar
