"""Bad input a careless user gives, each case one `treadle: error:` line naming the key, file
or row and what to do (issue 27 item 7): sizes beyond the machine, settings the chosen setup
never reads or contradicts, model folders, data rows, the output directory, reward functions,
the config file itself.

Like tests/test_check.py, each case runs `treadle.cli.main` in-process on a good config made bad
in one way; nothing here starts Ray or loads weights.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

# how a case runs and is judged: tests/test_check.py's (the good config: conftest's `env`)
from test_check import assert_bad, check, write

GOOD_ROW = '{"prompt": "What is 1+2?", "answer": "3"}\n'


def model_copy(env, name: str, config: dict[str, Any] | None = None) -> str:  # type: ignore[no-untyped-def]
    """A copy of the tiny model whose config.json is updated with ``config``."""
    dest = Path(env["root"]) / name
    if not dest.exists():
        shutil.copytree(env["model"], dest)
        if config:
            path = dest / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return str(dest)


RAY = ["trainer.backend=ray"]

# --- sizes beyond the machine -------------------------------------------------------------------

SIZE_CASES = [
    (
        ["rollout.n=4000000", "actor.ppo_mini_batch_size=32000000"],
        r"rollout\.n=4000000: .* GiB, more than this machine's \d+ GiB of memory",
    ),
    (
        ["rollout.engine=vllm", "rollout.kv_cache_gib=100000"],
        r"rollout\.kv_cache_gib=100000 .* more than this machine's .* GiB of memory",
    ),
    (
        [*RAY, f"actor.world_size={4 * (os.cpu_count() or 1)}", "data.batch_size=64"],
        r"actor\.world_size=\d+ ranks need a CPU each, more than the \d+ CPUs",
    ),
]


@pytest.mark.parametrize(("overrides", "pattern"), SIZE_CASES)
def test_sizes_beyond_the_machine(env, capsys, overrides, pattern) -> None:  # type: ignore[no-untyped-def]
    assert_bad(check(env, capsys, *overrides), pattern)


# --- settings the chosen setup never reads or contradicts -----------------------------------------

UNREAD_CASES = [
    (
        ["critic.lr=1e-4"],
        "train",
        r"critic\.lr=0\.0001 configures the critic, but .*grpo has no critic",
    ),
    (
        ["algorithm.adv_estimator=gae", "critic.enable=false"],
        "train",
        r"algorithm\.adv_estimator=gae needs a critic's values, but critic\.enable=false",
    ),
    (
        ["algorithm.kl_target=0.1"],
        "train",
        r"algorithm\.kl_target=0\.1 steers algorithm\.kl_reward_coef, which is 0",
    ),
    (
        ["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"],
        "dpo",
        r"dpo\.label_smoothing=0\.1 is not read by dpo\.loss_type=ipo",
    ),
    (
        ["trainer.eval_every=2", "data.val_files=[]"],
        "train",
        r"trainer\.eval_every=2 .* no validation set",
    ),
    (
        ["algorithm.mask_truncated=true", "rollout.ignore_eos=true"],
        "train",
        r"algorithm\.mask_truncated=true .* rollout\.ignore_eos=true",
    ),
    (["dpo.loss_type=nosuch"], "train", r"the config sets the 'dpo' section, which is for"),
    (["kto.beta=0.5"], "train", r"the config sets the 'kto' section, which is for `treadle kto`"),
]


@pytest.mark.parametrize(("overrides", "kind", "pattern"), UNREAD_CASES)
def test_settings_the_setup_does_not_read(env, capsys, overrides, kind, pattern) -> None:  # type: ignore[no-untyped-def]
    if kind == "dpo":
        overrides = [*overrides, f"data.train_files=[{env['pairs']}]", "data.val_files=[]"]
    assert_bad(check(env, capsys, *overrides, kind=kind), pattern)


# sft, dpo, kto and rm read no RL setting, and another command's section is not theirs: each
# group of such settings is one line naming the keys, their values and the commands that read
# them (`treadle sft` with algorithm.kl_coef=0.5, rollout.n=8 ... said `ok: ready`)
OTHER_COMMAND_CASES = [
    (
        ["algorithm.kl_coef=0.5", "algorithm.adv_estimator=rloo"],
        "sft",
        r"^algorithm\.adv_estimator=rloo, algorithm\.kl_coef=0\.5 are read by treadle "
        r"train/distill, not by treadle sft: remove them$",
    ),
    (
        ["rollout.n=8"],
        "sft",
        r"^rollout\.n=8 is read by treadle train/distill \(an evaluation samples as eval\.\* "
        r"says\), not by treadle sft: remove it$",
    ),
    (
        ["rollout.temperature=0.3", "rollout.top_p=0.9"],
        "dpo",
        r"^rollout\.temperature=0\.3, rollout\.top_p=0\.9 are read by treadle train/distill",
    ),
    (
        ["data.val_files=[]", "reward.function=chat_arithmetic"],
        "sft",
        r"^reward\.function=chat_arithmetic is read by treadle train/distill/eval, and by sft "
        r"with a validation set .*, not by this treadle sft, which has no validation set: "
        r"remove it, or set data\.val_files$",
    ),
    (
        ["eval.n=4", "eval.temperature=1"],
        "dpo",
        r"^eval\.n=4, eval\.temperature=1\.0 are read by .*, not by treadle dpo without "
        r"dpo\.eval_task=true: remove them, or set that$",
    ),
    (["eval.n=2", "eval.temperature=1"], "rm", r"not by treadle rm \(it scores held-out pairs"),
    (["critic.lr=0.001"], "kto", r"^critic\.lr=0\.001 is read by treadle train \(an estimator"),
    (["kto.beta=0.2"], "dpo", r"^kto\.beta=0\.2 is read by treadle kto, not by treadle dpo"),
    (["dpo.beta=0.2"], "rm", r"^dpo\.beta=0\.2 is read by treadle dpo, not by treadle rm"),
    (["reward.overlong_buffer_len=4"], "sft", r"^reward\.overlong_buffer_len=4 is read by"),
    (["async.max_staleness=2"], "sft", r"^async\.max_staleness=2 is read by treadle train/"),
    (["distill.coef=0.5"], "sft", r"^distill\.coef=0\.5 is read by treadle distill, not by"),
]


@pytest.mark.parametrize(("overrides", "kind", "pattern"), OTHER_COMMAND_CASES)
def test_settings_of_another_command(env, capsys, overrides, kind, pattern) -> None:  # type: ignore[no-untyped-def]
    if kind in ("dpo", "kto", "rm"):
        overrides = [f"data.train_files=[{env['pairs']}]", "data.val_files=[]", *overrides]
    code, out, err = check(env, capsys, *overrides, kind=kind)
    assert_bad((code, out, err), pattern.replace("^", "^treadle: error: "), lines=1)


def test_what_each_command_reads_is_not_refused(env, capsys) -> None:  # type: ignore[no-untyped-def]
    """The evaluations of sft (a validation set), dpo and kto (eval_task) read reward.function
    and the eval section; every command reads rollout.max_new_tokens (its length limit) and
    the rollout engine's settings; dpo its section, kto its."""
    pairs = [f"data.train_files=[{env['pairs']}]", f"data.val_files=[{env['pairs']}]"]
    evaluation = ["reward.function=chat_arithmetic", "eval.n=2", "eval.temperature=1"]
    common = ["rollout.max_new_tokens=48", "rollout.micro_batch_size=4"]
    for kind, overrides in (
        ("sft", [*evaluation, *common]),
        ("dpo", [*pairs, *evaluation, *common, "dpo.eval_task=true", "dpo.beta=0.2"]),
        ("kto", [*pairs, *common, "kto.beta=0.2"]),
        ("rm", [*pairs, *common]),
    ):
        code, _, err = check(env, capsys, *overrides, kind=kind)
        assert code == 0, (kind, err)


