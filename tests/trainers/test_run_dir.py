"""The run directory keeps what was written: sealed checkpoints, one record per step, one run.

Checkpoints carry a manifest (size and sha256 of every file): each kind of damage in the
newest makes resume fall back to the one before, naming the damaged file, or stop with one
error when none is left. metrics.jsonl holds each step once after a resume. A second run on a
directory stops at once naming the holder's pid; a dead holder's lock is taken over.
``final_model`` is a copy, not links into a checkpoint that rotation deletes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import pytest
import torch
from safetensors.torch import save_file

from treadle.models import checkpoint as ckpt
from treadle.models.checkpoint import CheckpointError, export_model
from treadle.runtime.errors import ConfigError
from treadle.tracking.tracker import Tracker, read_metrics
from treadle.trainers.run_dir import RunLock


def _save(
    out: Path,
    step: int,
    keep: int = 5,
    evals: dict[str, float] | None = None,
    best: str | None = None,
    mode: Literal["max", "min"] = "max",
) -> Path:
    tmp = ckpt.begin(out, step)
    (tmp / "model").mkdir()
    save_file({"w": torch.full((64,), float(step))}, str(tmp / "model" / "model.safetensors"))
    (tmp / "model" / "config.json").write_text(json.dumps({"step": step}))
    save_file({"torch": torch.get_rng_state()}, str(tmp / "rng_rank0.safetensors"))
    (tmp / "critic").mkdir()
    (tmp / "critic" / "optimizer.json").write_text("{}")
    state = {"step": step, "eval": evals or {}}
    return ckpt.commit(tmp, state, ckpt.Retention(keep, best, mode))


@pytest.fixture
def run(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    return tmp_path


def test_a_complete_checkpoint_lists_every_file_and_verifies(run):
    newest = ckpt.latest_checkpoint(run)
    assert newest == run / "checkpoints" / "step_3"
    files = json.loads((newest / "manifest.json").read_text())["files"]
    assert sorted(files) == [
        "critic/optimizer.json",
        "model/config.json",
        "model/model.safetensors",
        "rng_rank0.safetensors",
        "state.json",
    ]
    assert files["state.json"]["size"] == (newest / "state.json").stat().st_size
    assert ckpt.damage(newest) is None


def _flip_a_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x01  # inside the tensor bytes: same size, other value
    f.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("harm", "message"),
    [
        (lambda c: (c / "model" / "model.safetensors").unlink(), "model.safetensors is missing"),
        (
            lambda c: os.truncate(c / "model" / "model.safetensors", 10),
            "model.safetensors has 10 bytes, the manifest says",
        ),
        (
            lambda c: _flip_a_byte(c / "model" / "model.safetensors"),
            "model.safetensors is corrupted",
        ),
        (lambda c: (c / "rng_rank0.safetensors").unlink(), "rng_rank0.safetensors is missing"),
        (lambda c: (c / "manifest.json").unlink(), "manifest.json is missing"),
        (lambda c: (c / "manifest.json").write_text("{not json"), "manifest.json is unreadable"),
    ],
)
def test_a_damaged_newest_checkpoint_falls_back_naming_the_file(run, caplog, harm, message):
    harm(run / "checkpoints" / "step_3")
    with caplog.at_level(logging.WARNING, logger="treadle"):
        assert ckpt.latest_checkpoint(run) == run / "checkpoints" / "step_2"
    assert "checkpoint step_3 is damaged" in caplog.text and message in caplog.text


def test_flipped_tensor_bytes_would_load_silently_without_the_manifest(run):
    """The case the sha256 is for: the file still parses, with another value."""
    from safetensors.torch import load_file

    f = run / "checkpoints" / "step_3" / "model" / "model.safetensors"
    _flip_a_byte(f)
    assert load_file(str(f))["w"].shape == (64,)  # loads fine...
    assert "corrupted" in (ckpt.damage(f.parent.parent) or "")  # ...but is refused


def test_no_complete_checkpoint_left_is_one_error_naming_the_damage(run):
    for step in (1, 2, 3):
        (run / "checkpoints" / f"step_{step}" / "state.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"step_3/state\.json has 2 bytes.*trainer\.resume"):
        ckpt.latest_checkpoint(run)


def test_an_unfinished_temporary_checkpoint_is_ignored_and_rotation_keeps_the_newest(run):
    ckpt.begin(run, 4)  # a run killed while writing step 4
    assert ckpt.latest_checkpoint(run) == run / "checkpoints" / "step_3"
    _save(run, 5, keep=2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_3",
        "step_4.tmp",
        "step_5",
    ]


def test_a_missing_rng_file_is_an_error_not_skipped(run, monkeypatch):
    from types import SimpleNamespace

    from treadle.engines import checkpoint

    monkeypatch.setattr(checkpoint, "load_optimizer", lambda *args: None)  # (no optimizer here)
    home = SimpleNamespace(weights_in=lambda: None, moments_out=lambda optimizer: None)
    engine = SimpleNamespace(lora=False, residence=home, optimizer=1, scheduler=1, module=None)
    with pytest.raises(CheckpointError, match=r"rng_rank1\.safetensors is missing"):
        checkpoint.load_checkpoint(engine, run / "checkpoints" / "step_3", 1)  # type: ignore[arg-type]


def test_final_model_is_a_copy_that_outlives_the_checkpoint(run):
    final = export_model(run / "checkpoints" / "step_3", run / "final_model")
    weights = final / "model.safetensors"
    assert weights.stat().st_nlink == 1
    _save(run, 4, keep=1)  # rotation deletes step_3
    assert not (run / "checkpoints" / "step_3").exists()
    assert json.loads((final / "config.json").read_text()) == {"step": 3}


def _kept(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


ACC = "eval/val/accuracy"


def test_keep_best_keeps_the_best_checkpoint_whatever_keep_last_removes(tmp_path):
    for step, acc in [(1, 0.2), (2, 0.7), (3, 0.5), (4, 0.6)]:
        _save(tmp_path, step, keep=1, evals={ACC: acc, "eval/val/reward": 1 - acc}, best=ACC)
    assert _kept(tmp_path) == ["step_2", "step_4"]
    assert ckpt.best_checkpoint(tmp_path, ACC) == tmp_path / "checkpoints" / "step_2"
    # a better one takes its place (the newest stays: it is the best now)
    _save(tmp_path, 5, keep=1, evals={ACC: 0.9}, best=ACC)
    assert _kept(tmp_path) == ["step_5"]
    # the ranking is read back from the state.json of each checkpoint: a later process keeps
    # the best of an earlier one, and the newest even when it is worse
    _save(tmp_path, 6, keep=1, evals={ACC: 0.1}, best=ACC)
    assert _kept(tmp_path) == ["step_5", "step_6"]
    assert ckpt.evaluated(tmp_path / "checkpoints" / "step_5", ACC) == 0.9


def test_keep_best_min_ties_and_unranked_checkpoints(tmp_path):
    loss = "eval/val/loss"
    _save(tmp_path, 1, keep=1)  # an older treadle's checkpoint: nothing recorded, not ranked
    for step, value in [(2, 0.5), (3, 0.3), (4, 0.3), (5, 0.8)]:
        _save(tmp_path, step, keep=1, evals={loss: value}, best=loss, mode="min")
    assert _kept(tmp_path) == ["step_3", "step_5"]  # a tie keeps the earlier one
    assert ckpt.best_checkpoint(tmp_path, loss, "max") == tmp_path / "checkpoints" / "step_5"
    assert ckpt.best_checkpoint(tmp_path, "eval/other/accuracy") is None


def test_keep_best_mode_follows_the_metric_name_unless_given():
    from treadle.config.trainer import TrainerConfig

    modes = {
        name: TrainerConfig(keep_best=name).best_mode()
        for name in ("eval/val/accuracy", "eval/val/pass@4", "eval/sft/loss", "eval/val/error")
    }
    assert modes == {
        "eval/val/accuracy": "max",
        "eval/val/pass@4": "max",
        "eval/sft/loss": "min",
        "eval/val/error": "min",
    }
    assert TrainerConfig(keep_best="eval/val/loss", keep_best_mode="max").best_mode() == "max"


def test_an_unsealed_newer_checkpoint_removes_nothing(tmp_path):
    for step in (1, 2):
        _save(tmp_path, step, keep=1, evals={ACC: step / 10}, best=ACC)
    ckpt.begin(tmp_path, 3)  # killed while writing step 3: step 2 is still the newest sealed
    assert _kept(tmp_path) == ["step_2", "step_3.tmp"]


def test_after_a_resume_each_step_is_in_the_metrics_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": s / 10}) for s in range(1, 6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "lo')  # a crash cut the last line
    with Tracker(tmp_path, 8, start_step=3, show_progress=False) as tracker:
        assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3]
        tracker.log(4, {"loss": 0.41})
    assert [(m["step"], m["loss"]) for m in read_metrics(tmp_path)] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
        (4, 0.41),
    ]


def test_a_second_run_on_a_directory_stops_naming_the_holder_then_takes_over_a_dead_one(
    tmp_path, caplog
):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path;"
            "from treadle.trainers.run_dir import RunLock;"
            f"lock = RunLock(Path({str(tmp_path)!r})); print('locked', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        with pytest.raises(ConfigError, match=rf"is in use by another run \(pid {holder.pid} on "):
            RunLock(tmp_path)
        assert time.monotonic() - started < 1  # at once, no waiting
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="treadle"):
        lock = RunLock(tmp_path)  # the holder died without releasing: taken over
    assert f"took over the lock of a run that ended without releasing it (pid {holder.pid}" in (
        caplog.text
    )
    lock.release()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="treadle"):
        RunLock(tmp_path).release()  # released cleanly: no warning
    assert caplog.text == ""
