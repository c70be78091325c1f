"""Bad input never gives a traceback: `treadle check` (and every command, which checks first)
exits 2 with `treadle: error: ...` lines naming the key, file or row (issue 15 items 7, 8).

Each case runs `treadle.cli.main` in-process on a good config made bad in one way: a field with
a value out of its type or bounds, a cross-field rule, YAML syntax, an override, a model or
tokenizer folder, a data file or row, the reward function, the output directory. The good
config is checked too (exit 0 and the summary). Nothing here starts Ray or loads weights.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from treadle.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_bad(result: tuple[int, str, str], pattern: str, lines: int | None = None) -> None:
    code, out, err = result
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    errors = [line for line in err.splitlines() if line.startswith("treadle: error: ")]
    assert errors, err
    assert re.search(pattern, "\n".join(errors)), err
    if lines is not None:
        assert len(errors) == lines, err


def check(env, capsys, *overrides: str, kind: str = "train", config: str | None = None):  # type: ignore[no-untyped-def]
    return run(capsys, "check", config or env["config"], *overrides, "--kind", kind)


def write(env, name: str, content: str | bytes) -> str:  # type: ignore[no-untyped-def]
    path = Path(env["root"]) / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


# --- the good case -----------------------------------------------------------------------------


def test_ppo_mini_batches_are_a_rule_of_rl_commands_only(env, capsys) -> None:  # type: ignore[no-untyped-def]
    """sft, dpo, kto and rm take one optimizer step a batch: a batch size PPO's mini-batches
    do not divide was refused for them, naming keys they never read."""
    bad = ["data.batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=32"]
    code, _, err = check(env, capsys, *bad, kind="sft")
    assert code == 0, err
    assert_bad(check(env, capsys, *bad), r"actor\.ppo_mini_batch_size=32 must divide data\.batch")


@pytest.mark.parametrize("kind", ["train", "sft", "eval", "dpo", "rm"])
def test_good_config_passes_with_a_summary(env, capsys, kind: str) -> None:  # type: ignore[no-untyped-def]
    pairs = [f"data.train_files=[{env['pairs']}]", f"data.val_files=[{env['pairs']}]"]
    code, out, err = check(env, capsys, *(pairs if kind in ("dpo", "rm") else []), kind=kind)
    assert code == 0, err
    assert re.search(r"^model: .*model_init \(context 128 tokens\)$", out, re.M)
    files = ("pairs.jsonl", 16) if kind in ("dpo", "rm") else ("train.jsonl", 40)
    if kind != "eval":
        assert re.search(rf"^data\.train_files: .*{files[0]}: {files[1]} rows$", out, re.M)
        assert re.search(r"^trainer\.output_dir: .*run \(new\)$", out, re.M)
    if kind in ("train", "eval", "sft"):
        assert re.search(r"^data\.val_files: .*test\.jsonl: 8 rows$", out, re.M)
        assert "reward.function: arithmetic" in out
    assert out.strip().endswith(f"ok: ready for `treadle {kind}`")
    assert not (Path(env["root"]) / "run").exists()  # a check writes nothing


def test_named_validation_sets_are_checked(env, capsys) -> None:  # type: ignore[no-untyped-def]
    """data.val_sets: each set's rows and reward are checked, each problem names its key."""
    hard = f"data.val_sets={{hard: {{files: [{env['test']}], reward: chat_arithmetic, size: 4}}}}"
    code, out, err = check(env, capsys, hard)
    assert code == 0, err
    assert re.search(r"^data\.val_sets\.hard: 8 rows$", out, re.M)
    assert "data.val_sets.hard.reward: chat_arithmetic" in out
    assert "all 8 are evaluated" not in out  # (size 4 of 8)
    # a size beyond the rows: all are evaluated, which the summary says (it was silent)
    code, out, err = check(env, capsys, hard.replace("size: 4", "size: 100"), "data.val_size=50")
    assert code == 0, err
    assert "data.val_sets.hard.size=100: the set has 8 rows, so all 8 are evaluated" in out
    assert "data.val_size=50: the set has 8 rows, so all 8 are evaluated" in out
    # the sets alone are enough for treadle eval
    code, out, err = check(env, capsys, hard, "data.val_files=[]", kind="eval")
    assert code == 0, err
    missing = str(Path(env["root"]) / "missing.jsonl")
    assert_bad(
        check(env, capsys, f"data.val_sets={{hard: {{files: [{missing}]}}}}"),
        r"data\.val_sets\.hard\.files: file '.*missing\.jsonl' does not exist",
    )
    assert_bad(
        check(
            env, capsys, f"data.val_sets={{hard: {{files: [{env['test']}], reward: arithmtic}}}}"
        ),
        r"data\.val_sets\.hard\.reward: unknown reward 'arithmtic' \(did you mean 'arithmetic'\?\)",
    )
    assert_bad(
        check(env, capsys, f"data.val_sets={{val: {{files: [{env['test']}]}}}}"),
        r"data\.val_sets\.val: the name val is the set of data\.val_files; give this set "
        r"another name",
    )
    assert_bad(
        check(env, capsys, f"data.val_sets={{hard: {{file: [{env['test']}]}}}}"),
        r"data\.val_sets\.hard\.file: ",
    )
    assert_bad(
        check(env, capsys, "data.val_sets={hard: {}}"), r"data\.val_sets\.hard: give its files"
    )
    assert_bad(
        check(env, capsys, f"data.val_sets={{a/b: {{files: [{env['test']}]}}}}"),
        r"data\.val_sets\.a/b: a set's name is letters",
    )
    assert_bad(check(env, capsys, "eval.n=0"), r"eval\.n: ")
    assert_bad(check(env, capsys, "eval.n=4"), r"eval\.n=4 with eval\.temperature=0 draws 4 equal")
    assert_bad(check(env, capsys, "eval.top_p=1.5"), r"eval\.top_p: ")