# --- model folders ------------------------------------------------------------------------------


def test_causal_lm_as_reward_model(env, capsys) -> None:  # type: ignore[no-untyped-def]
    result = check(env, capsys, f"reward.model_path={env['model']}")
    assert_bad(result, r"reward\.model_path: '.*' is not a reward model \(architectures: ")


def test_critic_with_another_vocabulary(env, capsys) -> None:  # type: ignore[no-untyped-def]
    critic = model_copy(env, "bigvocab", {"vocab_size": 4096})
    result = check(env, capsys, "algorithm.adv_estimator=gae", f"critic.model_path={critic}")
    assert_bad(result, r"critic\.model_path: '.*bigvocab' has a vocabulary of 4096 tokens")


def test_corrupt_weights(env, capsys) -> None:  # type: ignore[no-untyped-def]
    folder = model_copy(env, "corrupt")
    (Path(folder) / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    result = check(env, capsys, f"model.path={folder}")
    assert_bad(result, r"model\.path: .*corrupt/model\.safetensors' is not a safetensors file")


def test_unknown_model_type(env, capsys) -> None:  # type: ignore[no-untyped-def]
    folder = model_copy(env, "unknowntype", {"model_type": "nosuchmodel"})
    result = check(env, capsys, f"model.path={folder}")
    assert_bad(result, r"model\.path: .*config\.json' has model_type 'nosuchmodel', which")


def test_layer_types_that_do_not_count_the_layers(env, capsys) -> None:  # type: ignore[no-untyped-def]
    """transformers refuses it with a huggingface_hub traceback when the run loads the model."""
    layers = json.loads((Path(env["model"]) / "config.json").read_text())["num_hidden_layers"]
    folder = model_copy(env, "layercount", {"num_hidden_layers": layers + 1})
    result = check(env, capsys, f"model.path={folder}")
    pattern = (
        rf"^treadle: error: model\.path: '.*layercount/config\.json' has num_hidden_layers="
        rf"{layers + 1} but layer_types lists {layers} layers: make them agree"
    )
    assert_bad(result, pattern, lines=1)


def test_vocabulary_smaller_than_the_tokenizer(env, capsys) -> None:  # type: ignore[no-untyped-def]
    folder = model_copy(env, "smallvocab", {"vocab_size": 8})
    result = check(env, capsys, f"model.path={folder}")
    assert_bad(result, r"model\.path: .*vocab_size=8, fewer than the tokenizer's \d+ tokens")


LORA_CASES = [
    (
        ["actor.lora.target_modules=[q_proj, nosuch_proj]"],
        r"^treadle: error: actor\.lora\.target_modules: 'nosuch_proj' is not a linear layer of "
        r"the model \(its linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, "
        r"v_proj; or 'all-linear'\)$",
    ),
    (
        ["actor.lora.target_modules=[q_proj, lm_head]"],
        r"^treadle: error: actor\.lora\.target_modules: 'lm_head' is the output head, whose "
        r"log-probs treadle computes from its weight in chunks",
    ),
    (
        ["actor.lora.target_modules="],
        r"^treadle: error: actor\.lora\.target_modules: '' is neither 'all-linear' nor a list of "
        r"module names",
    ),
    (["actor.lora.target_modules=[]"], r"an empty list gives no layer an adapter"),
]


@pytest.mark.parametrize(("overrides", "pattern"), LORA_CASES)
def test_lora_targets_the_model_does_not_have(env, capsys, overrides, pattern) -> None:  # type: ignore[no-untyped-def]
    """The layers' names come from the safetensors header (no weights loaded): a name none has
    was said only once the run had started."""
    result = check(env, capsys, "actor.lora.rank=4", *overrides)
    assert_bad(result, pattern, lines=1)


@pytest.mark.parametrize("target", ["w1", "gate"])
def test_lora_targets_a_mixture_of_experts_keeps_fused(env, capsys, tmp_path, target) -> None:  # type: ignore[no-untyped-def]
    """A Mixtral's files hold a matrix an expert (``experts.0.w1``) and a router (``gate``);
    transformers 5 holds the experts fused and the router as a module of its own, so neither
    is a linear layer to the run's peft (which refused them after start-up)."""
    from tiny_models import tiny_family

    folder = tiny_family(tmp_path / "moe", env["model"])
    result = check(
        env, capsys, f"model.path={folder}", "actor.lora.rank=4",
        f"actor.lora.target_modules=[q_proj, {target}]",
    )  # fmt: skip
    pattern = (
        rf"^treadle: error: actor\.lora\.target_modules: '{target}' is not a linear layer of "
        r"the model \(its linear layers: k_proj, o_proj, q_proj, v_proj; or 'all-linear'\)$"
    )
    assert_bad(result, pattern, lines=1)


def test_lora_targets_the_model_has(env, capsys) -> None:  # type: ignore[no-untyped-def]
    targets = "actor.lora.target_modules=[q_proj, v_proj]"
    code, _, err = check(env, capsys, "actor.lora.rank=4", targets)
    assert code == 0, err


# --- data rows ----------------------------------------------------------------------------------


def test_answer_that_is_an_object(env, capsys) -> None:  # type: ignore[no-untyped-def]
    path = write(env, "objanswer.jsonl", GOOD_ROW * 8 + '{"prompt": "x", "answer": {"a": 1}}\n')
    result = check(env, capsys, f"data.train_files=[{path}]")
    assert_bad(result, r"objanswer\.jsonl.* row 9: .*answer")


MESSAGE_CASES = [
    ([{"role": "robot", "content": "What is 1+2?"}], r"message 1 has role 'robot' \(roles: system"),
    ([{"role": "system", "content": "Be brief."}], r"has no user message \(its roles: system\)"),
    (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " "}],
        r"message 2 has empty content",
    ),
]


