"""Each tracker's files, read back with its own library, hold the run's metrics and samples.

TensorBoard through its EventAccumulator, MLflow through MlflowClient on the run's SQLite
store, wandb from its offline transaction log (the framing of LevelDB's log, records in
wandb's own protobuf: wandb 0.31 has no Python reader). A resumed run continues the same wandb
and MLflow runs. A missing library is one line naming the extra to install.
"""

from __future__ import annotations

import json
import struct
import sys
import types
from pathlib import Path

import pytest

from treadle.cli import main
from treadle.runtime.errors import ConfigError
from treadle.tracking.sinks import check_loggers, flatten
from treadle.tracking.tracker import Tracker, read_metrics

CONFIG = {"trainer": {"total_steps": 4, "loggers": ["jsonl"]}, "model": {"path": "m"}}
TRACKERS = ["jsonl", "tensorboard", "wandb", "mlflow"]


def _steps(tracker: Tracker, steps: range, offset: float) -> None:
    for s in steps:
        tracker.log(s, {"reward/mean": s / 10 + offset, "timing/step": 0.5 * s})
        if s % 2 == 0:
            rows = [
                {"prompt": f"p{s}{i}", "response": "r", "reward": 0.5 * i, "ground_truth": "g"}
                for i in range(2)
            ]
            tracker.log_table(s, "samples", rows)


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Steps 1-3, then a resume from a checkpoint at step 2 that runs steps 3-4 again."""
    out = tmp_path_factory.mktemp("trackers")
    with Tracker(out, 4, 0, False, loggers=TRACKERS, config=CONFIG) as tracker:
        _steps(tracker, range(1, 4), offset=0.0)
    ids = (out / "wandb" / "run_id").read_text(), (out / "mlflow_run_id").read_text()
    with Tracker(out, 4, 2, False, loggers=TRACKERS, config=CONFIG) as tracker:
        _steps(tracker, range(3, 5), offset=1.0)
    return out, ids


def _expected(out: Path) -> dict[int, float]:
    return {m["step"]: m["reward/mean"] for m in read_metrics(out)}


@pytest.mark.slow
def test_jsonl_holds_each_step_once_with_the_resumed_values(resumed_run):
    out, _ = resumed_run
    assert _expected(out) == {1: 0.1, 2: 0.2, 3: 1.3, 4: 1.4}
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"], s["reward"]) for s in samples] == [
        (2, "p20", 0.0),
        (2, "p21", 0.5),
        (4, "p40", 0.0),
        (4, "p41", 0.5),
    ]


def test_tensorboard_events_hold_the_metrics_config_and_samples(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = resumed_run
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    # the resumed run purged the first run's step 3
    got = {e.step: round(e.value, 6) for e in acc.Scalars("reward/mean")}
    assert got == _expected(out)
    texts = {t: acc.Tensors(t) for t in acc.Tags()["tensors"]}
    config = texts["config/text_summary"][0].tensor_proto.string_val[0].decode()
    assert "total_steps: 4" in config
    samples = [e.step for e in texts["samples/text_summary"]]
    assert samples == [2, 4]
    assert "p41" in texts["samples/text_summary"][-1].tensor_proto.string_val[0].decode()


def test_mlflow_run_holds_params_metrics_and_samples_and_is_continued(resumed_run):
    from mlflow.tracking import MlflowClient

    out, (_, mlflow_id) = resumed_run
    client = MlflowClient(tracking_uri=f"sqlite:///{out.resolve() / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("treadle").experiment_id])
    assert [r.info.run_id for r in runs] == [mlflow_id]  # the resume continued it
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.total_steps"] == "4"
    assert run.data.params["trainer.loggers"] == '["jsonl"]'
    history = client.get_metric_history(mlflow_id, "reward/mean")
    # MLflow's history is append-only: the step run again holds both values, the last wins
    latest = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
    assert latest == _expected(out)
    assert sorted(m.step for m in history) == [1, 2, 3, 3, 4]
    artifacts = {a.path for a in client.list_artifacts(mlflow_id, "samples")}
    assert artifacts == {"samples/step_2.json", "samples/step_4.json"}
    rows = json.loads(Path(client.download_artifacts(mlflow_id, "samples/step_4.json")).read_text())
    assert [r["prompt"] for r in rows["rows"]] == ["p40", "p41"]


def _wandb_records(path: Path) -> list:
    """The protobuf records of a wandb transaction log (LevelDB log framing, 32 KiB blocks,
    after a 7-byte ``:W&B`` header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    chunks, parts = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # a whole record
            chunks.append(payload)
        elif kind in (2, 3):  # first, middle
            parts = payload if kind == 2 else parts + payload
        elif kind == 4:  # last
            chunks.append(parts + payload)
    records = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)  # "reward/mean" is stored as a nested key