def test_keep_best_passes_when_every_save_step_is_evaluated(env, capsys) -> None:  # type: ignore[no-untyped-def]
    keys = ["trainer.keep_best=eval/val/accuracy", "trainer.final_model=best"]
    code, _, err = check(env, capsys, *keys, "trainer.save_every=4", "trainer.eval_every=2")
    assert code == 0, err
    hard = f"data.val_sets={{hard: {{files: [{env['test']}]}}}}"  # a named set ranks too
    code, _, err = check(env, capsys, hard, "trainer.keep_best=eval/hard/pass@4")
    assert code == 0, err


# --- field types and bounds ----------------------------------------------------------------------

BAD_FIELDS = {
    "model.dtype": ["float16"],
    "model.allow_download": ["maybe"],
    "data.train_files": ["5"],
    "data.prompt_key": [""],
    "data.answer_key": ["[a]"],
    "data.max_prompt_length": ["0", "-1", "1.5", "abc", "nan"],
    "data.overlong_prompts": ["drop"],
    "data.apply_chat_template": ["sometimes"],
    "data.batch_size": ["0", "-4", "inf"],
    "data.val_size": ["0", "-1"],
    "data.allow_special_tokens": ["2"],
    "rollout.engine": ["vlm"],
    "rollout.dtype": ["float16"],
    "rollout.n": ["0", "-1", "2.5", "true"],
    "rollout.temperature": ["0", "-1", "nan", "inf", ".nan"],
    "rollout.top_p": ["0", "1.5", "nan", "-0.5"],
    "rollout.top_k": ["0", "-2", "1.5"],
    "rollout.max_new_tokens": ["0", "-8"],
    "rollout.micro_batch_size": ["0"],
    "rollout.cache_implementation": ["compiled"],
    "rollout.weight_sync_bucket_mb": ["0", "inf"],
    "rollout.kv_cache_gib": ["-1", "nan"],
    "rollout.gpu_memory_utilization": ["0", "1.1", "nan"],
    "rollout.placement": ["both"],
    "rollout.replicas": ["0", "true"],
    "rollout.tensor_parallel_size": ["0"],
    "rollout.num_cpus": ["0", "-1", "inf"],
    "rollout.ray_resources": ["{gpu: -1}", "{gpu: nan}", "[1]"],
    "rollout.max_inflight_per_replica": ["0"],
    "rollout.request_timeout_s": ["0", "nan", "inf"],
    "rollout.max_restarts": ["-1", "1.5", "true"],
    "rollout.max_turns": ["0"],
    "rollout.max_tool_response_tokens": ["0"],
    "rollout.tool_timeout_s": ["-1"],
    "rollout.max_concurrent_trajectories": ["0"],
    "rollout.max_response_length": ["0"],
    "rollout.agent_loop": [""],
    "reward.function": [""],
    "reward.overlong_buffer_len": ["-1"],
    "reward.overlong_penalty": ["-1", "nan"],
    "reward.micro_batch_size": ["0"],
    "reward.num_workers": ["-1"],
    "reward.timeout_s": ["0", "inf"],
    "algorithm.norm_adv_by_std": ["perhaps"],
    "algorithm.gamma": ["-0.1", "1.5", "nan"],
    "algorithm.lam": ["-1", "2", "inf"],
    "algorithm.clip_ratio_low": ["-0.1", "inf"],
    "algorithm.clip_ratio_high": ["-1", "nan"],
    "algorithm.clip_ratio_c": ["1", "0.5", "nan"],
    "algorithm.kl_coef": ["-1", "nan"],
    "algorithm.kl_reward_coef": ["-1", "inf"],
    "algorithm.kl_target": ["0", "inf"],
    "algorithm.kl_horizon": ["0"],
    "algorithm.max_gen_rounds": ["0"],
    "algorithm.entropy_coef": ["nan", "inf", "-inf"],
    "algorithm.rollout_correction": ["yes"],
    "algorithm.rollout_correction_cap": ["1", "nan"],
    "dpo.beta": ["0", "nan"],
    "dpo.label_smoothing": ["0.5", "-0.1"],
    "dpo.nll_coef": ["-1"],
    "actor.world_size": ["0"],
    "actor.lr": ["0", "-1", "nan", "inf", "true"],
    "actor.weight_decay": ["-1"],
    "actor.betas": ["[1.0, 0.9]", "[0.9, -0.1]", "[nan, 0.9]", "[0.9]", "0.9"],
    "actor.warmup_steps": ["-1"],
    "actor.grad_clip": ["0", "nan"],
    "actor.ppo_epochs": ["0"],
    "actor.ppo_mini_batch_size": ["0"],
    "actor.micro_batch_size": ["0"],
    "actor.logprob_chunk_size": ["0"],
    "actor.pack_row_tokens": ["0"],
    "actor.mixed_precision": ["fp16"],
    "actor.max_tokens_per_micro_batch": ["0"],
    "critic.enable": ["often"],
    "critic.placement": ["x"],
    "critic.world_size": ["0"],
    "critic.lr": ["0", "nan"],
    "critic.weight_decay": ["-1"],
    "critic.grad_clip": ["0"],
    "critic.cliprange_value": ["0"],
    "critic.ppo_epochs": ["0"],
    "critic.ppo_mini_batch_size": ["0"],
    "critic.micro_batch_size": ["0"],
    "critic.warmup_steps": ["-1"],
    "trainer.backend": ["slurm"],
    "trainer.output_dir": [""],
    "trainer.total_steps": ["0", "-1"],
    "trainer.epochs": ["0", "-1"],
    "trainer.save_every": ["-1"],
    "trainer.keep_last": ["0"],
    "trainer.eval_every": ["-1"],
    "trainer.seed": ["-1", "4294967296", "1.5", "false"],
    "trainer.resume": ["perhaps"],
    "trainer.num_cpus": ["0", "-2", "nan"],
    "trainer.threads_per_rank": ["0", "-1"],
    "trainer.mode": ["fast"],
    "async.max_staleness": ["-1"],
    "async.sync_every": ["0"],
    "async.buffer_groups": ["0"],
}


