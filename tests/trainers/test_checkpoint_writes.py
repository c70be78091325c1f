"""A checkpoint write that fails (disk full, no permission, an I/O error) stops the run with one
line naming the path and the cause, removes the partial ``step_<N>.tmp`` and prunes nothing:
the previous sealed checkpoint stays complete and the same command resumes from it.

The failures are injected (the tests run as root, where a read-only directory stops nothing):
an OSError from the actor's writer, state.json, the rename, a Ray worker's (wrapped), and
final_model's export; then a tiny local run through ``treadle train`` whose step-2 checkpoint
hits ENOSPC, and the rerun that resumes from step 1. A reward function there kills its worker
process on its first call: the run goes on and logs ``reward/worker_restarts``.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import tiny_runs
import torch
from safetensors.torch import load_file, save_file

from treadle.models import checkpoint as ckpt
from treadle.models.checkpoint import CheckpointWriteError

NO_SPACE = "No space left on device (ENOSPC)"


class Actors:
    """Writes a model file, then fails as ``fail`` says (None: not at all)."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail

    def save_checkpoint(self, path: str) -> None:
        model = Path(path) / "model"
        model.mkdir()
        save_file({"w": torch.ones(8)}, str(model / "model.safetensors"))
        if self.fail is not None:
            raise self.fail


class Wrapped(Exception):
    """Like Ray's RayTaskError: the worker's exception in ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the worker raised {cause!r}")
        self.cause = cause


def _run_with_two(tmp_path: Path) -> Path:
    for step in (1, 2):
        ckpt.save(tmp_path, step, Actors(), {}, {}, ckpt.Retention(keep_last=1))
    assert [p.name for _, p in ckpt.checkpoints(tmp_path)] == ["step_2"]
    return tmp_path / "checkpoints"


def _enospc(path: Path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


@pytest.mark.parametrize("where", ["actor", "ray_worker", "state", "rename"])
def test_a_failed_write_names_path_and_cause_and_keeps_the_sealed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
):
    root = _run_with_two(tmp_path)
    tmp = root / "step_3.tmp"
    actors, target, cause = Actors(), tmp / "model" / "model.safetensors", NO_SPACE
    if where == "actor":
        actors = Actors(_enospc(target))
    elif where == "ray_worker":
        actors = Actors(Wrapped(_enospc(target)))
    elif where == "state":
        target = tmp / "state.json"
        real = Path.write_text

        def write_text(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
            if self.name == "state.json":
                raise _enospc(self)
            return real(self, data, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", write_text)
    else:  # a directory the run may not write: the rename of step_3.tmp is refused
        target, cause = tmp, "Permission denied (EACCES)"

        def rename(self: Path, to: Path) -> Path:
            raise PermissionError(errno.EACCES, "Permission denied", str(self), str(to))

        monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(CheckpointWriteError) as info:
        ckpt.save(tmp_path, 3, actors, {}, {}, ckpt.Retention(keep_last=1))
    assert str(info.value) == f"checkpoint step 3: cannot write {target}: {cause}"
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["step_2"]  # no partial, nothing pruned
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_2"
    assert ckpt.read_state(root / "step_2")["step"] == 2


def test_other_errors_pass_through_as_they_are(tmp_path: Path):
    with pytest.raises(ValueError, match="a bug"):
        ckpt.save(tmp_path, 1, Actors(ValueError("a bug")), {}, {}, ckpt.Retention())


def test_a_failed_export_leaves_the_previous_final_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    root = _run_with_two(tmp_path)
    dest = tmp_path / "final_model"
    ckpt.export_model(root / "step_2", dest)
    (dest / "marker").write_text("previous")

    def copytree(src: Path, dst: Path) -> None:
        Path(dst).mkdir()
        (Path(dst) / "model.safetensors").write_bytes(b"par")
        why = "[Errno 28] No space left on device"
        raise shutil.Error([(str(src), str(Path(dst) / "model.safetensors"), why)])

    monkeypatch.setattr(shutil, "copytree", copytree)
    with pytest.raises(OSError) as info:
        ckpt.export_model(root / "step_2", dest)
    error = ckpt.write_error(2, info.value, dest)
    assert str(error) == (
        f"checkpoint step 2: cannot write {tmp_path / 'final_model.tmp' / 'model.safetensors'}: "
        "[Errno 28] No space left on device"
    )
    assert (dest / "marker").read_text() == "previous"
    assert not (tmp_path / "final_model.tmp").exists()


@pytest.mark.slow
def test_a_full_disk_at_step_2_stops_the_run_and_the_rerun_resumes_from_step_1(
    tiny_task: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):
    from treadle.engines import checkpoint

    reward = tmp_path / "dies_once.py"
    reward.write_text(tiny_runs.DIES_ONCE)
    out = tmp_path / "run"
    keys = tiny_runs.overrides(
        tiny_task,
        out,
        "trainer.backend=local",
        "trainer.total_steps=2",
        "trainer.save_every=1",
        "trainer.keep_last=1",
        "data.max_prompt_length=64",
        "rollout.max_new_tokens=8",
        "reward.num_workers=1",
        f"reward.function={reward}:score",
    )
    real = checkpoint.save_hf_folder
    target = out / "checkpoints" / "step_2.tmp" / "model"

    def full_at_step_2(state: Any, config: Any, tokenizer: Any, out_dir: Path) -> Path:
        if Path(out_dir) == target:
            raise _enospc(target / "model.safetensors")
        return real(state, config, tokenizer, out_dir)

    monkeypatch.setattr(checkpoint, "save_hf_folder", full_at_step_2)
    code, rows = tiny_runs.train(out, keys)
    err = capsys.readouterr().err
    step_1 = out / "checkpoints" / "step_1"
    assert code == 2, err
    line = (
        f"treadle: error: checkpoint step 2: cannot write {target / 'model.safetensors'}: "
        f"{NO_SPACE}; the last checkpoint is {step_1}: the same command resumes from it"
    )
    assert err.strip().splitlines()[-1] == line, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
    assert ckpt.damage(step_1) is None and not (out / "final_model").exists()
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/worker_restarts"] == 1.0  # the reward's process died once, went on
    before = load_file(str(step_1 / "model" / "model.safetensors"))

    monkeypatch.setattr(checkpoint, "save_hf_folder", real)
    code, rows = tiny_runs.train(out, keys)
    said = capsys.readouterr()
    assert code == 0, said.err
    assert f"resumed from {step_1} (step 1)" in said.out
    assert json.loads((step_1.parent / "step_2" / "state.json").read_text())["step"] == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]
    assert [r["step"] for r in rows] == [1, 2]  # step 2 once: the rerun's
    assert rows[1]["reward/worker_restarts"] == 0.0  # a new process: no death this time
    final = load_file(str(out / "final_model" / "model.safetensors"))
    assert final.keys() == before.keys()  # step 1's model loaded, trained on, exported
