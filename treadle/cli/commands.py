"""``treadle`` command line: train | distill | sft | dpo | kto | rm | eval | serve | check |
report | prepare | demo | model | sandbox.

Every subcommand that runs a job takes a YAML config and ``section.key=value`` overrides, and
first runs ``treadle.check.run`` for itself (``treadle check CONFIG`` runs only that, for the
command the config is for, :mod:`treadle.check.kind`, or the one ``--kind`` names).
Problems a user can fix (config keys, data rows, reward functions) end the command with one
line per problem on stderr, ``treadle: error: ...``, and exit code 2; nothing already written
is removed.

``treadle eval`` takes a run directory (every sealed checkpoint, or ``--steps``, on the run's
sets or ``--set name=FILE``, into ``RUN_DIR/eval.jsonl``: :mod:`treadle.trainers.run_eval`), a
Hugging Face model folder with ``--config CONFIG``, or a config (its ``model.path``).

``treadle serve CONFIG`` serves ``model.path`` with ``rollout.engine`` over an OpenAI-compatible
API (``rollout.endpoint.*``; :mod:`treadle.serving.endpoint`) in this process, prints one line
``serving <model> at http://HOST:PORT/v1 (api key: ...)`` and serves until Ctrl-C (exit 130)
or SIGTERM (143).

``treadle sandbox grade --solution FILE --tests FILE [--timeout SECONDS]`` prints exactly one
JSON line, ``{"reward", "passed", "total", "status", "seconds"}``, and exits 0 whatever the
solution does (a reason for a status other than ok goes to stderr); only a problem outside the
solution (no bubblewrap, an unreadable file, tests that do not parse) exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treadle.cli.console import own_log, progress, settle
from treadle.runtime import startup
from treadle.runtime.errors import (
    TreadleError,
)
from treadle.runtime.faults import failpoint


def _config(args: argparse.Namespace, first: Callable[[Any], str] | None = None):
    """The config, checked for the command about to run (``treadle.check.run``); ``first``:
    the command's first line, of the config, printed before the check."""
    from treadle.check.run import check
    from treadle.config import load_config
    from treadle.controller.cluster import start_ray_early

    startup.mark("imports")
    cfg = load_config(args.config, args.overrides)
    settle(cfg)
    if first is not None:
        print(first(cfg), flush=True)
    check(cfg, args.command)
    startup.mark("check")
    start_ray_early(cfg)  # while the command imports its trainer and reads its data
    failpoint("launch")
    return cfg


def cmd_check(args: argparse.Namespace) -> None:
    from treadle.check.kind import infer_kind
    from treadle.check.run import check
    from treadle.config import load_config

    cfg = load_config(args.config, args.overrides)
    settle(cfg)
    kind = args.kind
    if kind is None:
        kind, why = infer_kind(cfg)
        print(f"checking for `treadle {kind}`: {why}", flush=True)
    for line in check(cfg, kind):
        print(line)
    print(f"ok: ready for `treadle {kind}`")


def another_command(cfg: Any, command: str) -> str | None:
    """A line for a config that ``treadle check`` takes for another command than ``command``
    (:mod:`treadle.check.kind`), or None. An SFT config has every setting RL needs, so
    `treadle train examples/reasoning_gym/sft.yaml` would otherwise run RL without a word."""
    from treadle.check.kind import infer_kind

    try:
        kind, why = infer_kind(cfg)
    except TreadleError:  # (a config of two commands' settings: check has passed it for this one)
        return None
    if kind == command:
        return None
    return (
        f"treadle: note: this config looks like one for `treadle {kind}` ({why}); "
        f"`treadle {command}` runs it as asked"
    )


def cmd_train(args: argparse.Namespace) -> None:
    cfg = _config(args)
    if note := another_command(cfg, "train"):
        print(note, flush=True)
    from treadle.trainers.rl import train

    print_accuracies(train(cfg))


def cmd_distill(args: argparse.Namespace) -> None:
    cfg = _config(args)
    from treadle.trainers.distill import distill

    print_accuracies(distill(cfg))


def cmd_sft(args: argparse.Namespace) -> None:
    cfg = _config(args)
    from treadle.trainers.sft import sft

    print_accuracies(sft(cfg))