@pytest.mark.parametrize(("messages", "pattern"), MESSAGE_CASES)
def test_chat_prompt_that_is_no_conversation(env, capsys, messages, pattern) -> None:  # type: ignore[no-untyped-def]
    """A chat template renders any role (`<|im_start|>robot`), a prompt without a user turn
    and an empty turn: such prompts passed check and trained."""
    row = json.dumps({"prompt": messages, "answer": "3"}) + "\n"
    path = write(env, "chat.jsonl", GOOD_ROW * 8 + row)
    result = check(env, capsys, f"data.train_files=[{path}]")
    assert_bad(result, r"^treadle: error: data\.train_files: .*chat\.jsonl row 9: field 'prompt' "
               + pattern, lines=1)  # fmt: skip


def test_ground_truths_the_built_in_reward_refuses(env, capsys) -> None:  # type: ignore[no-untyped-def]
    """The built-in rewards say which ground truths they take (arithmetic: an integer): each row
    is asked up front; a bad one stopped the run at whichever step drew it, naming no row."""
    path = write(env, "abc.jsonl", GOOD_ROW * 8 + '{"prompt": "x", "answer": "abc"}\n')
    result = check(env, capsys, f"data.train_files=[{path}]")
    pattern = (
        r"^treadle: error: data\.train_files: abc\.jsonl row 9: answer 'abc' is not an integer, "
        r"which reward\.function=arithmetic needs \(data\.answer_key=answer: is it the right "
        r"column\?\)$"
    )
    assert_bad(result, pattern, lines=1)
    # the worked solution's column: every row (a long answer shortened), the key to look at
    result = check(env, capsys, "data.answer_key=solution", "data.val_files=[]")
    pattern = (
        r"^treadle: error: data\.train_files: train\.jsonl row 1: answer '.{37}\.\.\.' is not "
        r"an integer, which reward\.function=arithmetic needs \(39 more rows too; "
        r"data\.answer_key=solution: is it the right column\?\)$"
    )
    assert_bad(result, pattern, lines=1)
    # a validation set with a reward of its own is held to that reward's rule
    sets = f"data.val_sets={{other: {{files: [{path}], reward: chat_arithmetic}}}}"
    result = check(env, capsys, sets)
    assert_bad(result, r"data\.val_sets\.other: abc\.jsonl row 9: answer 'abc' .* "
               r"data\.val_sets\.other\.reward=chat_arithmetic needs", lines=1)  # fmt: skip
    # an agent loop of the user's may give the reward itself (a game's: "answer": "played")
    loop = ["rollout.agent_loop=openai:treadle.agents.arena:play", "rollout.max_response_length=64"]
    code, _, err = check(env, capsys, f"data.train_files=[{path}]", *loop)
    assert code == 0, err
    # sft trains on its rows' responses: only its evaluation's answers are scored
    row = '{"prompt": "x", "answer": "abc", "solution": "Answer: 3"}\n'
    sft = write(env, "abc_sft.jsonl", row * 8)
    code, _, err = check(env, capsys, f"data.train_files=[{sft}]", kind="sft")
    assert code == 0, err


