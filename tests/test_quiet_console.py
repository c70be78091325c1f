"""A quiet console for every command (treadle.cli.console): treadle's own lines only, the
libraries' (vLLM, Ray, transformers, datasets, torch) in the run's logs/ or, for `eval` and
`serve` without a run directory, in a log file that the first line names; `--verbose` (and
`trainer.verbose`) shows them; a library's error is one line and where its traceback is; a long
phase shows a spinner on a terminal, plain lines when piped.

`treadle serve`'s lines are counted in tests/test_serve.py, which runs it already.
"""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treadle.cli import main
from treadle.cli.console import progress

ROOT = Path(__file__).resolve().parent.parent

# treadle's own lines, whatever the command prints of them
OWN = re.compile(
    "|".join(
        [
            r"treadle: .+",  # the start-up line, one-line errors, the stop line
            r"  writes to .+",
            r"step \d+/\d+  .+",
            r"final model: .+",
            r"profile of step \d+: .+",
            r"report: treadle report .+",
            r"held-out (pair )?accuracy: \d+\.\d%",
            r"started vLLM engine for .+ in \d+\.\d s",
            r"checking for `treadle \w+`: .+",
            r"(model|teacher|reward\.function|data\.\w+|trainer\.output_dir): .+",
            r"ok: ready for `treadle \w+`",
        ]
    )
)

# Several commands in one process, as `python -m treadle` runs each (piped, its own logging
# set up by treadle.cli.main): one import of torch for all of them. Each command's output
# follows a "=== <command>" line on stdout and on stderr.
_COMMANDS = """
import json, sys
from treadle.cli import main
for argv in json.loads(sys.argv[1]):
    for stream in (sys.stdout, sys.stderr):
        print("=== " + argv[0], file=stream, flush=True)
    print(f"(exit {main(argv)})", flush=True)
"""


