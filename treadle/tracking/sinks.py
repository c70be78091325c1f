"""Where a run's metrics and samples go: one small class per destination (``trainer.loggers``).

Every destination is a :class:`Logger`: ``log(step, metrics)``, ``log_table(step, name, rows)``
and ``close()``. :func:`open_loggers` builds the configured ones for a run; the trainer's
:class:`treadle.tracking.tracker.Tracker` calls each in turn.

- ``console``: a rich progress bar (ETA, key metrics) on a terminal; one plain line per step
  otherwise (a pipe, nohup, ``ray job submit``): no colour codes, no carriage returns.
- ``jsonl``: ``metrics.jsonl``, one object per step, flushed at once; a table goes to
  ``<name>.jsonl`` (``samples.jsonl``), one object per row with its step. A resumed run first
  drops the records of steps after its checkpoint, so each step is there once.
- ``tensorboard``: event files under ``<output_dir>/tensorboard/`` (torch's SummaryWriter); the
  resolved config as text; a resumed run purges the steps after its checkpoint.
- ``wandb``: offline under ``<output_dir>/wandb/`` unless ``WANDB_MODE`` (or ``WANDB_API_KEY``)
  says otherwise; the run id is kept in ``<output_dir>/wandb/run_id`` so that a resumed run
  continues the same wandb run (``resume="allow"``).
- ``mlflow``: ``MLFLOW_TRACKING_URI`` if set, else a SQLite store ``<output_dir>/mlflow.db``
  (artifacts in ``<output_dir>/mlflow-artifacts/``); the config as flattened parameters; the
  run id kept in ``<output_dir>/mlflow_run_id`` and continued on resume.
- ``swanlab``: local mode under ``<output_dir>/swanlog/`` unless ``SWANLAB_MODE`` is set.

The tracker libraries are optional (extras ``treadle[tensorboard|wandb|mlflow|swanlab]``,
``treadle[trackers]`` for all): a missing one is a one-line ConfigError naming the extra, before
any worker starts (:func:`check_loggers`).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from treadle.runtime.errors import ConfigError

# logger name -> (module it needs, pip package, extra)
REQUIRES = {
    "tensorboard": ("tensorboard", "tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny", "mlflow"),
    "swanlab": ("swanlab", "swanlab", "swanlab"),
}


class Logger(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def check_loggers(names: Sequence[str]) -> None:
    """One line naming the extra to install for each tracker whose library is missing."""
    problems = []
    for name in names:
        if name not in REQUIRES:
            continue
        module, package, extra = REQUIRES[name]
        try:
            importlib.import_module(module)
        except ImportError:
            problems.append(
                f"trainer.loggers: {name} needs the {package} package: "
                f"pip install 'treadle[{extra}]'"
            )
    if problems:
        raise ConfigError("\n".join(problems))


def open_loggers(
    names: Sequence[str],
    out: Path,
    config: dict[str, Any],
    start: int,
    console: Logger | None = None,
) -> list[Logger]:
    """The loggers ``names`` for the run in ``out`` resuming after step ``start``; ``console``:
    the run's console (made earlier, it printed the start-up lines)."""
    check_loggers(names)
    makers: dict[str, Callable[[], Logger]] = {
        "jsonl": lambda: JsonlLogger(out, start),
        "tensorboard": lambda: TensorBoardLogger(out, config, start),
        "wandb": lambda: WandbLogger(out, config),
        "mlflow": lambda: MlflowLogger(out, config),
        "swanlab": lambda: SwanlabLogger(out, config),
    }
    loggers: list[Logger] = []
    try:
        for name in dict.fromkeys(names):  # each once, in the order given
            if name == "console":
                if console is not None:
                    loggers.append(console)
            else:
                loggers.append(makers[name]())
    except BaseException:
        for made in loggers:
            made.close()
        raise
    return loggers


