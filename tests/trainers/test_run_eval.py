"""`treadle eval RUN_DIR`: a run's checkpoints evaluated after the fact give the numbers the
run logged for the same weights (tiny model, greedy; full weights and LoRA adapters), one
eval.jsonl line per step, replaced when a step is evaluated again; `treadle eval MODEL_DIR
--config CONFIG` evaluates a model folder; bad targets are one line naming what is there."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tiny_runs
import yaml
from tiny_models import tiny_family

from treadle.cli import main
from treadle.config import load_config
from treadle.runtime.errors import ConfigError
from treadle.tracking.tracker import read_metrics
from treadle.trainers.run_eval import read_eval_lines, with_sets, write_eval_lines


def _evals(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if k.startswith("eval/")}


def _train_then_evaluate(task, tmp_path, capsys, *extra: str):
    """A 3-step run with a checkpoint and an evaluation at every step, then `treadle eval` of
    its directory: (the run's metrics, eval.jsonl's lines by step)."""
    out = tmp_path / "run"
    reward = tmp_path / "reward.py"  # scores in [0, 1] that move with the weights' answers
    reward.write_text("def score(p, response, g):\n    return sum(map(ord, response)) % 7 / 6\n")
    keys = (
        f"data.val_files=[{task['test']}]",
        "data.val_size=16",
        "data.max_prompt_length=64",
        "rollout.max_new_tokens=8",
        "actor.lr=3e-3",  # the weights move enough for the answers to change
        "trainer.total_steps=3",
        "trainer.save_every=1",
        "trainer.eval_every=1",
        "trainer.keep_last=3",
        "reward.num_workers=0",
        f"reward.function={reward}:score",
        *extra,
    )
    code, logged = tiny_runs.train(out, tiny_runs.overrides(task, out, *keys))
    assert code == 0
    capsys.readouterr()

    # every checkpoint through one set of workers: each step's numbers are the run's own
    assert main(["eval", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"treadle: eval of {out}, steps 1, 2, 3; library messages: ")
    assert [line.split(":")[0] for line in printed[1:]] == ["step 1", "step 2", "step 3", "eval"]
    lines = read_eval_lines(out)
    assert sorted(lines) == [1, 2, 3]
    for record in logged:
        assert _evals(lines[record["step"]]) == _evals(record) != {}
    assert "eval/val/accuracy" in lines[1]
    assert len({lines[s]["eval/val/reward"] for s in lines}) > 1  # each step's own weights
    return out, lines


@pytest.mark.slow
@pytest.mark.parametrize(
    "lora",
    [[], ["actor.lora.rank=4", "actor.lora.alpha=16", "actor.lr=5e-2"]],  # (B starts at 0)
    ids=["full", "lora"],
)
def test_checkpoints_give_the_numbers_their_steps_logged(tiny_task, tmp_path, capsys, lora):
    out, lines = _train_then_evaluate(tiny_task, tmp_path, capsys, "trainer.backend=local", *lora)

    # again, on step 2 only, on another set: its line is replaced, the others stay
    assert main(["eval", str(out), "--steps", "2", "--set", f"other={tiny_task['test']}"]) == 0
    again = read_eval_lines(out)
    assert again[1] == lines[1] and again[3] == lines[3]
    assert set(_evals(again[2])) == {k.replace("/val/", "/other/") for k in _evals(lines[2])}

    # a model folder with a config: the final model is step 3's
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump(yaml.safe_load((out / "config.yaml").read_text())))
    assert main(["eval", str(out / "final_model"), "--config", str(config)]) == 0
    accuracy = 100 * lines[3]["eval/val/accuracy"]
    assert f"held-out accuracy: {accuracy:.1f}%" in capsys.readouterr().out
    if not lora:  # sampled, with the overrides after --config: the sampled metrics are shown
        argv = ["eval", str(out / "final_model"), "--config", str(config), "eval.n=2"]
        assert main([*argv, "eval.temperature=1.0"]) == 0
        shown = capsys.readouterr().out.splitlines()[-1].split("  ")
        assert {"eval/val/pass@2", "eval/val/maj@2"} <= {item.split(" ")[0] for item in shown}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "olmo2"])
def test_model_families_vllm_runs_its_own_way(family, tiny_task, ray_session, tmp_path, capsys):
    """The same through vLLM under Ray (the replica in the actor's Ray process, weights synced
    into it per checkpoint), where the actor's log-probs of every step's samples are vLLM's and
    the checkpoints load back, for two families vLLM runs its own way (the default family, a
    Llama, runs through vLLM under Ray in `tests/rollout/test_fleet.py` and elsewhere):

    - a Mixtral, whose experts transformers 5 holds fused (its files: a matrix an expert): the
      weights vLLM is sent are as the files hold them, and on CPU its experts are repacked
      after each update (vLLM's CPU build repacks them on the first load only);
    - an OLMo 2, which vLLM runs on transformers' own code, decorating the decoder class for
      torch.compile in place: the actor's model of that class, in the same process, failed its
      first update until the class was put back (`engines/vllm/slot.py`)."""
    task = {**tiny_task, "model": tiny_family(tmp_path / family, tiny_task["model"], family)}
    out, _ = _train_then_evaluate(task, tmp_path, capsys, "rollout.engine=vllm", "actor.lr=3e-2")
    logged = read_metrics(out)
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert all(r["actor/grad_norm"] > 0 for r in logged)  # the weights vLLM gets change
    assert max(r["rollout/logprob_diff_max"] for r in logged) < 1e-4  # (measured ~1e-6)


@pytest.mark.slow
def test_a_family_whose_weights_vllm_cannot_update_stops_at_the_first_sync(
    tiny_task, ray_session, tmp_path, capsys
):
    """gpt-oss: vLLM 0.32's loader copies its experts and attention sinks itself, past the
    in-place reload, which then keeps their old weights (measured: log-probs off by up to 0.7
    from the actor's after one sync). The run stops at its first sync, before a step, with
    the fix named, instead of training on samples from stale weights."""
    model = tiny_family(tmp_path / "gpt_oss", tiny_task["model"], "gpt_oss")
    out = tmp_path / "run"
    task = {**tiny_task, "model": model}
    keys = ("rollout.engine=vllm", "data.max_prompt_length=64")
    code, logged = tiny_runs.train(out, tiny_runs.overrides(task, out, *keys))
    assert (code, logged) == (2, [])
    pattern = (
        r"^treadle: error: rollout\.engine=vllm: vLLM kept the old weights of 10 parameters "
        r"through a weight update \(e\.g\. \['model\.layers\.0\.attn\.sinks', "
        r"'model\.layers\.0\.mlp\.experts\.routed_experts\.w13_weight'\]\): its loader for "
        r"GptOssForCausalLM copies them itself, past the in-place reload, so the rollout would "
        r"sample from stale weights; rollout\.engine=hf trains this model$"
    )
    assert re.search(pattern, capsys.readouterr().err, re.MULTILINE)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory with a config and two sealed checkpoints (no weights needed: the
    command stops before it loads any)."""
    from treadle.models import checkpoint as ckpt

    (tmp_path / "config.yaml").write_text("trainer:\n  backend: local\n")
    for step in (2, 4):
        tmp = ckpt.begin(tmp_path, step)
        (tmp / "model").mkdir()
        ckpt.commit(tmp, {"step": step}, ckpt.Retention(5))
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{d}/nope"], "{d}/nope: no such file or directory"),
        (["{d}/checkpoints"], "{d}/checkpoints is neither a run directory (no config.yaml) nor"),
        (
            ["{d}", "--steps", "2,3,5"],
            "{d} has no checkpoint of step 3, 5; its checkpoints are of steps 2, 4",
        ),
        (["{d}", "--steps", "two"], "--steps 'two': give step numbers separated by commas"),
        (["{d}", "--set", "hard"], "--set 'hard': give it as name=FILE"),
        (["{d}", "--config", "{d}/config.yaml"], "{d} is a run directory, evaluated with its own"),
        (["{d}/config.yaml", "--steps", "2"], "--steps picks checkpoints of a run directory"),
    ],
)
def test_a_bad_target_is_one_line_naming_what_is_there(run_dir, capsys, argv, message):
    assert main(["eval", *(a.format(d=run_dir) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"treadle: error: {message.format(d=run_dir)}"), err
    assert err.count("\n") == 1


def test_a_run_without_checkpoints_and_a_model_folder_without_config(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    assert main(["eval", str(tmp_path / "run")]) == 2
    assert f"{tmp_path / 'run'} has no checkpoint in" in capsys.readouterr().err
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert main(["eval", str(tmp_path / "model")]) == 2
    assert "is a model folder: give the config of the evaluation" in capsys.readouterr().err


def test_eval_lines_are_one_per_step_in_order_and_replaced(tmp_path):
    write_eval_lines(tmp_path, {4: {"eval/val/accuracy": 0.5}, 2: {"eval/val/accuracy": 0.25}})
    write_eval_lines(tmp_path, {4: {"eval/hard/accuracy": 0.75}})
    text = (tmp_path / "eval.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in text] == [
        {"step": 2, "eval/val/accuracy": 0.25},
        {"step": 4, "eval/hard/accuracy": 0.75},
    ]


def test_set_options_replace_the_run_s_sets(tmp_path):
    files = {"data": {"val_files": ["a.jsonl"], "val_sets": {"hard": {"files": ["h.jsonl"]}}}}
    data = load_config(files).data
    assert data.set_names == ["val", "hard"]
    sets = {"val": "b.jsonl", "other": "o.jsonl"}
    data = load_config({"data": with_sets(files["data"], sets)}).data
    assert data.set_names == ["val", "other"] and data.val_files == ["b.jsonl"]
    assert data.val_sets["other"].files == ["o.jsonl"]
    gym = {"source": "reasoning_gym", "reasoning_gym": {"datasets": [{"name": "leg_counting"}]}}
    data = load_config({"data": with_sets(gym, {"other": "o.jsonl"})}).data
    assert data.set_names == ["other"]  # reasoning-gym's held-out rows are no set now
    with pytest.raises(ConfigError, match=r"--set val=\.\.\.: the run's rows are reasoning-gym's"):
        with_sets(gym, {"val": "b.jsonl"})