def _by_command(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for part in text.split("=== ")[1:]:
        name, *lines = part.splitlines()
        out[name] = [line for line in lines if not line.startswith("(exit ")]
    return out


def _run_commands(commands: list[list[str]], logs: Path) -> tuple[dict, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _COMMANDS, json.dumps(commands)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TREADLE_LOGS": str(logs)},
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("(exit 0)") == len(commands), proc.stdout + proc.stderr[-3000:]
    return _by_command(proc.stdout), _by_command(proc.stderr), proc.stdout + proc.stderr


def _not_own(lines: list[str]) -> list[str]:
    return [line for line in lines if not OWN.fullmatch(line)]


@pytest.mark.slow
def test_commands_print_treadle_lines_only(tiny_task, teacher_model, tmp_path):
    """sft, dpo, distill (the transformers engine, the local backend), check, and eval with
    vLLM, whose start-up and generation say ~30 lines of INFO and WARNING: not one line that
    is not treadle's own, piped; vLLM's lines in eval's log file, which its first line names."""
    t = {k: str(v) for k, v in tiny_task.items()}
    small = ["data.val_size=2", "data.batch_size=2", "trainer.total_steps=1"]
    small += ["actor.micro_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.warmup_steps=0"]
    small += ["rollout.engine=hf", "rollout.max_new_tokens=8", "trainer.backend=local"]
    model = [f"model.path={t['model']}", f"data.val_files=[{t['test']}]", *small]
    distill = ["distill", "examples/distill/on_policy.yaml", *model, "rollout.n=2"]
    distill += [f"teacher.model_path={teacher_model}", f"data.train_files=[{t['train']}]"]
    pairs = [f"data.train_files=[{t['pairs_train']}]", f"data.val_files=[{t['pairs_test']}]"]
    sft_data = [f"data.train_files=[{t['train']}]"]
    commands = [
        # its step profiled: kineto's lines (on stderr) go to the log
        ["sft", "examples/arithmetic/sft.yaml", *model, *sft_data, "trainer.profile_steps=[1]"],
        ["dpo", "examples/arithmetic/dpo.yaml", *model, *pairs, "rollout.max_new_tokens=48"],
        [*distill, f"trainer.output_dir={tmp_path / 'distill'}"],
        ["check", *distill[1:], f"trainer.output_dir={tmp_path / 'check'}"],
        ["eval", "examples/arithmetic/grpo.yaml", *model, "rollout.engine=vllm"],
    ]
    for argv in commands[:3]:
        argv.append(f"trainer.output_dir={tmp_path / argv[0]}")
    out, err, everything = _run_commands(commands, tmp_path / "logs")
    for name in out:
        assert _not_own(out[name]) == [], everything[-5000:]
        assert _not_own(err[name]) == [], everything[-5000:]
    assert out["sft"][-1].startswith("held-out accuracy: ")
    assert f"profile of step 1: {tmp_path / 'sft/profile/step_1'}" in out["sft"]
    assert "treadle/update_actor" in (tmp_path / "sft/profile/step_1/driver.txt").read_text()
    assert out["dpo"][-2].startswith("held-out pair accuracy: ")
    assert out["distill"][0].startswith("treadle: distillation (reverse_kl) from ")
    assert (
        out["check"][0]
        == f"checking for `treadle distill`: it sets teacher.model_path={teacher_model}"
    )
    assert out["check"][-1] == "ok: ready for `treadle distill`"
    (log,) = (tmp_path / "logs").glob("eval-*/driver.log")
    assert out["eval"] == [
        f"treadle: eval of {t['model']} on val (vllm); library messages: {log}",
        out["eval"][1],
    ]
    assert out["eval"][1].startswith("held-out accuracy: ")
    text = log.read_text()
    for said in ("vllm.v1.engine.core INFO", "Passing raw prompts to InputProcessor"):
        assert said in text  # vLLM's own lines: in the log, not on the console
    for name in ("sft", "dpo", "distill"):  # the training commands' in their run's logs/
        assert (tmp_path / name / "logs" / "driver.log").is_file()


@pytest.fixture
def eval_config(tiny_task, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """`treadle eval CONFIG` whose evaluation is replaced: what the console shows around it."""
    monkeypatch.setenv("TREADLE_LOGS", str(tmp_path / "logs"))
    return [
        "eval",
        "examples/arithmetic/grpo.yaml",
        f"model.path={tiny_task['model']}",
        f"data.val_files=[{tiny_task['test']}]",
        "trainer.backend=local",
    ]


def test_a_library_error_is_one_line_and_where_its_traceback_is(
    eval_config, tmp_path, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    from treadle.trainers import evaluation

    def fails(cfg):  # type: ignore[no-untyped-def]
        raise RuntimeError("EngineCore died unexpectedly\n(its worker's last words)")

    monkeypatch.setattr(evaluation, "evaluate_model", fails)
    code = main(eval_config)
    out, err = capsys.readouterr()
    (log,) = (tmp_path / "logs").glob("eval-*/driver.log")
    assert code == 1
    assert out.splitlines()[0].endswith(f"; library messages: {log}")
    assert err.splitlines() == [
        "treadle: error: RuntimeError: EngineCore died unexpectedly",
        f"treadle: error: its traceback and the libraries' messages: {log}",
    ]
    text = log.read_text()
    assert "treadle eval failed:\nTraceback" in text and "(its worker's last words)" in text
    with pytest.raises(RuntimeError, match="EngineCore died"):  # --verbose: Python's own
        main([*eval_config, "--verbose"])


def test_an_error_a_stop_caused_is_the_stop(eval_config, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """A library's error on the way out of a stop (a worker gone under it) is not a failure:
    the command says it stopped, with the stop's exit code."""
    import signal

    from treadle.runtime.errors import note_signal
    from treadle.trainers import evaluation

    def stopped(cfg):  # type: ignore[no-untyped-def]
        note_signal(signal.SIGTERM)
        raise RuntimeError("ActorDiedError: the actor died unexpectedly")

    monkeypatch.setattr(evaluation, "evaluate_model", stopped)
    assert main(eval_config) == 143
    assert capsys.readouterr().err == "treadle: stopped by SIGTERM\n"


def test_verbose_and_trainer_verbose_agree(eval_config, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from treadle.trainers import evaluation

    seen = []
    monkeypatch.setattr(evaluation, "evaluate_model", lambda cfg: seen.append(cfg) or {})
    for extra in ("--verbose", "trainer.verbose=true"):
        assert main([*eval_config, extra]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert first.endswith("(vllm); library messages shown (trainer.verbose)"), first
        assert seen.pop().trainer.verbose
    assert main(eval_config) == 0
    assert "; library messages: " in capsys.readouterr().out
    assert not seen.pop().trainer.verbose


def test_rays_prints_of_errors_nobody_read_are_off_unless_verbose(eval_config, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A run stopped by a dead rank names it on its last line; its peers' failed calls, which
    nobody reads, would otherwise be printed by Ray after it as their references are freed (at
    exit): a traceback ending in gloo's "Connection reset by peer" (seen in CI)."""
    from treadle.trainers import evaluation

    monkeypatch.setattr(evaluation, "evaluate_model", lambda cfg: {})
    for extra, off in (["--verbose"], False), ([], True):
        monkeypatch.setenv("RAY_IGNORE_UNHANDLED_ERRORS", "")
        monkeypatch.delenv("RAY_IGNORE_UNHANDLED_ERRORS")  # (put back as it was after the test)
        assert main([*eval_config, *extra]) == 0
        assert ("RAY_IGNORE_UNHANDLED_ERRORS" in os.environ) is off  # Ray reads its presence


def test_a_long_phase_shows_a_spinner_on_a_terminal_and_plain_lines_piped() -> None:
    piped = io.StringIO()
    with progress("starting the vllm engine", piped) as say:
        say("started vLLM engine for m in 3.0 s")
    assert piped.getvalue() == "started vLLM engine for m in 3.0 s\n"
    master, replica = pty.openpty()
    with (
        os.fdopen(replica, "w") as terminal,
        progress("starting the vllm engine", terminal) as say,
    ):
        say("started vLLM engine for m in 3.0 s")
    shown = ""  # (a pty hands on what was written in its own time: read until the last line)
    deadline = time.monotonic() + 30
    while "3.0 s" not in shown and time.monotonic() < deadline:
        if select.select([master], [], [], 1)[0]:
            shown += os.read(master, 1 << 16).decode()
    os.close(master)
    assert "starting the vllm engine" in shown and "0:00:0" in shown  # the spinner, its time
    assert "started vLLM engine for m in 3.0 s" in shown
    assert "\x1b[" in shown  # drawn, then wiped (transient)


def test_what_a_command_kept_before_its_run_goes_to_the_run_logs(tmp_path, capfd) -> None:  # type: ignore[no-untyped-def]
    """A training command checks before it knows its run directory: the libraries' messages
    of the check are kept, then written to the run's driver.log before the run's own; after
    the run, to the same file. Nothing reaches the console."""
    import logging

    from treadle.tracking.tracker import log_file, quiet_console, route_logs

    restore = quiet_console(fallback=tmp_path / "own")
    try:
        logging.getLogger("filelock.check").error("during the check")
        back = route_logs(tmp_path / "run", verbose=False)
        logging.getLogger("urllib3.run").error("during the run")
        back()
        logging.getLogger("httpcore.after").error("after the run")
        assert log_file() == tmp_path / "run" / "logs" / "driver.log"
    finally:
        restore()
    assert capfd.readouterr() == ("", "")
    text = (tmp_path / "run" / "logs" / "driver.log").read_text()
    said = [text.index(s) for s in ("during the check", "during the run", "after the run")]
    assert said == sorted(said)
    assert not (tmp_path / "own").exists()  # (the command's own log: not needed)