def finite(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric, finite metrics (what the trackers' scalar APIs take)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


# -- jsonl ------------------------------------------------------------------------------------


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def accuracy_keys(metrics: Iterable[str]) -> list[str]:
    """The held-out accuracy of every validation set among ``metrics``' names,
    ``eval/<set>/accuracy`` (not those of each data source), in their order."""
    return [
        k
        for k in metrics
        if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2
    ]


class JsonlLogger:
    """``metrics.jsonl`` and ``<table>.jsonl`` in the run directory, each step once."""

    def __init__(self, out: Path, start: int) -> None:
        self.out = out
        self.start = start
        self.path = out / "metrics.jsonl"
        keep_steps_up_to(self.path, start)
        self._file = self.path.open("a")
        self._tables: dict[str, Any] = {}

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        if name not in self._tables:
            path = self.out / f"{name}.jsonl"
            keep_steps_up_to(path, self.start)
            self._tables[name] = path.open("a")
        f = self._tables[name]
        for row in rows:
            f.write(json.dumps({"step": step, **{k: _clean(v) for k, v in row.items()}}) + "\n")
        f.flush()

    def close(self) -> None:
        for f in [self._file, *self._tables.values()]:
            f.close()


def keep_steps_up_to(path: Path, last: int) -> None:
    """Rewrite ``path`` (atomically) without the records of steps after ``last``."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and _step(line) <= last]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def _step(line: str) -> float:
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):  # a line cut by a crash: drop it
        return math.inf


# -- the console --------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    s = round(seconds)
    h, rest = divmod(s, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


class ConsoleLogger:
    """The run's console: start-up and end lines, and each step's progress.

    On a terminal (and ``trainer.progress``) a rich progress bar with the ETA and the key
    metrics; otherwise one plain line per step (``step 3/40  reward/mean 0.412  4.1 s  eta
    2m31s``), printed and flushed at once, so that a pipe or a log file shows every step.
    """

    def __init__(
        self, total: int, start: int, headline: str, bar: bool | None = None, stream: Any = None
    ) -> None:
        self.stream = stream or sys.stdout
        self.total, self.start, self.headline = total, start, headline
        self.bar = self.stream.isatty() if bar is None else bar
        self._began = time.perf_counter()
        self._last = self._began
        self._progress: Any = None

    def print(self, message: str) -> None:
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)

    def begin(self, total: int, start: int) -> None:
        """The loop starts: steps ``start+1 .. total``."""
        self.total, self.start = total, start
        self._began = self._last = time.perf_counter()
        if not self.bar:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]treadle"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=Console(file=self.stream, force_terminal=True),  # a bar was asked for
        )
        self._task = self._progress.add_task("train", total=total, completed=start, status="")
        self._progress.start()

    def status(self, metrics: Mapping[str, Any]) -> str:
        """The key metrics of a step: the headline and held-out accuracies when measured."""
        parts = []
        for key in (self.headline, *accuracy_keys(metrics), "eval/pair_accuracy"):
            value = metrics.get(key)
            if isinstance(value, int | float):
                parts.append(f"{key} {value:.3f}")
        return "  ".join(parts)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        startup = metrics.get("timing/startup")  # the first step of a process has it
        if self._progress is not None:
            if startup is not None:
                self.print(f"started in {startup:.1f} s (the command to the first step)")
            self._progress.update(self._task, completed=step, status=self.status(metrics))
            return
        done = step - self.start
        eta = (now - self._began) / done * (self.total - step) if done > 0 else 0.0
        parts = [f"step {step}/{self.total}", self.status(metrics)]
        parts += [f"{seconds:.1f} s", f"eta {_duration(eta)}"]
        if startup is not None:
            parts.append(f"(started in {startup:.1f} s)")
        print("  ".join(p for p in parts if p), file=self.stream, flush=True)

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        """Samples stay off the console (they are in samples.jsonl and the trackers)."""

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


# -- tensorboard --------------------------------------------------------------------------------


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])

    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


class TensorBoardLogger:
    """Scalars per step, the config and sample tables as text, in ``<out>/tensorboard/``."""

    def __init__(self, out: Path, config: dict[str, Any], start: int) -> None:
        import yaml
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run hides the events of the steps it runs again
        self.writer = SummaryWriter(
            log_dir=str(out / "tensorboard"), purge_step=start + 1 if start else None
        )
        if not start:
            text = yaml.safe_dump(config, sort_keys=False)
            self.writer.add_text("config", "```\n" + text + "\n```", global_step=0)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, value in finite(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text(name, _markdown_table(rows), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# -- wandb --------------------------------------------------------------------------------------


def _kept_id(path: Path, make: Any) -> str:
    """The id kept in ``path`` (a resumed run's), or a new one written there."""
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    new = str(make())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
    return new


class WandbLogger:
    """A wandb run in ``<out>/wandb/``: offline unless the user set ``WANDB_MODE`` or an API
    key; the same run continued on resume."""

    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        run_id = _kept_id(out / "wandb" / "run_id", lambda: os.urandom(4).hex())
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "treadle"),
            name=out.resolve().name,
            id=run_id,
            resume="allow",
            dir=str(out),
            mode=mode,  # type: ignore[arg-type]
            config=config,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(finite(metrics), step=step)

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        import wandb

        if rows:
            cols: list[str | int] = list(rows[0])
            table = wandb.Table(columns=cols, data=[[r.get(str(c)) for c in cols] for r in rows])
            self.run.log({name: table}, step=step)

    def close(self) -> None:
        self.run.finish()


# -- mlflow -------------------------------------------------------------------------------------


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"trainer.total_steps": "10", ...}``: a nested config as MLflow parameters."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = json.dumps(value) if not isinstance(value, str) else value
    return flat


class MlflowLogger:
    """An MLflow run: in ``MLFLOW_TRACKING_URI``, else a SQLite store in the run directory."""

    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        out = out.resolve()
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "treadle")
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            local = None if os.environ.get("MLFLOW_TRACKING_URI") else out / "mlflow-artifacts"
            experiment_id = self.client.create_experiment(
                name, artifact_location=local.as_uri() if local else None
            )
        id_file = out / "mlflow_run_id"
        kept = id_file.read_text().strip() if id_file.is_file() else ""
        if kept and self._exists(kept):
            self.run_id = kept
            self.client.update_run(kept, status="RUNNING")
            return
        run = self.client.create_run(experiment_id, run_name=out.name)
        self.run_id = run.info.run_id
        id_file.write_text(self.run_id)
        params = [Param(k, v[:6000]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in finite(metrics).items()]
        for i in range(0, len(items), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        self.client.log_dict(self.run_id, {"step": step, "rows": rows}, f"{name}/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# -- swanlab ------------------------------------------------------------------------------------


class SwanlabLogger:
    """A SwanLab run, local (``<out>/swanlog/``) unless ``SWANLAB_MODE`` says otherwise; the run
    id is kept in ``<out>/swanlog/run_id`` and continued on resume."""

    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        import swanlab

        self.swanlab = swanlab
        logdir = out / "swanlog"
        # 21 characters: what older swanlab versions require of an id
        run_id = _kept_id(logdir / "run_id", lambda: os.urandom(11).hex()[:21])
        self.run = swanlab.init(
            project=os.environ.get("SWANLAB_PROJECT", "treadle"),
            experiment_name=out.resolve().name,
            config=config,
            logdir=str(logdir),
            mode=os.environ.get("SWANLAB_MODE", "local"),
            id=run_id,
            resume="allow",
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(finite(metrics), step=step)

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        text = [self.swanlab.Text(json.dumps(r), caption=f"{name} {i}") for i, r in enumerate(rows)]
        if text:
            self.run.log({name: text}, step=step)

    def close(self) -> None:
        self.run.finish()