@pytest.mark.parametrize(
    ("key", "value"), [(k, v) for k, values in BAD_FIELDS.items() for v in values]
)
def test_bad_field_names_the_key(env, capsys, key: str, value: str) -> None:  # type: ignore[no-untyped-def]
    assert_bad(check(env, capsys, f"{key}={value}"), rf"^treadle: error: {re.escape(key)}\b")


def test_several_bad_fields_are_all_listed(env, capsys) -> None:  # type: ignore[no-untyped-def]
    result = check(env, capsys, "rollout.n=0", "actor.lr=nan", "trainer.seed=-1")
    assert_bad(result, r"rollout\.n:(.|\n)*actor\.lr:(.|\n)*trainer\.seed:", lines=3)


# --- cross-field rules -------------------------------------------------------------------------

RAY2 = ("trainer.backend=ray", "actor.world_size=2")

CROSS_FIELD = [
    (["reward.overlong_buffer_len=32"], r"reward\.overlong_buffer_len=32 must be smaller"),
    (["actor.ppo_mini_batch_size=24"], r"actor\.ppo_mini_batch_size=24 must divide"),
    (["actor.world_size=2"], r"trainer\.backend=local runs one rank.*actor\.world_size=1"),
    (["trainer.backend=ray", "actor.world_size=3"], r"data\.batch_size=8 must be divisible"),
    (
        ["algorithm.filter_groups=true", "rollout.n=1", "actor.ppo_mini_batch_size=8"],
        r"filter_groups",
    ),
    (["critic.placement=split"], r"critic\.placement=colocated"),
    (["rollout.placement=split"], r"rollout\.placement=colocated"),
    (["rollout.num_cpus=1"], r"rollout\.num_cpus and rollout\.ray_resources"),
    (["rollout.tools=[m:f]"], r"rollout\.tools are called by an agent loop"),
    (["rollout.agent_loop=tools"], r"rollout\.agent_loop=tools needs rollout\.tools"),
    (["trainer.mode=async"], r"trainer\.mode=async .*rollout\.placement=split"),
    (["actor.recompute_old_log_probs=false", "actor.ppo_epochs=2"], r"recompute_old_log_probs"),
    (["rollout.replicas=2"], r"rollout\.replicas=2 must equal actor\.world_size"),
    (["critic.ppo_mini_batch_size=24"], r"critic\.ppo_mini_batch_size=24 must divide"),
    (["rollout.n=1", "actor.ppo_mini_batch_size=8"], r"adv_estimator=grpo .*rollout\.n=1"),
    (["rollout.n=1", "actor.ppo_mini_batch_size=8", "algorithm.adv_estimator=rloo"], r"rloo"),
    (
        ["rollout.top_k=1"],
        r"rollout\.top_k=1 is greedy: the rollout\.n=\d+ samples of a prompt are all the same, "
        r"so algorithm\.adv_estimator=grpo's group baseline makes every advantage 0",
    ),
    (["algorithm.policy_loss=gspo"], r"loss_agg_mode=token-mean cannot be used with .*gspo"),
    (
        ["algorithm.policy_loss=vanilla", "algorithm.sapo_tau_pos=2"],
        r"algorithm\.sapo_tau_pos=2\.0 is not read by algorithm\.policy_loss=vanilla \(it reads "
        r"clip_ratio_c, clip_ratio_high, clip_ratio_low\): remove algorithm\.sapo_tau_pos",
    ),
    (
        ["algorithm.adv_estimator=grpoo"],
        r"algorithm\.adv_estimator: .*'grpoo'.*did you mean 'grpo'",
    ),
    (["algorithm.policy_loss=pp0"], r"algorithm\.policy_loss: unknown .*valid: .*ppo"),
    (["algorithm.loss_agg_mode=mean"], r"algorithm\.loss_agg_mode: unknown .*token-mean"),
    (["algorithm.kl_estimator=k4"], r"algorithm\.kl_estimator: unknown .*k3"),
    (["algorithm.kl_reward_estimator=k5"], r"algorithm\.kl_reward_estimator: unknown"),
    (["data.max_prompt_length=100"], r"data\.max_prompt_length=100 \+ rollout\.max_new_tokens=32"),
    (["rollout.max_new_tokens=100"], r"max_position_embeddings=128"),
    (["eval.max_new_tokens=500"], r"data\.max_prompt_length=\d+ \+ eval\.max_new_tokens=500 = "),
    (["algorithm.clip_ratio_low=1.5"], r"algorithm\.clip_ratio_low: input should be less than 1"),
    (
        ["algorithm.policy_loss=clip_cov", "algorithm.clip_cov_lb=10", "algorithm.clip_cov_ub=1"],
        r"algorithm\.clip_cov_lb=10 must be below algorithm\.clip_cov_ub=1",
    ),
    (["trainer.final_model=best"], r"trainer\.final_model=best .*set trainer\.keep_best"),
    (
        ["trainer.keep_best=eval/val/accuracy", "trainer.save_every=4", "trainer.eval_every=3"],
        r"trainer\.save_every=4 saves at steps trainer\.eval_every=3 does not evaluate: set "
        r"trainer\.eval_every to 4",
    ),
    (
        ["trainer.keep_best=eval/val/accuracy", "trainer.save_every=4"],
        r"trainer\.eval_every=0 does not evaluate",
    ),
    (
        ["trainer.keep_best=eval/val/accuracy", "data.val_files=[]"],
        r"keep_best=eval/val/accuracy .*no validation set: set data\.val_files or data\.val_sets",
    ),
    (
        ["trainer.keep_best=eval/test/accuracy"],
        r"names the set 'test', which the run does not evaluate; its sets: val",
    ),
    (["trainer.keep_best=val/accuracy"], r"trainer\.keep_best: name an evaluation metric as eval/"),
    (
        ["actor.min_lr_ratio=0.1"],
        r"actor\.min_lr_ratio=0\.1 is the floor of a decaying lr, but actor\.lr_schedule=constant "
        r"never decays: set actor\.lr_schedule=cosine \(or linear\), or drop actor\.min_lr_ratio",
    ),
    (["critic.min_lr_ratio=0.5"], r"critic\.min_lr_ratio=0\.5 .*critic\.lr_schedule=constant"),
    # tensor and sequence parallel layouts (the tiny model: 2 heads, 1 key/value head)
    (
        [*RAY2, "actor.tensor_parallel_size=2", "actor.sequence_parallel_size=2"],
        r"actor\.tensor_parallel_size=2 and actor\.sequence_parallel_size=2: .*set one to 1",
    ),
    (
        [*RAY2, "actor.tensor_parallel_size=4"],
        r"actor\.world_size=2 must be divisible by actor\.tensor_parallel_size=4",
    ),
    (
        [*RAY2, "critic.sequence_parallel_size=4"],
        r"critic\.world_size=2 must be divisible by critic\.sequence_parallel_size=4",
    ),
    (
        [*RAY2, "actor.sequence_parallel_size=2", "actor.remove_padding=false"],
        r"actor\.sequence_parallel_size=2 splits packed rows: set actor\.remove_padding=true",
    ),
    ([*RAY2, "actor.tensor_parallel_size=2", "actor.lora.rank=4"], r"actor\.lora\.rank > 0 with"),
    (
        [*RAY2, "actor.tensor_parallel_size=2"],
        r"actor\.tensor_parallel_size=2 must divide the model's num_key_value_heads=1",
    ),
    (
        [*RAY2, "critic.sequence_parallel_size=2"],
        r"critic\.sequence_parallel_size=2 must divide the model's num_key_value_heads=1",
    ),
    (["rollout.tensor_parallel_size=2"], r"rollout\.tensor_parallel_size=2 splits a vLLM replica"),
    (
        ["rollout.tensor_parallel_size=2", "rollout.engine=vllm"],
        r"rollout\.tensor_parallel_size=2 needs rollout\.placement=split",
    ),
    (
        ["rollout.cache_implementation=static", "rollout.engine=vllm"],
        r"rollout\.cache_implementation=static is the hf engine's .*set rollout\.engine=hf",
    ),
    (
        ["rollout.cache_implementation=paged", "rollout.engine=vllm"],
        r"rollout\.cache_implementation=paged is the hf engine's .*set rollout\.engine=hf",
    ),
]


