"""Config: YAML + overrides, unknown keys, wrong types, cross-field rules, the dump."""

from __future__ import annotations

import pytest
import yaml

from treadle.config import load_config
from treadle.config.rules import check_algorithm
from treadle.runtime.errors import ConfigError


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_are_typed(tmp_path):
    path = write(tmp_path, "trainer:\n  total_steps: 5\nactor:\n  lr: 1e-4\n")
    cfg = load_config(
        path,
        [
            "trainer.total_steps=7",
            "data.train_files=[a.jsonl, b.jsonl]",
            "algorithm.clip_ratio_c=null",
            "rollout.temperature=0.5",
        ],
    )
    assert cfg.trainer.total_steps == 7
    assert cfg.actor.lr == pytest.approx(1e-4)
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.algorithm.clip_ratio_c is None
    assert cfg.rollout.temperature == 0.5
    assert cfg.trainer.save_every == 0  # untouched default


def test_a_hash_in_an_override_is_kept_not_read_as_a_comment():
    """YAML reads ` #` as a comment: the value was cut there (a system prompt 'You are #1'
    became 'You are', an output directory '.../out #2' another directory)."""
    cfg = load_config(
        None,
        [
            "model.path=m",
            "data.system_prompt=You are #1. Answer with a number.",
            "trainer.output_dir=runs/out #2",
            "data.train_files=[a.jsonl, b #c.jsonl]",
            "trainer.total_steps=3",
        ],
    )
    assert cfg.data.system_prompt == "You are #1. Answer with a number."
    assert cfg.trainer.output_dir == "runs/out #2"
    assert cfg.data.train_files == ["a.jsonl", "b #c.jsonl"]
    assert cfg.trainer.total_steps == 3


def test_a_home_in_the_output_dir_is_the_users_home(monkeypatch, tmp_path):
    """``treadle check`` created ``~/runs/x`` in the home while the run wrote to ``./~/runs/x``:
    the config expands it once, for both."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["model.path=m", "trainer.output_dir=~/runs/x"])
    assert cfg.trainer.output_dir == f"{tmp_path}/runs/x"


def test_misspelt_override_names_key_and_suggestion():
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'trainer\.totl_steps'.*did you mean "
        r"'trainer\.total_steps'",
    ):
        load_config(None, ["trainer.totl_steps=2"])


def test_unknown_section_suggests_closest(tmp_path):
    path = write(tmp_path, "algoritm:\n  kl_coef: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'algoritm'.*did you mean 'algorithm'"):
        load_config(path)


def test_wrong_type_names_key_type_and_value():
    with pytest.raises(ConfigError, match=r"trainer\.total_steps: .*integer.*'many'"):
        load_config(None, ["trainer.total_steps=many"])
    with pytest.raises(ConfigError, match=r"rollout\.engine: .*'hf' or 'vllm'.*'vlm'"):
        load_config(None, ["rollout.engine=vlm"])


def test_cross_field_rules_say_what_to_change():
    with pytest.raises(
        ConfigError,
        match=r"data\.batch_size=3 must be divisible by "
        r"actor\.world_size=2",
    ):
        load_config(None, ["data.batch_size=3", "actor.world_size=2"])
    # PPO's mini-batches are an RL command's rule (treadle.check.run, the RL trainers), not sft's
    cfg = load_config(None, ["data.batch_size=16", "rollout.n=4", "actor.ppo_mini_batch_size=48"])
    with pytest.raises(ConfigError, match=r"ppo_mini_batch_size=48 must divide"):
        check_algorithm(cfg, "train")
    check_algorithm(cfg, "sft")
    with pytest.raises(ConfigError, match=r"trainer\.backend=local .* actor\.world_size=1"):
        load_config(None, ["trainer.backend=local", "actor.world_size=2"])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config(None, ["trainer.total_steps"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_dump_is_complete_and_reloads(tmp_path):
    from treadle.config import dump_config

    cfg = load_config(None, ["trainer.total_steps=3", "actor.betas=[0.8, 0.9]"])
    out = tmp_path / "run" / "config.yaml"
    dump_config(cfg, out)
    data = yaml.safe_load(out.read_text())
    assert set(data) == {
        "model",
        "data",
        "rollout",
        "reward",
        "algorithm",
        "dpo",
        "kto",
        "actor",
        "critic",
        "prime",
        "teacher",
        "distill",
        "trainer",
        "eval",
        "async",
    }
    assert data["trainer"]["total_steps"] == 3
    assert data["async"]["max_staleness"] == 1
    assert load_config(out) == cfg


def test_rollout_ignore_eos_reaches_the_sampling_params():
    from treadle.rollout.sources import sampling_params

    for value in (False, True):
        cfg = load_config(None, [f"rollout.ignore_eos={str(value).lower()}"])
        params = sampling_params(cfg, 3)
        assert params.ignore_eos is value


def test_yaml_merge_keys_still_work_and_duplicates_do_not(tmp_path):
    text = "rollout: &r\n  n: 2\n  top_k: 5\nrollout_copy: 1\n"
    path = write(tmp_path, "base: &b {n: 2, top_k: 5}\nrollout:\n  <<: *b\n  n: 4\n")
    with pytest.raises(ConfigError, match=r"unknown key 'base'"):  # merged fine, 'base' unknown
        load_config(path)
    path = write(tmp_path, "rollout:\n  <<: {n: 2, top_k: 5}\n  n: 4\n")
    cfg = load_config(path)
    assert (cfg.rollout.n, cfg.rollout.top_k) == (4, 5)
    path = write(tmp_path, text.replace("rollout_copy: 1\n", "rollout:\n  n: 3\n"))
    with pytest.raises(ConfigError, match=r"run\.yaml: line 4: key 'rollout' is given twice"):
        load_config(path)


def test_every_policy_loss_knob_has_a_settings_class_and_reads_back_by_name():
    from treadle.algorithms import LOSS_AGG_MODES, POLICY_LOSSES
    from treadle.config import SETTINGS, AlgorithmConfig

    owners = {key: name for name, cls in SETTINGS.items() for key in cls.model_fields}
    assert sum(len(cls.model_fields) for cls in SETTINGS.values()) == len(owners)  # one each
    knobs = POLICY_LOSSES.all_knobs() | LOSS_AGG_MODES.all_knobs()
    assert knobs <= owners.keys(), knobs - owners.keys()
    alg = load_config(None, ["algorithm.clip_cov_ratio=0.01"]).algorithm
    assert alg.settings("clip_cov").model_dump() == {
        "clip_cov_ratio": 0.01,
        "clip_cov_lb": 1.0,
        "clip_cov_ub": 5.0,
    }
    assert set(AlgorithmConfig.model_fields) - owners.keys() == {
        "adv_estimator",
        "policy_loss",
        "entropy_coef",
        "plugins",
    }