def print_accuracies(metrics: dict[str, float]) -> None:
    """One line per validation set: ``held-out accuracy: 81.0%`` for ``val``, ``held-out
    accuracy (<set>): ...`` for the others (``eval/<set>/accuracy``)."""
    from treadle.tracking.sinks import accuracy_keys

    for key in accuracy_keys(metrics):
        name = key.split("/")[1]
        which = "" if name == "val" else f" ({name})"
        print(f"held-out accuracy{which}: {100 * metrics[key]:.1f}%")


def _print_held_out(metrics: dict[str, float]) -> None:
    if "eval/pair_accuracy" in metrics:
        print(f"held-out pair accuracy: {100 * metrics['eval/pair_accuracy']:.1f}%")
    print_accuracies(metrics)


def cmd_dpo(args: argparse.Namespace) -> None:
    cfg = _config(args)
    from treadle.trainers.dpo import dpo

    _print_held_out(dpo(cfg))


def cmd_kto(args: argparse.Namespace) -> None:
    cfg = _config(args)
    from treadle.trainers.kto import kto

    _print_held_out(kto(cfg))


def cmd_rm(args: argparse.Namespace) -> None:
    cfg = _config(args)
    from treadle.trainers.rm import rm

    _print_held_out(rm(cfg))


def cmd_eval(args: argparse.Namespace) -> None:
    """``treadle eval RUN_DIR | MODEL_DIR --config CONFIG | CONFIG``: what the target is
    decides (:mod:`treadle.trainers.run_eval`)."""
    from treadle.trainers.run_eval import is_run_dir

    target = Path(args.target)
    if not target.exists():
        raise TreadleError(
            f"{target}: no such file or directory (give RUN_DIR, MODEL_DIR or CONFIG)"
        )
    if target.is_dir() and is_run_dir(target):
        _eval_run(args, target)
        return
    if args.steps is not None:
        raise TreadleError(f"--steps picks checkpoints of a run directory; {target} is none")
    if target.is_dir():
        if not (target / "config.json").is_file():
            raise TreadleError(
                f"{target} is neither a run directory (no config.yaml) nor a Hugging Face "
                "model folder (no config.json)"
            )
        if args.config is None:
            raise TreadleError(
                f"{target} is a model folder: give the config of the evaluation (its sets, "
                "reward, sampling) with --config CONFIG"
            )
        args.overrides = [*args.overrides, f"model.path={target}"]
    else:
        if args.config is not None:
            raise TreadleError(f"--config goes with a model folder; {target} is a config itself")
        args.config = str(target)
    if args.sets:
        from treadle.config import load_config
        from treadle.trainers.run_eval import with_sets

        raw = load_config(args.config, args.overrides).model_dump(mode="json", by_alias=True)
        raw["data"] = with_sets(raw["data"], _named_sets(args.sets))
        args.config, args.overrides = raw, []
    cfg = _config(args, _eval_line)
    from treadle.trainers.evaluation import evaluate_model

    with progress(f"evaluating {cfg.model.path}"):
        metrics = evaluate_model(cfg)
    print_accuracies(metrics)
    if cfg.eval.n > 1:  # the sampled metrics too (pass@k, maj@k, ...)
        print(_shown(metrics))


def _eval_line(cfg: Any) -> str:
    """``treadle eval``'s first line: what it evaluates, and where the libraries' messages go."""
    sets = ", ".join(cfg.data.set_names) or "no set"
    return f"treadle: eval of {cfg.model.path} on {sets} ({cfg.rollout.engine}); {own_log(cfg)}"


def _shown(metrics: dict[str, float]) -> str:
    """``metrics`` on one line, without their bootstrap spreads."""
    return "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if not k.endswith("/std"))


