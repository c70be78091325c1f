"""The Python API (treadle.train/sft/dpo/rm), Python reward functions in both forms, datasets
as objects and saved folders, and algorithm.plugins."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict, load_from_disk

import treadle
from treadle.api import resolve_config
from treadle.config import load_config
from treadle.data import TextOptions, load_prompt_dataset
from treadle.models.loading import load_tokenizer
from treadle.rewards import Scorer, register_reward, score_batched
from treadle.runtime.errors import ConfigError, DataError, RewardError

ROOT = Path(__file__).resolve().parent.parent


def fast(task, out) -> dict:
    """A one-step local GRPO run on the tiny task, as a dict of sections."""
    return {
        "model": {"path": str(task["model"])},
        "data": {"batch_size": 4, "max_prompt_length": 64},
        "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 6},
        "actor": {"ppo_mini_batch_size": 8, "micro_batch_size": 8},
        "reward": {"num_workers": 0},
        "trainer": {"backend": "local", "output_dir": str(out), "total_steps": 1},
    }


def rows(task, n: int) -> list[dict]:
    with open(task["train"]) as f:
        return [json.loads(line) for line in f][:n]


# --- reward functions ------------------------------------------------------------------------


def test_batched_reward_gets_completions_and_columns_it_names():
    seen = {}

    def reward(completions, answer):  # no **kwargs: only what it names
        seen.update(completions=completions, answer=answer)
        return [float(len(c)) for c in completions]

    scores = score_batched(
        reward, ["p1", "p2"], ["ab", "c"], ["1", "2"],
        [{"prompt": "p1", "answer": "1", "x": 0}, {"prompt": "p2", "answer": "2", "x": 1}],
        spec="r",
    )  # fmt: skip
    assert scores == [2.0, 1.0]
    assert seen == {"completions": ["ab", "c"], "answer": ["1", "2"]}

    def wide(completions, **kwargs):
        seen.clear()
        seen.update(kwargs)
        return [0] * len(completions)

    score_batched(wide, ["p"], ["r"], ["1"], [{"prompt": "p", "answer": "1", "x": 7}], spec="w")
    assert seen == {"prompts": ["p"], "answer": ["1"], "x": [7]}  # the prompt column: prompts


def test_batched_reward_failures_name_the_function():
    with pytest.raises(RewardError, match="'short' returned 1 values for 2 completions"):
        score_batched(
            lambda completions, **_: [1.0], ["a", "b"], ["r", "s"], ["", ""], spec="short"
        )
    with pytest.raises(RewardError, match="'nan' failed on sample 1: returned nan"):
        score_batched(
            lambda completions, **_: [0.0, float("nan")], ["a", "b"], ["r", "s"], ["", ""],
            spec="nan",
        )  # fmt: skip
    with pytest.raises(RewardError, match="'boom' raised KeyError"):
        score_batched(lambda completions, **kw: kw["missing"], ["a"], ["r"], [""], spec="boom")


def test_python_reward_runs_in_the_pool_by_cloudpickle():
    offset = 0.25  # a closure: pickled by value, with what it holds

    def reward(prompt, response, ground_truth):
        return len(response) + offset

    spec = register_reward(reward)
    assert spec.startswith("python:") and spec.endswith("reward")
    with Scorer(spec, num_workers=1, timeout_s=30) as scorer:
        assert scorer.pool is not None
        assert scorer(["p", "q"], ["abc", ""], ["", ""]) == [3.25, 0.25]


def test_python_reward_with_a_wrong_signature_names_both_forms():
    with pytest.raises(ConfigError, match=r"fn\(prompt, response, ground_truth\) or, batched"):
        register_reward(lambda prompt, response: 1.0)


def test_python_reward_that_cannot_be_pickled_says_to_call_it_in_process():
    import threading

    lock = threading.Lock()

    def reward(prompt, response, ground_truth):
        with lock:
            return 1.0

    spec = register_reward(reward)
    with pytest.raises(ConfigError, match=r"set reward\.num_workers=0"):
        Scorer(spec, num_workers=1)
    with Scorer(spec, num_workers=0) as scorer:
        assert scorer(["p"], ["r"], [""]) == [1.0]


# --- configs and datasets --------------------------------------------------------------------


def test_config_as_dict_file_or_config_with_overrides(tmp_path):
    raw = {"trainer": {"total_steps": 3}, "data": {"batch_size": 32}}
    cfg = resolve_config(raw, ["trainer.total_steps=5"])
    assert cfg.trainer.total_steps == 5 and cfg.data.batch_size == 32
    assert raw == {"trainer": {"total_steps": 3}, "data": {"batch_size": 32}}  # not changed
    assert resolve_config(cfg, ["data.batch_size=16"]).data.batch_size == 16
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  total_steps: 7\n")
    assert resolve_config(path).trainer.total_steps == 7
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\.total_step'.*total_steps"):
        resolve_config({"trainer": {"total_step": 3}})
    with pytest.raises(ConfigError, match="config: a int; give a YAML file's path"):
        resolve_config(3)  # type: ignore[arg-type]


def test_a_dataset_is_saved_once_and_read_back_with_its_rows(tmp_path):
    ds = Dataset.from_list([{"prompt": f"{i}+1", "answer": str(i + 1)} for i in range(5)])
    out = tmp_path / "run"
    cfg = resolve_config({"trainer": {"output_dir": str(out)}}, train_dataset=ds)
    folder = Path(cfg.data.train_files[0])
    assert folder == (out / "datasets" / "train").absolute()
    assert load_from_disk(str(folder)).to_list() == ds.to_list()
    stamp = (folder / "state.json").stat().st_mtime_ns
    again = resolve_config({"trainer": {"output_dir": str(out)}}, train_dataset=ds)
    assert again.data.train_files == cfg.data.train_files
    assert (folder / "state.json").stat().st_mtime_ns == stamp  # same fingerprint: kept
    cfg = resolve_config({}, eval_dataset=["a.jsonl", Path("b.parquet")])
    assert cfg.data.val_files == ["a.jsonl", "b.parquet"]
    with pytest.raises(ConfigError, match=r"data.train_files: a DatasetDict \(train\); give"):
        resolve_config({}, train_dataset=DatasetDict({"train": ds}))
    with pytest.raises(ConfigError, match=r"data\.val_files: a int; give a datasets\.Dataset"):
        resolve_config({}, eval_dataset=3)


def test_saved_dataset_folders_go_through_the_row_checks(tiny_task, tmp_path):
    tok = load_tokenizer(str(tiny_task["model"]))
    good = tmp_path / "good"
    Dataset.from_list(rows(tiny_task, 3)).save_to_disk(str(good))
    ds = load_prompt_dataset([good], tok, TextOptions(max_prompt_length=64))
    assert [r["ground_truth"] for r in ds.rows] == [r["answer"] for r in rows(tiny_task, 3)]
    assert ds.rows[0]["uid"] == "good:1"
    bad = tmp_path / "bad"
    bad_rows = [{"prompt": "1+1", "answer": "2"}, {"prompt": "", "answer": "3"}]
    Dataset.from_list(bad_rows).save_to_disk(str(bad))
    with pytest.raises(DataError, match=r"data.train_files: .*bad row 2: prompt"):
        load_prompt_dataset([bad], tok, TextOptions(max_prompt_length=64))
    DatasetDict({"train": Dataset.from_list(rows(tiny_task, 2))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"holds a DatasetDict: name one split's folder .*dd/tr"):
        load_prompt_dataset([tmp_path / "dd"], tok, TextOptions(max_prompt_length=64))
    with pytest.raises(DataError, match=r"not one written by Dataset\.save_to_disk"):
        load_prompt_dataset([tmp_path], tok, TextOptions(max_prompt_length=64))


# --- whole runs ------------------------------------------------------------------------------


def test_train_with_a_batched_reward_and_a_dataset(tiny_task, tmp_path):
    calls = []

    def reward(completions, answer, **kwargs):  # TRL's form
        calls.append({"n": len(completions), "answer": answer, **kwargs})
        return [float(len(c) % 3) for c in completions]

    data = Dataset.from_list(rows(tiny_task, 16))
    result = treadle.train(fast(tiny_task, tmp_path / "run"), reward=reward, train_dataset=data)
    assert result.output_dir == tmp_path / "run" and result.final_model.is_dir()
    (call,) = calls
    assert call["n"] == 8 and len(call["prompts"]) == 8
    assert set(call["answer"]) <= {r["answer"] for r in data}
    cfg = load_config(tmp_path / "run" / "config.yaml")
    assert cfg.reward.function.startswith("python:") and cfg.reward.function.endswith("reward")
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["reward/mean"] == pytest.approx(result.metrics["reward/mean"])


def test_sft_then_dpo_with_datasets_and_a_python_eval_reward(tiny_task, tmp_path):
    """treadle.sft and treadle.dpo take Dataset objects; a Python reward scores DPO's eval."""
    scored = []

    def exact(prompt, response, ground_truth):
        scored.append(ground_truth)
        return float(response.strip().endswith(ground_truth))

    base = fast(tiny_task, tmp_path / "sft")
    base["rollout"]["max_new_tokens"] = 32  # a worked answer's length
    del base["rollout"]["n"]  # RL's samples per prompt: sft and dpo refuse it
    sft = treadle.sft(base, train_dataset=Dataset.from_list(rows(tiny_task, 8)))
    assert sft.metrics["sft/loss"] > 0 and (sft.final_model / "config.json").is_file()
    with open(tiny_task["pairs_train"]) as f:
        pairs = Dataset.from_list([json.loads(line) for line in f][:8])
    base["model"]["path"] = str(sft.final_model)
    base["trainer"]["output_dir"] = str(tmp_path / "dpo")
    dpo = treadle.dpo(base, train_dataset=pairs, eval_dataset=pairs, reward=exact,
                      overrides=["dpo.eval_task=true", "data.val_size=4"])  # fmt: skip
    assert {"dpo/loss", "eval/pair_accuracy", "eval/val/accuracy"} <= set(dpo.metrics)
    assert sorted(scored) == sorted(p["answer"] for p in pairs.select(range(4)))
    assert load_config(dpo.output_dir / "config.yaml").data.val_files == [
        str((tmp_path / "dpo" / "datasets" / "val").absolute())
    ]