@pytest.mark.parametrize(("overrides", "pattern"), CROSS_FIELD)
def test_cross_field_rule_says_what_to_change(env, capsys, overrides, pattern) -> None:  # type: ignore[no-untyped-def]
    assert_bad(check(env, capsys, *overrides), pattern)


def test_broken_rules_are_all_listed(env, capsys) -> None:  # type: ignore[no-untyped-def]
    result = check(env, capsys, "reward.overlong_buffer_len=32", "actor.min_lr_ratio=0.1")
    assert_bad(result, r"overlong_buffer_len(.|\n)*min_lr_ratio", lines=2)
    names = check(env, capsys, "algorithm.kl_estimator=k4", "algorithm.policy_loss=pp0")
    assert_bad(names, r"policy_loss(.|\n)*kl_estimator", lines=2)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["dpo.loss_type=sigmoidd"], r"dpo\.loss_type: unknown .*sigmoid"),
        (["dpo.eval_task=true", "data.val_files=[]"], r"dpo\.eval_task=true needs data\.val_files"),
        (["dpo.label_smoothing=0.1", "dpo.loss_type=ipo"], r"dpo\.label_smoothing=0\.1 is not"),
    ],
)
def test_dpo_rules(env, capsys, overrides, pattern) -> None:  # type: ignore[no-untyped-def]
    pairs = f"data.train_files=[{env['pairs']}]"
    assert_bad(check(env, capsys, pairs, *overrides, kind="dpo"), pattern)


# --- YAML files ------------------------------------------------------------------------------

YAML_CASES = [
    (
        "data:\n  batch_size: [8\nrollout:\n  n: 4\n",
        r"bad\.yaml: line \d+, column \d+: YAML syntax",
    ),
    ("data:\n\tbatch_size: 8\n", r"bad\.yaml: line 2, column 1: YAML syntax"),
    (
        "data:\n  batch_size: 8\n  batch_size: 4\n",
        r"bad\.yaml: line 3: key 'batch_size' is given twice",
    ),
    ("data:\n  batch_size: 8\ndata:\n  shuffle: false\n", r"line 3: key 'data' is given twice"),
    ("- data\n- rollout\n", r"bad\.yaml: the top level must be a mapping"),
    ("data: 5\n", r"'data' is a section: give it a mapping"),
    ("algoritm:\n  kl_coef: 0.1\n", r"unknown key 'algoritm'.*did you mean 'algorithm'"),
    (
        "data:\n  batch_sise: 8\n",
        r"unknown key 'data\.batch_sise'.*did you mean 'data\.batch_size'",
    ),
    ("data: {batch_size: 8\n", r"bad\.yaml: line \d+, column \d+"),
    ("key: 'unclosed\n", r"bad\.yaml: line \d+, column \d+"),
    ("trainer:\n  seed: *anchor\n", r"bad\.yaml: line 2, column \d+"),
    ("trainer:\n\tseed: 1\n", r"bad\.yaml: line 2, column 1: .* \(YAML indents with spaces"),
    ("", r"model\.path is empty"),
]


