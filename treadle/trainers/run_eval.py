"""``treadle eval RUN_DIR``: a run's sealed checkpoints evaluated after the fact.

The config is the run's own, ``RUN_DIR/config.yaml`` (the resolved config every run writes),
with the command's overrides; ``--set name=FILE`` replaces the run's validation sets (``val``
is ``data.val_files``, any other name a ``data.val_sets`` entry) by those files.

The actors and the rollout start once, from the first checkpoint's model; every other
checkpoint's weights (LoRA: the base model's, with the checkpoint's ``adapter/``) are loaded
into the actor, and each checkpoint's are synced to the replicas as version ``<step>``, as a
training step's are, so a checkpoint costs its evaluation and one weight sync, not a start.
As in training, Ray's, vLLM's and torch's messages go to ``RUN_DIR/logs/`` unless
``trainer.verbose``. The replicas live in the
actor's processes (``rollout.placement=colocated``) whatever the run's placement, as for
``treadle eval CONFIG``: nothing else runs beside them. The metrics are the in-training
evaluation's (:func:`~treadle.trainers.evaluation.evaluate_sets`, the ``eval`` section's
sampling), so a checkpoint gives the numbers its step logged.

Each checkpoint's metrics go to ``RUN_DIR/eval.jsonl`` as soon as they are known, one line a
step, ``{"step": N, "eval/<set>/<metric>": ...}``, in step order; evaluating a step again
replaces its line. ``treadle report`` plots them beside the in-training ones.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from treadle.config import Config, load_config
from treadle.config.data import VAL
from treadle.models import checkpoint as ckpt
from treadle.runtime.errors import ConfigError
from treadle.tracking.tracker import route_logs
from treadle.trainers.evaluation import (
    close_sets,
    evaluate_sets,
    evaluation_rollout,
    load_val_sets,
)

EVAL_FILE = "eval.jsonl"
log = logging.getLogger("treadle")


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a run's output directory (it holds the run's config.yaml)."""
    return (path / "config.yaml").is_file()


def run_config(
    run_dir: Path, overrides: Sequence[str], sets: Mapping[str, str] | None = None
) -> Config:
    """The run's resolved config with ``overrides``; ``sets`` (name -> file) replace its
    validation sets."""
    path = run_dir / "config.yaml"
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        detail = " ".join(str(e).split())
        raise ConfigError(f"{path}: cannot read the run's config: {detail}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a mapping of config sections")
    if sets:
        raw["data"] = with_sets(raw.get("data") or {}, sets)
    return load_config(raw, overrides)


def with_sets(data: Mapping[str, Any], sets: Mapping[str, str]) -> dict[str, Any]:
    """The ``data`` section ``data`` with ``sets`` (name -> file) as its validation sets, and
    no other (with reasoning-gym rows: none of its held-out rows)."""
    out = {**data, "val_files": [sets[VAL]] if VAL in sets else []}
    out["val_sets"] = {name: {"files": [f]} for name, f in sets.items() if name != VAL}
    if data.get("source") == "reasoning_gym":
        if VAL in sets:
            raise ConfigError(
                f"--set {VAL}=...: the run's rows are reasoning-gym's (data.source), which "
                "takes no data.val_files: give the file's set another name"
            )
        out.pop("val_files")
        out["reasoning_gym"] = {**(data.get("reasoning_gym") or {}), "val_size": 0}
    return out


def sealed_checkpoints(run_dir: Path, steps: Sequence[int] | None = None) -> list[Path]:
    """The run's complete checkpoints (all, or those of ``steps``), oldest first. A damaged
    one is left out with a warning; a step asked for that has none is an error listing those
    there are."""
    found = dict(ckpt.checkpoints(run_dir))
    if not found:
        raise ConfigError(
            f"{run_dir} has no checkpoint in {ckpt.checkpoint_root(run_dir)} (a run writes one "
            "every trainer.save_every steps and at its end)"
        )
    there = ", ".join(str(s) for s in found)
    wanted = sorted(set(steps)) if steps else list(found)
    missing = [s for s in wanted if s not in found]
    if missing:
        raise ConfigError(
            f"{run_dir} has no checkpoint of step {', '.join(map(str, missing))}; its "
            f"checkpoints are of steps {there}"
        )
    out = []
    for step in wanted:
        problem = ckpt.damage(found[step])
        if problem is None:
            out.append(found[step])
        elif steps:
            raise ConfigError(f"the checkpoint of step {step} is damaged: {problem}")
        else:
            log.warning("checkpoint %s is damaged, not evaluated: %s", found[step].name, problem)
    if not out:
        raise ConfigError(f"{run_dir}: every checkpoint is damaged (steps {there})")
    return out


def evaluate_checkpoints(
    cfg: Config,
    run_dir: Path,
    checkpoints: Sequence[Path],
    done: Callable[[int, dict[str, float]], None] = lambda step, metrics: None,
) -> dict[int, dict[str, float]]:
    """Every checkpoint's metrics by step, each also written to ``run_dir/eval.jsonl`` and
    given to ``done`` as soon as it is known."""
    sets = load_val_sets(cfg)
    if not sets:
        raise ConfigError(
            "the run has no validation sets (data.val_files, data.val_sets): give some with "
            "--set name=FILE"
        )
    first = checkpoints[0]
    lora = ckpt.holds_adapters(first)
    start = cfg.model.path if lora else str(first / "model")  # LoRA: the base model
    results: dict[int, dict[str, float]] = {}
    restore_logs = route_logs(run_dir, cfg.trainer.verbose)  # the workers' too, as in training
    try:
        with evaluation_rollout(cfg, start, _step(first)) as (actors, rollout):
            for path in checkpoints:
                if lora or path != first:
                    actors.group.load_weights(str(path))
                rollout.sync_weights(_step(path))  # the replicas serve version <step>
                metrics = evaluate_sets(cfg, rollout, sets)
                results[_step(path)] = metrics
                write_eval_lines(run_dir, {_step(path): metrics})
                done(_step(path), metrics)
    finally:
        close_sets(sets)
        restore_logs()
    return results


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def read_eval_lines(run_dir: Path) -> dict[int, dict[str, Any]]:
    """``run_dir/eval.jsonl`` by step (empty when there is none)."""
    path = run_dir / EVAL_FILE
    if not path.is_file():
        return {}
    lines = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            lines[int(record["step"])] = record
    return lines


def write_eval_lines(run_dir: Path, metrics: Mapping[int, Mapping[str, float]]) -> Path:
    """Put each step's ``metrics`` into ``run_dir/eval.jsonl`` (a step already there is
    replaced), in step order, atomically."""
    lines = read_eval_lines(run_dir)
    for step, values in metrics.items():
        lines[step] = {"step": step, **values}
    path = run_dir / EVAL_FILE
    tmp = path.with_name(EVAL_FILE + ".tmp")
    tmp.write_text("".join(json.dumps(lines[s]) + "\n" for s in sorted(lines)), encoding="utf-8")
    os.replace(tmp, path)
    return path