def test_parquet_float_answers_are_named_not_rewritten(env, capsys) -> None:  # type: ignore[no-untyped-def]
    """A Parquet float64 answer column (pandas' for integers with a missing value) holds 79.0:
    the ground truth is the file's own number, '79.0', which arithmetic refuses, saying why."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(env["root"]) / "floats.parquet"
    table = pa.table(
        {"prompt": ["What is 70+9?"] * 8, "answer": pa.array([79.0] * 8, pa.float64())}
    )
    pq.write_table(table, path)
    result = check(env, capsys, f"data.train_files=[{path}]")
    pattern = (
        r"^treadle: error: data\.train_files: floats\.parquet row 1: answer '79\.0' is not an "
        r"integer, which reward\.function=arithmetic needs \(7 more rows too; a float column, as "
        r"pandas writes integers with a missing value to Parquet: store the answers as integers "
        r"or text; data\.answer_key=answer: is it the right column\?\)$"
    )
    assert_bad(result, pattern, lines=1)


def test_pairs_without_the_rejected_column(env, capsys) -> None:  # type: ignore[no-untyped-def]
    rows = [json.loads(line) for line in Path(env["pairs"]).read_text().splitlines()]
    text = "".join(json.dumps({k: v for k, v in r.items() if k != "rejected"}) + "\n" for r in rows)
    path = write(env, "norejected.jsonl", text)
    result = check(env, capsys, f"data.train_files=[{path}]", "data.val_files=[]", kind="dpo")
    assert_bad(result, r"norejected\.jsonl has no column 'rejected' \(data\.rejected_key\)")


# --- the output directory -----------------------------------------------------------------------


def test_output_dir_on_a_read_only_file_system(env, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    real = os.statvfs

    class ReadOnly:
        def __init__(self, path: Any) -> None:
            self._stat = real(path)

        def __getattr__(self, name: str) -> Any:
            value = getattr(self._stat, name)
            return value | os.ST_RDONLY if name == "f_flag" else value

    monkeypatch.setattr(os, "statvfs", ReadOnly)
    result = check(env, capsys)
    assert_bad(result, r"trainer\.output_dir: cannot create '.*run': .* read-only file system")


def test_output_dir_that_is_a_dangling_symlink(env, capsys) -> None:  # type: ignore[no-untyped-def]
    link = Path(env["root"]) / "dangling"
    if not link.is_symlink():
        link.symlink_to(Path(env["root"]) / "gone" / "run")
    result = check(env, capsys, f"trainer.output_dir={link}")
    assert_bad(result, r"trainer\.output_dir: '.*dangling' is a symlink to '.*gone/run', which")


def test_data_file_that_is_a_broken_symlink(env, capsys) -> None:  # type: ignore[no-untyped-def]
    """A link that leads back to itself was reported as a file that does not exist."""
    root = Path(env["root"])
    for name, target in (("loop_a.jsonl", "loop_b.jsonl"), ("loop_b.jsonl", "loop_a.jsonl")):
        if not (root / name).is_symlink():
            (root / name).symlink_to(target)
    result = check(env, capsys, f"data.train_files=[{root / 'loop_a.jsonl'}]")
    assert_bad(
        result, r"loop_a\.jsonl' is a symlink to 'loop_b\.jsonl', which leads round in a loop"
    )


def test_output_dir_that_is_a_model_folder_or_holds_one(env, capsys) -> None:  # type: ignore[no-untyped-def]
    """A run writes its checkpoints, logs and final_model/ into its output_dir: one that was
    the model folder turned it into a run directory (and the next run resumed from it)."""
    model = Path(env["model"]).resolve()
    cases = {
        str(model): rf"trainer\.output_dir is model\.path's folder '{model}': the run writes",
        str(model / "run"): rf"'{model}/run' is inside model\.path's folder '{model}'",
        str(model.parent): rf"'{model.parent}' holds model\.path's folder '{model}'",
    }
    for out, pattern in cases.items():
        assert_bad(check(env, capsys, f"trainer.output_dir={out}"), pattern, lines=1)
    assert not (model / "run").exists() and not (model / "checkpoints").exists()
    assert check(env, capsys, f"trainer.output_dir={model.parent / 'beside'}")[0] == 0


# --- reward functions ---------------------------------------------------------------------------

REWARDS = {
    "async_reward.py": "async def score(prompt, response, ground_truth):\n    return 1.0\n",
    "gen_reward.py": "def score(prompt, response, ground_truth):\n    yield 1.0\n",
    "hangs.py": "import time\ntime.sleep(60)\ndef score(p, r, g):\n    return 0.0\n",
    "exits.py": "import sys\nsys.exit(3)\ndef score(p, r, g):\n    return 0.0\n",
    "os_exit.py": "import os\nos._exit(5)\n",
    "deaf.py": "import signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
    "time.sleep(60)\n",
}
REWARD_CASES = [
    ("async_reward.py", r"reward\.function: .*async_reward\.py:score' is a coroutine function"),
    ("gen_reward.py", r"reward\.function: .*gen_reward\.py:score' is a generator function"),
    ("exits.py", r"reward\.function: importing .*exits\.py' called sys\.exit\(3\)"),
    ("hangs.py", r"reward\.function: importing '.*hangs\.py' did not finish in 2 s"),
    # (what no signal interrupts in this process: the import is tried in a child first)
    (
        "os_exit.py",
        r"reward\.function: importing '.*os_exit\.py' ended its process with exit code 5",
    ),
    ("deaf.py", r"reward\.function: importing '.*deaf\.py' did not finish in 2 s"),
]


@pytest.mark.parametrize(("name", "pattern"), REWARD_CASES)
def test_bad_reward_function(env, capsys, monkeypatch, name, pattern) -> None:  # type: ignore[no-untyped-def]
    import treadle.check.user_code

    monkeypatch.setattr(treadle.check.user_code, "IMPORT_TIMEOUT_S", 2.0)
    path = write(env, name, REWARDS[name])
    assert_bad(check(env, capsys, f"reward.function={path}:score"), pattern)


def test_reasoning_gym_reward_on_rows_of_files(env, capsys) -> None:  # type: ignore[no-untyped-def]
    """reward.function=reasoning_gym scores reasoning-gym's rows: on rows of files it passed
    the check and stopped step 1 with "compute_score() missing 2 required positional
    arguments: 'question' and 'metadata'"."""
    result = check(env, capsys, "reward.function=reasoning_gym", "data.val_files=[]")
    pattern = (
        r"^treadle: error: data\.train_files: train\.jsonl row 1 has no columns 'question' and "
        r"'metadata', which reward\.function=reasoning_gym is called with \(a batched reward "
        r"gets the rows' columns\): set data\.source=reasoning_gym \(its rows have them\) or "
        r"use another reward$"
    )
    assert_bad(result, pattern, lines=1)