@pytest.mark.parametrize(("text", "pattern"), YAML_CASES)
def test_bad_yaml_names_file_line_and_column(env, capsys, text, pattern) -> None:  # type: ignore[no-untyped-def]
    path = write(env, "bad.yaml", text)
    assert_bad(run(capsys, "check", path, f"trainer.output_dir={env['root']}/y"), pattern)


def test_config_file_problems(env, capsys) -> None:  # type: ignore[no-untyped-def]
    assert_bad(run(capsys, "check", str(Path(env["root"]) / "nope.yaml")), r"config file not found")
    latin = write(env, "latin.yaml", b"data:\n  prompt_key: caf\xe9\n")
    assert_bad(run(capsys, "check", latin), r"latin\.yaml: not UTF-8")


# --- overrides -------------------------------------------------------------------------------

OVERRIDES = [
    ("trainer.total_steps", r"override 'trainer\.total_steps' is not of the form"),
    ("=5", r"override '=5' is not of the form"),
    ("trainer..seed=1", r"override 'trainer\.\.seed=1' is not of the form"),
    ("trainer.totl_steps=2", r"'trainer\.totl_steps'.*did you mean 'trainer\.total_steps'"),
    ("trainr.seed=1", r"unknown key 'trainr'.*did you mean 'trainer'"),
    (
        "trainer.keep_checkpoints=3",
        r"unknown key 'trainer\.keep_checkpoints'.*it is now 'trainer\.keep_last'",
    ),
    ("data.train_files=[a", r"override 'data\.train_files=\[a': the value is not valid YAML"),
    ("data.prompt_key={a", r"override 'data\.prompt_key=\{a': the value is not valid YAML"),
    ("trainer.total_steps.x=1", r"trainer\.total_steps: input should be a valid integer"),
    ("trainer=5", r"'trainer' is a section"),
    ("rollout.n=1: 2", r"rollout\.n: input should be a valid integer"),
    # YAML read 'f.py:' as {'f.py': None}: "input should be a valid string (got {...})"
    ("reward.function=rewards.py:", r"reward\.function: 'rewards\.py:' is not 'module:function'"),
    ("reward.model_path=", r"^treadle: error: reward\.model_path is empty: give a model folder"),
    ("data.batch_size=@8", r"override 'data\.batch_size=@8': the value is not valid YAML"),
]


@pytest.mark.parametrize(("override", "pattern"), OVERRIDES)
def test_bad_override_is_named(env, capsys, override, pattern) -> None:  # type: ignore[no-untyped-def]
    assert_bad(check(env, capsys, override), pattern)


def test_every_bad_override_is_listed(env, capsys) -> None:  # type: ignore[no-untyped-def]
    result = check(env, capsys, "trainer.totl_steps=2", "data.train_files=[a", "rollout.m=3")
    for key in (r"data\.train_files=\[a", r"trainer\.totl_steps", r"rollout\.m'"):
        assert_bad(result, key, lines=3)


# --- model and tokenizer folders ------------------------------------------------------------


def model_copy(env, name: str, drop: str | None = None, garble: str | None = None) -> str:  # type: ignore[no-untyped-def]
    dest = Path(env["root"]) / name
    if not dest.exists():
        shutil.copytree(env["model"], dest)
        if drop:
            (dest / drop).unlink()
        if garble:
            (dest / garble).write_text("{not json")
    return str(dest)


MODEL_CASES: list[tuple[Any, str]] = [
    (lambda env: ["model.path=/no/such/model"], r"model\.path: '/no/such/model' does not exist"),
    (lambda env: [f"model.path={env['train']}"], r"model\.path: .*train\.jsonl' is a file"),
    (lambda env: ["model.path="], r"model\.path is empty"),
    (
        lambda env: ["model.path=someorg/somemodel"],
        r"model\.path: 'someorg/somemodel' is not a local",
    ),
    (
        lambda env: [f"model.path={model_copy(env, 'noconfig', drop='config.json')}"],
        r"model\.path: .*noconfig' is not a model folder: no config\.json",
    ),
    (
        lambda env: [f"model.path={model_copy(env, 'noweights', drop='model.safetensors')}"],
        r"model\.path: .*noweights' is not a model folder: no \*\.safetensors",
    ),
    (
        lambda env: [f"model.path={model_copy(env, 'badconfig', garble='config.json')}"],
        r"model\.path: .*config\.json' is not valid JSON",
    ),
    (
        lambda env: [f"model.path={model_copy(env, 'badtok', garble='tokenizer.json')}"],
        r"model\.path: cannot load a tokenizer from .*badtok",
    ),
    (
        lambda env: ["model.tokenizer_path=/no/tok"],
        r"model\.tokenizer_path: '/no/tok' does not exist",
    ),
    (
        lambda env: [f"model.tokenizer_path={env['root']}"],
        r"model\.tokenizer_path: .* no tokenizer",
    ),
    (lambda env: ["reward.model_path=/no/rm"], r"reward\.model_path: '/no/rm' does not exist"),
    (lambda env: ["critic.model_path=/no/critic"], r"critic\.model_path: '/no/critic' does not"),
]


@pytest.mark.parametrize(("overrides", "pattern"), MODEL_CASES)
def test_bad_model_folder_is_named(env, capsys, overrides, pattern) -> None:  # type: ignore[no-untyped-def]
    assert_bad(check(env, capsys, *overrides(env)), pattern)


# --- data files and rows -------------------------------------------------------------------