def _eval_run(args: argparse.Namespace, run_dir: Path) -> None:
    """``treadle eval RUN_DIR``: the run's checkpoints, one line a step; eval.jsonl."""
    from treadle.check.run import check
    from treadle.controller.cluster import start_ray_early
    from treadle.tracking.tracker import route_logs
    from treadle.trainers.run_eval import evaluate_checkpoints, run_config, sealed_checkpoints

    if args.config is not None:
        raise TreadleError(
            f"{run_dir} is a run directory, evaluated with its own config.yaml: drop --config "
            "(change its keys with overrides)"
        )
    steps = _steps(args.steps) if args.steps is not None else None
    checkpoints = sealed_checkpoints(run_dir, steps)
    cfg = run_config(run_dir, args.overrides, _named_sets(args.sets) if args.sets else None)
    settle(cfg)
    restore_logs = route_logs(run_dir, cfg.trainer.verbose)  # the run's logs/, from here
    try:
        steps_shown = ", ".join(c.name.removeprefix("step_") for c in checkpoints)
        print(f"treadle: eval of {run_dir}, steps {steps_shown}; {own_log(cfg)}", flush=True)
        check(cfg, "eval")
        start_ray_early(cfg)
        with progress(f"evaluating {len(checkpoints)} checkpoint(s) of {run_dir}") as say:

            def done(step: int, metrics: dict[str, float]) -> None:
                say(f"step {step}: {_shown(metrics)}")

            evaluate_checkpoints(cfg, run_dir, checkpoints, done)
    finally:
        restore_logs()
    print(f"eval: {run_dir / 'eval.jsonl'}")


def _steps(text: str) -> list[int]:
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        steps = []
    if not steps or any(s < 1 for s in steps):
        raise TreadleError(f"--steps {text!r}: give step numbers separated by commas, e.g. 10,20")
    return steps


def _named_sets(items: list[str]) -> dict[str, str]:
    """``--set name=FILE`` options as {name: FILE}."""
    sets: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise TreadleError(f"--set {item!r}: give it as name=FILE (e.g. --set val=test.jsonl)")
        if name in sets:
            raise TreadleError(f"--set {name}= is given twice")
        sets[name] = path
    return sets


def cmd_serve(args: argparse.Namespace) -> None:
    from treadle.check.run import check
    from treadle.config import load_config

    cfg = load_config(args.config, args.overrides)
    settle(cfg)
    engine = cfg.rollout.engine
    print(f"treadle: serve {cfg.model.path} ({engine}); {own_log(cfg)}", flush=True)
    check(cfg, "serve")
    from treadle.serving.serve import serve

    with contextlib.ExitStack() as starting:
        starting.enter_context(progress(f"starting the {engine} engine for {cfg.model.path}"))

        def announce(endpoint: Any) -> None:
            starting.close()  # (the spinner)
            print(
                f"serving {endpoint.model} at {endpoint.url} (api key: {endpoint.api_key}); "
                "Ctrl-C stops",
                flush=True,
            )

        serve(cfg, announce)


def cmd_prepare(args: argparse.Namespace) -> None:
    import importlib

    from treadle.tasks import PREPARERS

    module, _, name = PREPARERS[args.task].partition(":")
    prepare = getattr(importlib.import_module(module), name)
    paths = prepare(args.output_dir or f"data/{args.task}", seed=args.seed)
    for name, path in paths.items():
        print(f"{name}: {path}")


def cmd_demo(args: argparse.Namespace) -> None:
    from treadle.cli.demo import run_demo

    run_demo(args.examples)


def cmd_report(args: argparse.Namespace) -> None:
    from treadle.tracking.report import write_report

    print(f"report: {write_report(args.run_dir)}")


def cmd_model_fetch(args: argparse.Namespace) -> None:
    from treadle.models.hub import fetch_model

    with progress(f"fetching {args.name}"):
        folder = fetch_model(args.name, cache_dir=args.cache_dir)
    print(folder)


def cmd_sandbox_grade(args: argparse.Namespace) -> None:
    from treadle.sandbox import SandboxError, grade

    texts = []
    for flag, path in (("--solution", args.solution), ("--tests", args.tests)):
        try:
            texts.append(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise SandboxError(f"{flag}: cannot read '{path}': {e}") from e
    verdict = grade(texts[0], texts[1], timeout_s=args.timeout)
    print(verdict.to_json(), flush=True)
    if verdict.detail:
        print(f"treadle: {verdict.status}: {verdict.detail}", file=sys.stderr)