def test_python_api_example_runs(tiny_task, tmp_path, monkeypatch, capsys):
    """examples/python_api.py as a user runs it (a per-sample reward in a worker process)."""
    out = tmp_path / "run"
    argv = ["python_api.py", "--data-dir", str(Path(tiny_task["train"]).parent)]
    monkeypatch.setattr(sys, "argv", [*argv, "--output-dir", str(out), "--steps", "1"])
    runpy.run_path(str(ROOT / "examples" / "python_api.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("steps: 1, reward/mean: ") and "held-out accuracy: " in lines[-2]
    assert lines[-1] == f"final model: {out / 'final_model'}"
    assert (out / "final_model" / "config.json").is_file()
    assert load_config(out / "config.yaml").reward.function == "python:__main__.exact_answer"


# --- plugins ---------------------------------------------------------------------------------


def test_a_bad_plugin_is_one_line_naming_algorithm_plugins(tmp_path):
    from treadle.check import check_algorithm

    broken = tmp_path / "broken.py"
    broken.write_text("1 / 0\n")
    cfg = load_config(None, [f"algorithm.plugins=[{broken}]"])
    with pytest.raises(ConfigError, match=r"^algorithm.plugins: importing .*broken.py' raised "
                       r"ZeroDivisionError: division by zero$"):  # fmt: skip
        check_algorithm(cfg, "train")
    cfg = load_config(None, ["algorithm.plugins=[no_such_module_xyz]"])
    with pytest.raises(ConfigError, match=r"^algorithm\.plugins: importing 'no_such_module_xyz' "
                       "raised ModuleNotFoundError"):  # fmt: skip
        check_algorithm(cfg, "train")
    cfg = load_config(None, ["algorithm.plugins=[missing.py]"])
    assert cfg.algorithm.plugins == [str(Path("missing.py").absolute())]
    with pytest.raises(ConfigError, match=r"^algorithm\.plugins: file '.*missing\.py' does not"):
        check_algorithm(cfg, "train")


def test_distill_with_a_dataset_and_a_python_reward(tiny_task, tmp_path):
    """treadle.distill: the teacher is another model folder; the reward is scored, not trained."""
    scored = []

    def reward(prompt, response, ground_truth):
        scored.append(ground_truth)
        return 1.0

    config = fast(tiny_task, tmp_path / "run") | {
        "teacher": {"model_path": str(tiny_task["model"])},
        "distill": {"task_reward": True},  # (the student as its own teacher teaches nothing)
    }
    data = Dataset.from_list(rows(tiny_task, 8))
    result = treadle.distill(config, reward=reward, train_dataset=data)
    # the teacher is the student's own start: the per-token gap starts near 0
    assert abs(result.metrics["distill/reverse_kl"]) < 0.05
    assert result.metrics["reward/mean"] == 1.0 and len(scored) == 8
    assert (result.final_model / "config.json").is_file()