GOOD_ROW = '{"prompt": "What is 1+2?", "answer": "3", "solution": "1+2=3. Answer: 3"}\n'
DATA_CASES = [
    ("missing.jsonl", None, r"data\.train_files: file '.*missing\.jsonl' does not exist"),
    ("rows.csv", "prompt,answer\n", r"data\.train_files: '.*rows\.csv' is not JSONL"),
    (
        "latin.jsonl",
        GOOD_ROW.encode() + b'{"prompt": "caf\xe9", "answer": "1"}\n',
        r"latin\.jsonl': row 2: not UTF-8",
    ),
    (
        "badjson.jsonl",
        GOOD_ROW * 2 + '{"prompt": "x", "answer": }\n',
        r"badjson\.jsonl': row 3: not valid JSON",
    ),
    ("list.jsonl", GOOD_ROW + "[1, 2]\n", r"list\.jsonl': row 2: not a JSON object"),
    (
        "blank.jsonl",
        GOOD_ROW + "\n\n" + "7\n",
        r"blank\.jsonl': row 2: not a JSON object \(a number\)",
    ),
    (
        "noprompt.jsonl",
        GOOD_ROW + '{"answer": "3"}\n',
        r"noprompt\.jsonl row 2: prompt field 'prompt'",
    ),
    (
        "noanswer.jsonl",
        GOOD_ROW + '{"prompt": "x"}\n',
        r"noanswer\.jsonl row 2: answer field 'answer'",
    ),
    (
        "numprompt.jsonl",
        GOOD_ROW + '{"prompt": 5, "answer": "1"}\n',
        r"numprompt\.jsonl row 2: field 'prompt' must be",
    ),
    (
        "badmsgs.jsonl",
        GOOD_ROW + '{"prompt": [{"role": 1}], "answer": "1"}\n',
        r"badmsgs\.jsonl row 2: field 'prompt'",
    ),
    ("empty.jsonl", "", r"data\.train_files: no rows in .*empty\.jsonl"),
    (
        "few.jsonl",
        GOOD_ROW * 3,
        r"data\.train_files: 3 rows, fewer than one batch of data\.batch_size=8",
    ),
    ("bad.parquet", "not parquet", r"cannot read '.*bad\.parquet'"),
    (
        "array.json",
        '[{"prompt": "x", "answer": "1"}, "y"]',
        r"array\.json': row 2: not a JSON object",
    ),
    (
        "blankprompt.jsonl",
        GOOD_ROW + '{"prompt": "  ", "answer": "1"}\n',
        r"blankprompt\.jsonl row 2",
    ),
]


@pytest.mark.parametrize(("name", "content", "pattern"), DATA_CASES)
def test_bad_train_file_names_file_and_row(env, capsys, name, content, pattern) -> None:  # type: ignore[no-untyped-def]
    path = str(Path(env["root"]) / name) if content is None else write(env, name, content)
    assert_bad(check(env, capsys, f"data.train_files=[{path}]"), pattern)


