"""reasoning-gym as a data source and a reward (``data.source=reasoning_gym``,
``reward.function=reasoning_gym``): the rows it draws, the answer formats, scoring against the
library's own ``score_answer``, ``treadle check``'s messages, and two RL steps through it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import reasoning_gym
import yaml

from treadle.cli import main
from treadle.config import load_config
from treadle.config.data import ReasoningGymConfig
from treadle.data.gym import (
    compute_score,
    extract_answer,
    format_answer,
    gym_records,
    instruction,
)
from treadle.models.loading import load_tokenizer
from treadle.rewards import Scorer
from treadle.runtime.errors import ConfigError
from treadle.runtime.plugins import load_callable
from treadle.tracking.tracker import read_metrics
from treadle.trainers.datasets import config_prompts, config_sft

ARITHMETIC = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


def spec(**kwargs: Any) -> ReasoningGymConfig:
    base: dict[str, Any] = {
        "datasets": [{"name": "basic_arithmetic", "config": ARITHMETIC}],
        "size": 30,
        "seed": 3,
        "val_size": 10,
        "val_seed": 500,
    }
    return ReasoningGymConfig(**{**base, **kwargs})


# --- rows ------------------------------------------------------------------------------------


def test_rows_are_the_librarys_composite_entries_with_sizes_and_seeds():
    from reasoning_gym.composite import DatasetSpec

    s = spec()
    train, val = gym_records(s, "train"), gym_records(s, "val")
    assert (len(train), len(val)) == (30, 10)
    ref = reasoning_gym.create_dataset(
        "composite", size=30, seed=3, datasets=[DatasetSpec("basic_arithmetic", 1.0, ARITHMETIC)]
    )
    for i, record in enumerate(train):  # the entries unchanged, plus our two columns
        entry = ref[i]
        assert {k: record.row[k] for k in ("question", "answer", "metadata")} == entry
        assert record.row["answer_format"] == "answer_tag"
        assert record.row["solution"] == f"<answer>{entry['answer']}</answer>"
        assert record.uid == f"reasoning_gym-train:{i}"
    assert val[0].uid == "reasoning_gym-val:0" and val[0].where == "data.reasoning_gym (val) row 1"
    # deterministic; the held-out rows come from their own seed
    assert [r.row for r in gym_records(s, "train")] == [r.row for r in train]
    assert [r.row["question"] for r in val] != [r.row["question"] for r in train[:10]]
    other = gym_records(spec(val_seed=900), "val")
    assert [r.row["question"] for r in other] != [r.row["question"] for r in val]


def test_weights_mix_datasets_as_the_composite_does():
    datasets = [
        {"name": "basic_arithmetic", "weight": 3, "config": ARITHMETIC},
        {"name": "spell_backward", "weight": 1},
    ]
    rows = [r.row for r in gym_records(spec(datasets=datasets, size=200), "train")]
    sources = [r["metadata"]["source_dataset"] for r in rows]
    assert set(sources) == {"basic_arithmetic", "spell_backward"}
    assert 0.6 < sources.count("basic_arithmetic") / len(sources) < 0.9


def test_held_out_seed_must_not_share_the_training_streams():
    with pytest.raises(ValueError, match=r"val_seed=10 draws held-out rows .* at least 35"):
        spec(val_seed=10)


# --- answer formats and scoring ----------------------------------------------------------------


def test_answer_extraction():
    assert (
        extract_answer("think <answer>1</answer> then <answer> 42 </answer>", "answer_tag") == "42"
    )
    assert extract_answer("no tags: 42", "answer_tag") is None
    assert extract_answer("work\n  7 + 5 = 12\n\n 12  \n", "last_line") == "12"
    assert extract_answer("\n \n", "last_line") is None
    assert extract_answer("  12 \n", "full") == "12"
    for how in ("answer_tag", "last_line", "full"):
        assert extract_answer(format_answer("-17", how), how) == "-17"


@pytest.mark.parametrize(
    ("name", "config"),
    [("basic_arithmetic", ARITHMETIC), ("spell_backward", {}), ("chain_sum", {})],
)
def test_scores_are_the_datasets_own_score_answer(name, config):
    ds = reasoning_gym.create_dataset(name, size=4, seed=7, **config)
    entries = list(ds)
    # right, partial (the answer inside more text), wrong and empty answers
    answers = [entries[0]["answer"], f"{entries[1]['answer']}0", "nonsense", ""]
    responses = [f"<answer>{a}</answer>" for a in answers]
    expected = [ds.score_answer(a, e) for a, e in zip(answers, entries, strict=True)]
    got = compute_score(
        responses,
        [e["question"] for e in entries],
        [e["answer"] for e in entries],
        [e["metadata"] for e in entries],
        ["answer_tag"] * 4,
    )
    assert got == expected and got[0] == 1.0
    # no <answer> tag: scored as the library scores no answer (None)
    none = compute_score(["42"], [entries[0]["question"]], [entries[0]["answer"]],
                         [entries[0]["metadata"]], ["answer_tag"])  # fmt: skip
    assert none == [ds.score_answer(None, entries[0])]


def test_reward_reads_rows_through_the_scorer():
    rows = [r.row for r in gym_records(spec(answer_format="last_line"), "train")[:3]]
    responses = [f"thinking...\n{rows[0]['answer']}", "no", f"{rows[2]['answer']}"]
    with Scorer("reasoning_gym", num_workers=2) as scorer:  # batched: in this process
        scores = scorer([r["question"] for r in rows], responses, [r["answer"] for r in rows], rows)
    assert list(scores) == [1.0, 0.0, 1.0]


def test_the_examples_exact_score_drops_the_partial_credit():
    rows = [r.row for r in gym_records(spec(answer_format="full"), "train")[:3]]
    responses = [str(rows[0]["answer"]), f"{rows[1]['answer']}0", "nonsense"]  # right, near miss
    with Scorer("examples/reasoning_gym/exact.py:exact_score", num_workers=0) as exact:
        got = exact([r["question"] for r in rows], responses, [r["answer"] for r in rows], rows)
    with Scorer("reasoning_gym", num_workers=0) as partial:
        full = partial([r["question"] for r in rows], responses, [r["answer"] for r in rows], rows)
    assert list(full) == [1.0, pytest.approx(len(str(rows[1]["answer"])) / len(responses[1])), 0.0]
    assert list(got) == [1.0, 0.0, 0.0]


def test_the_examples_close_score_gives_a_wrong_number_credit_by_its_distance():
    rows = [r.row for r in gym_records(spec(answer_format="full"), "train")[:5]]
    truths = [int(r["answer"]) for r in rows]
    responses = [
        str(truths[0]),  # right: 1.0
        str(truths[1] + 1),  # off by 1: 0.5 x (1 - 1 / max(|truth|, 1))
        str(truths[2]) + "0",  # a digit added: ten times the truth, nothing
        "nonsense",  # no number: nothing
        str(-truths[4]) if truths[4] else "1",  # the sign flipped (partial credit there)
    ]
    with Scorer("examples/reasoning_gym/close.py:close_score", num_workers=0) as close:
        got = close([r["question"] for r in rows], responses, [r["answer"] for r in rows], rows)
    assert list(got) == [
        1.0,
        pytest.approx(0.5 * max(0.0, 1 - 1 / max(abs(truths[1]), 1))),
        0.0,
        0.0,
        0.0,
    ]


def test_reward_on_rows_without_metadata_says_what_it_needs():
    with pytest.raises(ValueError, match=r"use data\.source=reasoning_gym"):
        compute_score(["1"], ["q"], ["1"], [{}])


# --- through the prompt pipeline --------------------------------------------------------------


def gym_config(model: str, *overrides: str):  # type: ignore[no-untyped-def]
    return load_config(
        None,
        [
            f"model.path={model}",
            "data.source=reasoning_gym",
            "data.reasoning_gym.datasets=[{name: basic_arithmetic, config: "
            + json.dumps(ARITHMETIC)
            + "}]",
            "data.reasoning_gym.size=12",
            "data.reasoning_gym.val_size=4",
            "data.max_prompt_length=512",  # the tiny tokenizer is nearly bytes
            *overrides,
        ],
    )


def test_rows_become_prompts_with_the_formats_instruction(tiny_task):
    cfg = gym_config(str(tiny_task["model"]))
    tok = load_tokenizer(tiny_task["model"])
    train = config_prompts(cfg, [], "data.train_files", tok, None)
    val = config_prompts(cfg, [], "data.val_files", tok, None)
    assert (len(train), len(val)) == (12, 4)
    row = train[0]
    assert row["prompt_text"] == row["row"]["question"]
    assert row["ground_truth"] == row["row"]["answer"]
    assert row["row"]["metadata"]["source_dataset"] == "basic_arithmetic"
    text = tok.decode(row["prompt_ids"])
    assert "Provide your answer between <answer> and </answer> tags" in text
    assert row["row"]["question"] in text
    own = config_prompts(
        gym_config(str(tiny_task["model"]), "data.system_prompt=Be brief."),
        [], "data.train_files", tok, None,
    )  # fmt: skip
    assert "Be brief." in tok.decode(own[0]["prompt_ids"]) and "<answer>" not in tok.decode(
        own[0]["prompt_ids"]
    )
    sft = config_sft(cfg, [], "data.train_files", tok)
    targets = [
        tok.decode([t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m])
        for r in sft.rows
    ]
    assert targets[0].startswith(f"<answer>{row['row']['answer']}</answer>")


def test_shots_are_the_first_training_rows_as_chat_turns_before_each_question(tiny_task):
    cfg = gym_config(
        str(tiny_task["model"]),
        "data.reasoning_gym.shots=2",
        "data.reasoning_gym.answer_format=full",
    )
    tok = load_tokenizer(tiny_task["model"])
    train = config_prompts(cfg, [], "data.train_files", tok, None)
    val = config_prompts(cfg, [], "data.val_files", tok, None)
    first = [r["row"] for r in train[:2]]  # the shots are the training rows' first two
    turns = [
        {"role": "user", "content": first[0]["question"]},
        {"role": "assistant", "content": str(first[0]["answer"])},
        {"role": "user", "content": first[1]["question"]},
        {"role": "assistant", "content": str(first[1]["answer"])},
    ]
    for row in (train[5], val[3]):
        assert row["row"]["prompt"] == [*turns, {"role": "user", "content": row["row"]["question"]}]
        assert row["prompt_text"] == row["row"]["question"]
        system = {"role": "system", "content": instruction("full")}
        expected = tok.apply_chat_template(
            [system, *row["row"]["prompt"]], add_generation_prompt=True, tokenize=False
        )
        assert tok.decode(row["prompt_ids"]) == expected
    sft = config_sft(cfg, [], "data.train_files", tok)
    mask = sft.rows[5]["loss_mask"]
    assert sft.rows[5]["input_ids"][: len(train[5]["prompt_ids"])] == train[5]["prompt_ids"]
    assert mask.index(1) == len(train[5]["prompt_ids"])  # no loss on the shots' answers
    target = [t for t, m in zip(sft.rows[5]["input_ids"], mask, strict=True) if m]
    assert tok.decode(target).startswith(str(train[5]["row"]["answer"]))


STEPS = "examples/reasoning_gym/steps.py:steps"


def test_reasoning_writes_the_working_before_the_answer_in_targets_and_shots():
    rows = gym_records(spec(answer_format="last_line", reasoning=STEPS, shots=1), "train")
    for record in rows:
        row = record.row
        *working, last = row["solution"].split("\n")
        assert last == row["answer"] and working, row["solution"]
        assert working[-1].endswith(f" = {row['answer']}")  # the last step's result
    assert rows[1].row["prompt"][1] == {"role": "assistant", "content": rows[0].row["solution"]}
    tagged = gym_records(spec(answer_format="answer_tag", reasoning=STEPS), "val")[0].row
    assert tagged["solution"].endswith(f"\n<answer>{tagged['answer']}</answer>")


@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum", "products"])
def test_the_examples_steps_compute_each_tasks_answer(name):
    from reasoning_gym.factory import create_dataset

    steps = load_callable(STEPS, "data.reasoning_gym.reasoning")
    entries = create_dataset(name, size=300, seed=7, **ARITHMETIC)
    for entry in entries:
        assert steps(entry).splitlines()[-1].split(" = ")[-1] == entry["answer"], entry


def test_the_examples_steps_by_hand():
    steps = load_callable(STEPS, "data.reasoning_gym.reasoning")
    written = steps({"metadata": {"expression": "-( -33 / 11 + 4 * -5 )"}})
    assert written == "-33 / 11 = -3\n4 * -5 = -20\n-3 + -20 = -23\n-(-23) = 23"
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        steps({"metadata": {"expression": "2 ** 3"}})


@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum", "products"])
def test_the_examples_step_credit_gives_the_worked_answer_every_step(name):
    from reasoning_gym.factory import create_dataset

    steps = load_callable(STEPS, "data.reasoning_gym.reasoning")
    right = load_callable("examples/reasoning_gym/steps.py:steps_right", "test")
    for entry in create_dataset(name, size=300, seed=7, **ARITHMETIC):
        worked = f"{steps(entry)}\n{entry['answer']}"
        assert right(worked, entry["metadata"]["expression"]) == 1.0, entry


def test_the_examples_step_credit_by_hand():
    right = load_callable("examples/reasoning_gym/steps.py:steps_right", "test")
    expression = "-( -19 - ( 43 - -46 ) )"  # 3 steps: 43 - -46, -19 - 89, the negation
    assert right("43 - -46 = 89\n-19 - 89 = -108\n-(-108) = 108\n108", expression) == 1.0
    assert right("43 - -46 = 89\n-19 - 89 = -118\n-(-118) = 118\n118", expression) == 1 / 3
    assert right("43 - -46 = 99\n-19 - 99 = -118\n-118", expression) == 0.0
    assert right("43 - -46 = 89\n43 - -46 = 89\n89", expression) == 1 / 3  # 43 used up
    assert right("1 + 1 = 2\n-(2) = -2\n-2", expression) == 0.0  # not the question's numbers
    assert right("108", expression) == 0.0  # no working
    rows = [{"source_dataset": "basic_arithmetic", "expression": expression}] * 3
    responses = ["43 - -46 = 89\n-19 - 89 = -108\n-(-108) = 108\n108", "43 - -46 = 89\n7", "0"]
    score = load_callable("examples/reasoning_gym/steps.py:step_credit", "test")
    got = score(responses, ["q"] * 3, ["108"] * 3, rows, ["last_line"] * 3)
    assert got == [1.0, pytest.approx(0.5 / 3), 0.0]


def test_reasoning_needs_a_format_with_room_for_it_and_text_back(tmp_path: Path):
    with pytest.raises(ValueError, match="answer_format=full reads the whole response"):
        spec(answer_format="full", reasoning=STEPS)
    bad = tmp_path / "bad.py"
    bad.write_text("def working(entry):\n    return len(entry['question'])\n")
    with pytest.raises(
        ConfigError,
        match=r"data.reasoning_gym.reasoning: .*bad.py:working returned int for "
        r"data.reasoning_gym \(train\) row 1; it must return the working as text \(str\)",
    ):
        gym_records(spec(answer_format="last_line", reasoning=f"{bad}:working"), "train")
    legs = spec(datasets=[{"name": "leg_counting"}], answer_format="last_line", reasoning=STEPS)
    with pytest.raises(
        ConfigError,
        match=r"data\.reasoning_gym\.reasoning: .*steps.py:steps raised KeyError for "
        r"data\.reasoning_gym \(train\) row 1: 'expression'",
    ):
        gym_records(legs, "train")
    with pytest.raises(ConfigError, match=r"data\.reasoning_gym\.reasoning: .* has no function"):
        gym_records(spec(answer_format="last_line", reasoning=f"{bad}:steps"), "train")


# --- treadle check ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gym_yaml(tiny_task, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("gym_check")
    config = {
        "model": {"path": str(tiny_task["model"])},
        "data": {
            "source": "reasoning_gym",
            "reasoning_gym": {
                "datasets": [{"name": "basic_arithmetic", "config": ARITHMETIC}],
                "size": 16,
                "val_size": 4,
            },
            "max_prompt_length": 96,
            "system_prompt": "Answer.",
            "batch_size": 4,
        },
        "rollout": {"n": 2, "max_new_tokens": 8},
        "reward": {"function": "reasoning_gym", "num_workers": 0},
        "actor": {"ppo_mini_batch_size": 8, "micro_batch_size": 8},
        "trainer": {"backend": "local", "output_dir": str(root / "run"), "progress": False},
    }
    path = root / "gym.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def check(capsys, path: str, *overrides: str, kind: str = "train") -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    code = main(["check", path, *overrides, "--kind", kind])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kind", ["train", "sft", "eval"])
def test_check_passes_and_counts_the_rows(gym_yaml, capsys, kind):
    rl_only = ["rollout.n=4"] if kind == "sft" else []  # (the default: sft refuses RL's n=2)
    code, out, err = check(capsys, gym_yaml, *rl_only, kind=kind)
    assert code == 0, err
    if kind != "eval":
        assert "data.reasoning_gym (train): 16 rows" in out
    assert "data.reasoning_gym (val): 4 rows" in out


DATASET = "data.reasoning_gym.datasets"


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        (
            f"{DATASET}=[{{name: basic_arithmetc}}]",
            r"datasets\[0\]\.name: reasoning-gym has no dataset 'basic_arithmetc' \(did you "
            r"mean 'basic_arithmetic'\?\)",
        ),
        (
            f"{DATASET}=[{{name: basic_arithmetic, config: {{min_term: 2}}}}]",
            r"datasets\[0\]\.config\.min_term: basic_arithmetic has no setting 'min_term' "
            r"\(did you mean 'min_terms'\?\)",
        ),
        (
            f"{DATASET}=[{{name: basic_arithmetic, config: {{min_terms: 4, max_terms: 3}}}}]",
            r"datasets\[0\]\.config: invalid for basic_arithmetic: max_terms must be >= min_terms",
        ),
        (
            f"{DATASET}=[{{name: basic_arithmetic, config: {{seed: 3}}}}]",
            r"datasets\[0\]\.config\.seed: set data\.reasoning_gym\.seed",
        ),
        (f"{DATASET}=[]", r"data\.source=reasoning_gym needs data\.reasoning_gym\.datasets"),
        ("data.train_files=[a.jsonl]", r"remove data\.train_files and data\.val_files"),
        (
            f"{DATASET}=[{{name: gcd}}, {{name: gcd}}]",
            r"data\.reasoning_gym\.datasets names a dataset twice",
        ),
        ("data.reasoning_gym.answer_format=xml", r"answer_format: input should be 'answer_tag'"),
        ("data.reasoning_gym.size=2", r"data\.reasoning_gym\.size: 2 rows, fewer than one batch"),
    ],
)
def test_check_names_the_bad_key(gym_yaml, capsys, override, pattern):
    code, out, err = check(capsys, gym_yaml, override)
    assert code == 2 and "Traceback" not in out + err
    errors = [line for line in err.splitlines() if line.startswith("treadle: error: ")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), err


def test_check_refuses_the_source_for_pairs(gym_yaml, capsys):
    code, _, err = check(capsys, gym_yaml, kind="dpo")
    assert code == 2 and "data.source=reasoning_gym gives prompts" in err


def test_bad_dataset_is_a_config_error_when_rows_are_drawn():
    with pytest.raises(ConfigError, match=r"has no dataset 'nope'"):
        gym_records(spec(datasets=[{"name": "nope"}]), "train")


# --- end to end ------------------------------------------------------------------------------


def test_two_rl_steps_through_the_source(gym_yaml, tmp_path: Path):
    from treadle.trainers.rl import train

    cfg = load_config(
        gym_yaml,
        [
            "rollout.engine=hf",
            "algorithm.kl_coef=0",
            "trainer.total_steps=2",
            "trainer.eval_every=2",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
    )
    final = train(cfg)
    steps = read_metrics(tmp_path / "run")
    trained = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in trained] == [1, 2]
    assert all(0.0 <= s["reward/mean"] <= 1.0 for s in trained)
    assert 0.0 <= final["eval/val/accuracy"] <= 1.0
