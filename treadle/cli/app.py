"""The ``treadle`` command's process: its environment and logging, one command parsed and run,
and its exit code (0; 2 for a problem the user can fix, one ``treadle: error: ...`` line each;
1 for any other error, one line and where its traceback is, :mod:`treadle.cli.console`; 130
or 143 for a stop)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from treadle.cli.console import failed, quiet
from treadle.cli.parser import parse
from treadle.cli.signals import on_stop_signal, overrun, set_stop_handlers
from treadle.runtime import startup
from treadle.runtime.errors import (
    Stopped,
    TreadleError,
    clear_signals,
    raise_if_signalled,
    signalled,
    stop_cause,
    stop_line,
)
from treadle.runtime.omp import openmp_env


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code. ``argv`` None: this process's own command line, which
    then ends with this command (see :mod:`treadle.cli.signals`)."""
    clear_signals()  # a command run in-process before this one (tests) noted its own
    if argv is None:
        overrun.arm()
    # first: Ctrl-C or SIGTERM from here on stops the command
    before = set_stop_handlers(on_stop_signal)
    quieted: list[Callable[[], None]] = []  # the console's logging put back (console.quiet)
    try:
        overrun.code = _main(argv, quieted)
        return overrun.code
    finally:
        # The outcome is settled: a signal now (Ray's exit handler, Python's teardown, which
        # would put the default action, death without a word, back) changes nothing.
        set_stop_handlers(signal.SIG_IGN if argv is None else before)
        if argv is None:  # nor does a library's exit handler add its info lines after ours
            logging.disable(logging.INFO)  # (torch's FakeTensor cache stats, once interrupted)
        cluster = sys.modules.get("treadle.controller.cluster")
        if cluster is not None:  # Ray may still be starting in the background
            cluster.settle()  # (its messages meanwhile: still off the console)
        for restore in quieted:
            restore()


def _main(argv: Sequence[str] | None, quieted: list[Callable[[], None]]) -> int:
    os.environ.update(openmp_env())  # before torch is imported (treadle.runtime.omp)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("httpx", "httpx2"):  # an agent's openai client: a line a call
        logging.getLogger(name).setLevel(logging.WARNING)
    args: argparse.Namespace | None = None
    try:
        args = parse(argv)
        quieted.append(quiet(args))  # the libraries' messages off the console (cli.console)
        if not getattr(args, "verbose", False):
            # Ray prints a call's error that nobody read when its reference is freed, even at
            # exit, after the line that names what stopped the run: the peers of a rank that
            # died fail too, and that line names the rank (treadle reads every result it uses)
            os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
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
    except Exception as e:  # a library's (or a bug): one line and where its traceback is
        if args is None or getattr(args, "verbose", False):
            raise
        if signalled():  # what a stop broke on its way out (a worker gone): the stop it is
            how, code = stop_cause()
            print(f"treadle: {stop_line(how)}", file=sys.stderr)
            return code
        return failed(e, getattr(args, "command", "treadle"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