def test_every_bad_file_is_reported(env, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = write(env, "bad1.jsonl", GOOD_ROW + "[1]\n")
    worse = write(env, "bad2.jsonl", GOOD_ROW + '{"prompt": "x"}\n')
    result = check(
        env, capsys, f"data.train_files=[{bad}, {env['train']}]", f"data.val_files=[{worse}]"
    )
    assert_bad(
        result,
        r"data\.train_files: .*bad1\.jsonl(.|\n)*data\.val_files: .*bad2\.jsonl row 2",
        lines=2,
    )


def test_overlong_prompt_as_error_names_the_row(env, capsys) -> None:  # type: ignore[no-untyped-def]
    result = check(env, capsys, "data.overlong_prompts=error", "data.max_prompt_length=5")
    assert_bad(result, r"train\.jsonl row 1: prompt is \d+ tokens, longer than max_prompt_length=5")


@pytest.mark.parametrize(
    ("kind", "content", "pattern"),
    [
        ("sft", GOOD_ROW + '{"prompt": "x", "answer": "1"}\n', r"row 2: response field 'solution'"),
        (
            "sft",
            GOOD_ROW + '{"messages": [{"role": "assistant", "content": "x"}]}\n',
            r"row 2: 'messages' starts with an assistant",
        ),
        ("dpo", GOOD_ROW, r"has no column 'chosen' \(data\.chosen_key\)"),
        (
            "rm",
            '{"prompt": "x", "chosen": "a", "rejected": "a"}\n',
            r"row 1: the chosen and rejected responses are the same",
        ),
        (
            "rm",
            '{"prompt": "x", "chosen": "a", "rejected": 5}\n',
            r"row 1: field 'rejected' must be a string",
        ),
        ("eval", None, r"data\.val_files is empty"),
    ],
)
def test_rows_are_checked_for_the_command(env, capsys, kind, content, pattern) -> None:  # type: ignore[no-untyped-def]
    if content is None:
        assert_bad(check(env, capsys, "data.val_files=[]", kind=kind), pattern)
        return
    path = write(env, f"{kind}_rows.jsonl", content)
    assert_bad(
        check(env, capsys, f"data.train_files=[{path}]", "data.val_files=[]", kind=kind), pattern
    )


def test_chat_template_that_fails_names_the_file(env, capsys) -> None:  # type: ignore[no-untyped-def]
    folder = Path(model_copy(env, "badtemplate"))
    (folder / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    result = check(env, capsys, f"model.tokenizer_path={folder}", "data.val_files=[]")
    assert_bad(
        result,
        r"data\.train_files: .*train\.jsonl row 1: the chat template refuses field 'prompt': "
        "no system role",
    )


def test_a_chat_template_variable_the_template_never_reads_is_named(env, capsys) -> None:  # type: ignore[no-untyped-def]
    folder = Path(model_copy(env, "thinking"))
    template = (folder / "chat_template.jinja").read_text()
    reads = "{% if enable_thinking is defined and enable_thinking is false %}{% endif %}"
    (folder / "chat_template.jinja").write_text(reads + template)
    read = f"model.tokenizer_path={folder}"
    assert check(env, capsys, read, "data.chat_template_kwargs={enable_thinking: false}")[0] == 0
    assert_bad(
        check(env, capsys, read, "data.chat_template_kwargs={enable_thinkng: false}"),
        r"data\.chat_template_kwargs\.enable_thinkng: the chat template of .*thinking' never "
        r"reads 'enable_thinkng', so it would change nothing",
    )
    assert_bad(
        check(env, capsys, "data.chat_template_kwargs={add_generation_prompt: false}"),
        r"data\.chat_template_kwargs\.add_generation_prompt: 'add_generation_prompt' is set by "
        "treadle itself",
    )


# --- the reward function -----------------------------------------------------------------------

REWARDS = {
    "raises.py": "raise RuntimeError('broken at import')\n",
    "syntax.py": "def score(prompt, response:\n",
    "nofn.py": "def other(prompt, response, ground_truth):\n    return 0.0\n",
    "signature.py": "def score(response):\n    return 0.0\n",
    "notfn.py": "score = 3\n",
}
REWARD_CASES = [
    (
        "arithmatic",
        r"reward\.function: unknown reward 'arithmatic' \(did you mean 'arithmetic'\?\)",
    ),
    ("/no/such/file.py:score", r"reward\.function: file '/no/such/file\.py' does not exist"),
    ("nosuchmodule_xyz:score", r"reward\.function: cannot import module 'nosuchmodule_xyz'"),
    ("raises.py:score", r"reward\.function: importing .*raises\.py' raised RuntimeError: broken"),
    ("syntax.py:score", r"reward\.function: importing .*syntax\.py' raised SyntaxError"),
    ("nofn.py:score", r"reward\.function: .*nofn\.py' has no function 'score'"),
    ("signature.py:score", r"reward\.function"),
    ("notfn.py:score", r"reward\.function: 'score' in .*notfn\.py' is a int, not a function"),
]


@pytest.mark.parametrize(("spec", "pattern"), REWARD_CASES)
def test_bad_reward_function_is_named(env, capsys, spec, pattern) -> None:  # type: ignore[no-untyped-def]
    name = spec.partition(":")[0]
    if name in REWARDS:
        spec = f"{write(env, name, REWARDS[name])}:score"
    assert_bad(check(env, capsys, f"reward.function={spec}"), pattern)


def test_an_agent_loop_that_blocks_at_import_is_interrupted(env, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import treadle.check.user_code

    monkeypatch.setattr(treadle.check.user_code, "IMPORT_TIMEOUT_S", 0.3)
    path = write(
        env, "slow_loop.py", "import time\ntime.sleep(60)\nasync def loop(*a):\n    pass\n"
    )
    result = check(env, capsys, f"rollout.agent_loop={path}:loop")
    assert_bad(result, r"rollout\.agent_loop: importing '.*slow_loop\.py' did not finish in 0\.3 s")


def test_every_import_of_user_code_is_limited_and_the_other_problems_stay(
    env, capsys, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A validation set's reward that never returns from its import: its limit wrapped
    attempt(...) from outside, so the hang left check() with the other problems dropped. One
    that blocks everywhere is found in the child process; one that blocks in this process
    only, by SIGALRM here; an environment factory and a plug-in go through the same limit."""
    import treadle.check.user_code

    monkeypatch.setattr(treadle.check.user_code, "IMPORT_TIMEOUT_S", 1.5)
    hangs = "import time\ntime.sleep(60)\ndef score(p, r, g):\n    return 0.0\n"
    # (the probe's child has this file in its argv; a pytest-xdist worker's argv is "-c" too)
    here = "import sys, time\nif 'here.py' not in str(sys.argv):\n    time.sleep(60)\n"
    everywhere, in_process = write(env, "hangs.py", hangs), write(env, "hangs_here.py", here)
    sets = (
        f"data.val_sets={{a: {{files: [{env['test']}], reward: '{everywhere}:score'}}, "
        f"b: {{files: [{env['test']}], reward: '{in_process}:score'}}}}"
    )
    loop = ["rollout.agent_loop=env", f"rollout.env={everywhere}:make_env"]
    loop += ["rollout.max_response_length=32"]  # (the model's context is 128)
    plugin = f"algorithm.plugins=[{everywhere}]"
    result = check(env, capsys, sets, *loop, plugin, "data.batch_size=1000")
    assert_bad(result, "", lines=5)
    errors = result[2].splitlines()
    slow = "did not finish in 1.5 s: a module must define its functions quickly when imported"
    assert errors == [
        f"treadle: error: algorithm.plugins: importing '{everywhere}' {slow} (load models or "
        "data on first call)",
        f"treadle: error: rollout.env: importing '{everywhere}' {slow} (load models or data on "
        "first call)",
        "treadle: error: data.train_files: 40 rows, fewer than one batch of "
        "data.batch_size=1000: lower data.batch_size or add rows",
        f"treadle: error: data.val_sets.a.reward: importing '{everywhere}' {slow} (load models "
        "or data on first call)",
        "treadle: error: data.val_sets.b.reward: importing it took longer than 1.5 s: does it "
        "block or loop at import time?",
    ]


def test_bad_agent_loop_and_tools_are_named(env, capsys) -> None:  # type: ignore[no-untyped-def]
    assert_bad(check(env, capsys, "rollout.agent_loop=nosuchmod_xyz:loop"), r"rollout\.agent_loop")
    tools = ["rollout.agent_loop=tools", "rollout.tools=[nosuchmod_xyz:add]"]
    assert_bad(check(env, capsys, *tools), r"rollout\.tools")


# --- the output directory -----------------------------------------------------------------------


def test_output_dir_is_a_file(env, capsys) -> None:  # type: ignore[no-untyped-def]
    result = check(env, capsys, f"trainer.output_dir={env['train']}")
    assert_bad(result, r"trainer\.output_dir: .*train\.jsonl' is a file, not a directory")


def test_output_dir_below_a_file(env, capsys) -> None:  # type: ignore[no-untyped-def]
    result = check(env, capsys, f"trainer.output_dir={env['train']}/run")
    assert_bad(result, r"trainer\.output_dir: cannot create .*: '.*train\.jsonl' is a file")


def test_an_output_dir_made_by_another_process_meanwhile_is_no_error(tmp_path) -> None:
    """Two checks (or a check and a run) of one config at once: the other makes the directory
    between this check's look and its trial mkdir, which then meets it; it is kept."""
    from treadle.check.output import _try_creating

    out = tmp_path / "runs" / "a"
    out.mkdir(parents=True)  # (made by the other process)
    _try_creating(out, tmp_path)
    assert out.is_dir()
    fresh = tmp_path / "new" / "b"
    _try_creating(fresh, tmp_path)  # made and removed again, its parent with it
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("where", ["/proc", "a name too long"])
def test_output_dir_that_cannot_be_created_is_found(env, capsys, where) -> None:  # type: ignore[no-untyped-def]
    """/proc's permissions let root write, yet nothing can be made there: the check passed,
    then `treadle train` died in mkdir with a FileNotFoundError traceback. The check now
    creates the directory as the run will, and removes it."""
    if where == "/proc":
        if not os.access("/proc", os.W_OK):
            pytest.skip("only root is let write in /proc (and fails)")
        out, why = "/proc/treadle-run", "No such file or directory"
    else:
        out, why = str(Path(env["root"]) / ("x" * 300) / "run"), "File name too long"
    result = check(env, capsys, f"trainer.output_dir={out}")
    assert_bad(result, "", lines=1)
    assert result[2] == (
        f"treadle: error: trainer.output_dir: cannot create '{out}' ({why}): set "
        "trainer.output_dir to a directory that can be created\n"
    )


def test_a_creatable_output_dir_is_left_as_it_was(env, capsys) -> None:  # type: ignore[no-untyped-def]
    root = Path(env["root"])
    code, out, err = check(env, capsys, f"trainer.output_dir={root / 'new' / 'deeper' / 'run'}")
    assert code == 0, err
    assert "trainer.output_dir: " in out and "run (new)" in out
    assert not (root / "new").exists()  # tried, and removed


def test_output_dir_locked_by_a_live_run_names_its_pid(env, capsys) -> None:  # type: ignore[no-untyped-def]
    out = Path(env["root"]) / "busy"
    out.mkdir(exist_ok=True)
    with (out / ".lock").open("a+") as lock:  # as trainers.run_dir.RunLock holds it
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("pid 4242 on somehost")
        lock.flush()
        result = check(env, capsys, f"trainer.output_dir={out}")
    assert_bad(
        result, r"trainer\.output_dir: .*busy' is in use by another run \(pid 4242 on somehost\)"
    )
    code, out_text, _ = check(env, capsys, f"trainer.output_dir={out}")  # released: fine
    assert code == 0 and "(exists)" in out_text


def test_independent_problems_are_all_reported(env, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = write(env, "multi.jsonl", GOOD_ROW + "[1]\n")
    result = check(
        env,
        capsys,
        "algorithm.kl_estimator=k4",
        f"data.train_files=[{bad}]",
        "reward.function=arithmatic",
        f"trainer.output_dir={env['train']}",
    )
    assert_bad(
        result, r"kl_estimator(.|\n)*reward\.function(.|\n)*multi\.jsonl(.|\n)*output_dir", lines=4
    )


def test_a_bad_reward_model_folder_does_not_hide_bad_rows(env, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = write(env, "hidden.jsonl", GOOD_ROW + '{"prompt": "x"}\n')
    result = check(env, capsys, "reward.model_path=/no/rm", f"data.train_files=[{bad}]")
    assert_bad(result, r"reward\.model_path(.|\n)*hidden\.jsonl row 2", lines=2)


# --- every command checks first --------------------------------------------------------------

COMMANDS = [
    ("train", ["rollout.n=1", "actor.ppo_mini_batch_size=8"], r"rollout\.n=1"),
    ("train", ["data.train_files=[/no/such.jsonl]"], r"data\.train_files: file '/no/such\.jsonl'"),
    ("train", ["reward.function=arithmatic"], r"did you mean 'arithmetic'"),
    ("distill", [], r"set teacher\.model_path"),
    ("distill", ["teacher.model_path=/no/teacher"], r"teacher\.model_path: '/no/teacher'"),
    ("sft", ["data.val_files=[]", "model.path=/no/model"], r"model\.path: '/no/model'"),
    ("dpo", ["dpo.loss_type=nope"], r"dpo\.loss_type: unknown"),
    ("rm", [], r"has no column 'chosen'"),
    ("eval", ["data.val_files=[]"], r"data\.val_files is empty"),
]


@pytest.mark.parametrize(("command", "overrides", "pattern"), COMMANDS)
def test_every_command_runs_the_checks_first(env, capsys, command, overrides, pattern) -> None:  # type: ignore[no-untyped-def]
    out = Path(env["root"]) / f"cmd_{command}"
    result = run(capsys, command, env["config"], *overrides, f"trainer.output_dir={out}")
    assert_bad(result, pattern)
    assert not out.exists()  # stopped before the run directory (and Ray)


@pytest.mark.parametrize("path", sorted(Path("examples").glob("*/*.yaml")), ids=str)
def test_example_configs_pass_the_config_and_algorithm_checks(path: Path) -> None:
    from treadle.check import check_algorithm
    from treadle.config import load_config

    kinds = {"sft": "sft", "dpo": "dpo", "rm": "rm", "kto": "kto", "orpo": "dpo", "simpo": "dpo"}
    command = path.stem.split("_")[0]  # (smollm2/sft_arithmetic.yaml is an sft config)
    kind = "distill" if path.parent.name == "distill" else kinds.get(command, "train")
    check_algorithm(load_config(path), kind)  # type: ignore[arg-type]