def test_batched_reward_needs_a_column_the_rows_lack(env, capsys) -> None:  # type: ignore[no-untyped-def]
    """A batched reward (TRL's fn(completions, **columns)) is called with the rows' columns:
    one it needs that the rows lack is named, also after its file changed since a check that
    passed (the rows' kept answer is keyed by the columns it needs)."""
    source = "def score(completions, answer, **kw):\n    return [0.0] * len(completions)\n"
    path = write(env, "batched.py", source)
    good = check(env, capsys, f"reward.function={path}:score")
    assert good[0] == 0, good
    write(env, "batched.py", source.replace("answer,", "answer, level,"))
    result = check(env, capsys, f"reward.function={path}:score")
    pattern = (
        r"data\.train_files: train\.jsonl row 1 has no column 'level', which reward\.function="
        r".*batched\.py:score is called with .*: add the column to the data, or give the "
        r"parameter a default"
    )
    assert_bad(result, pattern)


# --- agent loops ----------------------------------------------------------------------------------

AGENTS = [
    (
        "rollout.agent_loop={}:loop",
        "async def loop(client, sample):\n    return None\n",
        r"rollout\.agent_loop: '.*two\.py:loop' has the signature \(client, sample\), but it is "
        r"called as await loop\(client, sample, tools\)",
    ),
    (
        "rollout.agent_loop=openai:{}:agent",
        "async def agent(client):\n    return 1.0\n",
        r"rollout\.agent_loop: '.*one\.py:agent' has the signature \(client\), but it is called "
        r"as await agent\(client, row\)",
    ),
    (
        "rollout.env={}:make_env",
        "def make_env():\n    return None\n",
        r"rollout\.env: '.*none\.py:make_env' has the signature \(\), but it is called as "
        r"make_env\(row\)",
    ),
]


@pytest.mark.parametrize(("override", "source", "pattern"), AGENTS, ids=["loop", "openai", "env"])
def test_agent_loop_with_the_wrong_signature(env, capsys, override, source, pattern) -> None:  # type: ignore[no-untyped-def]
    """A loop (agent, environment factory) of one's own that cannot take the arguments it is
    called with passed the check and stopped the run at step 1 with a rank's TypeError."""
    name = {"loop": "two.py", "agent": "one.py", "make_env": "none.py"}[override.split(":")[-1]]
    spec = override.format(write(env, name, source))
    loop = ["rollout.agent_loop=env"] if spec.startswith("rollout.env") else []
    result = check(env, capsys, spec, *loop, "rollout.max_response_length=32")
    assert_bad(result, pattern)


# --- the config file ----------------------------------------------------------------------------


def test_deeply_nested_yaml(env, capsys) -> None:  # type: ignore[no-untyped-def]
    path = write(env, "nested.yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert_bad(check(env, capsys, config=path), r"nested\.yaml: .*nested too deeply")