def test_wandb_offline_runs_hold_config_history_and_samples_under_one_id(resumed_run):
    out, (wandb_id, _) = resumed_run
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # the first run and its resume, the same id
    history: dict[int, float] = {}
    tables = []
    for f in files:
        assert f.name == f"run-{wandb_id}.wandb"
        records = _wandb_records(f)
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        assert run.run_id == wandb_id
        config = {_key(u): json.loads(u.value_json) for u in run.config.update}
        assert config["trainer"] == CONFIG["trainer"]
        for r in records:
            if r.WhichOneof("record_type") == "history":
                items = {_key(i): json.loads(i.value_json) for i in r.history.item}
                history[items["_step"]] = items["reward/mean"]
                if "samples/_type" in items:
                    tables.append((items["_step"], items["samples/_type"], items["samples/nrows"]))
    assert history == _expected(out)
    assert tables == [(2, "table-file", 2), (4, "table-file", 2)]
    table = next((out / "wandb").glob("offline-run-*/files/media/table/samples_4_*.table.json"))
    assert json.loads(table.read_text())["columns"] == [
        "prompt",
        "response",
        "reward",
        "ground_truth",
    ]


def test_flatten_makes_dotted_parameters():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": "x", "e": {}}) == {
        "a.b": "1",
        "a.c": "[1, 2]",
        "d": "x",
        "e": "{}",
    }


def test_a_missing_tracker_library_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    monkeypatch.setitem(sys.modules, "swanlab", None)
    with pytest.raises(ConfigError) as e:
        check_loggers(["console", "wandb", "tensorboard", "swanlab"])
    assert str(e.value).splitlines() == [
        "trainer.loggers: wandb needs the wandb package: pip install 'treadle[wandb]'",
        "trainer.loggers: swanlab needs the swanlab package: pip install 'treadle[swanlab]'",
    ]


def test_the_command_line_stops_on_a_missing_tracker_before_the_run_starts(
    tiny_task, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "examples/arithmetic/grpo.yaml",
            f"model.path={tiny_task['model']}",
            f"data.train_files=[{tiny_task['train']}]",
            f"data.val_files=[{tiny_task['test']}]",
            "trainer.backend=local",
            f"trainer.output_dir={out}",
            "trainer.loggers=[console,mlflow]",
        ]
    )
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "treadle: error: trainer.loggers: mlflow needs the mlflow-skinny package: "
        "pip install 'treadle[mlflow]'"
    ]
    assert not out.exists()


def test_swanlab_runs_local_and_is_continued_on_resume(tmp_path, monkeypatch):
    """swanlab is not installed here (its protobuf pin conflicts with vLLM's): its API, faked."""
    calls: list[tuple] = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    fake = types.SimpleNamespace(init=init, Text=lambda text, caption: (caption, text))
    monkeypatch.setitem(sys.modules, "swanlab", fake)
    for start in (0, 1):
        with Tracker(tmp_path, 2, start, False, loggers=["swanlab"], config=CONFIG) as t:
            t.log(start + 1, {"reward/mean": 0.5, "note": "not a number"})
            t.log_table(start + 1, "samples", [{"prompt": "p"}])
    inits = [c[1] for c in calls if c[0] == "init"]
    assert inits[0]["mode"] == "local" and inits[0]["logdir"] == str(tmp_path / "swanlog")
    assert inits[0]["config"] == CONFIG and inits[0]["resume"] == "allow"
    assert inits[0]["id"] == inits[1]["id"] == (tmp_path / "swanlog" / "run_id").read_text()
    logs = [c[1:] for c in calls if c[0] == "log"]
    assert logs[0] == (1, {"reward/mean": 0.5})
    assert logs[1] == (1, {"samples": [("samples 0", '{"prompt": "p"}')]})
    assert [c[0] for c in calls].count("finish") == 2
