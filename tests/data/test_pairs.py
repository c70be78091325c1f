"""Preference-pair data: layout, chat-format responses, errors by message, the task's pairs."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from treadle.config import load_config
from treadle.data import TextOptions, collate_pairs, load_pair_dataset, load_prompt_dataset
from treadle.models.loading import load_tokenizer
from treadle.runtime.errors import DataError
from treadle.tasks import arithmetic as ar
from treadle.trainers.pairs import load_pairs


@pytest.fixture(scope="module")
def tok(tiny_task):  # type: ignore[no-untyped-def]
    return load_tokenizer(tiny_task["model"])


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


PAIRS = [
    {"prompt": "What is 1+2?", "answer": "3", "chosen": "Answer: 3", "rejected": "Answer: 4"},
    {
        "prompt": "What is 47+38?",
        "answer": "85",
        "chosen": [{"role": "assistant", "content": ar.worked_solution(47, "+", 38)}],
        "rejected": [{"role": "assistant", "content": "47+38: 7+8=15. Answer: 75"}],
    },
]


def load(tok, path, **kwargs):  # type: ignore[no-untyped-def]
    args = {"max_prompt_length": 64, "max_response_length": 48}
    return load_pair_dataset([path], tok, TextOptions(**{**args, **kwargs}))


def test_pairs_are_prompt_plus_response_and_eos(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    ds = load(tok, path)
    prompts = load_prompt_dataset([path], tok, TextOptions(max_prompt_length=64))
    eos = tok.eos_token_id
    for row, prompt in zip(ds.rows, prompts.rows, strict=True):
        assert row["prompt_ids"] == prompt["prompt_ids"]  # rendered as the RL prompts are
        assert row["chosen_ids"][-1] == eos and row["rejected_ids"][-1] == eos
    assert tok.decode(ds[0]["chosen_ids"]) == "Answer: 3<|im_end|>"
    # A chat-format response (one assistant message) is its content.
    assert ds[1]["chosen_ids"] == [*tok.encode(ar.worked_solution(47, "+", 38)), eos]
    assert ds[1]["ground_truth"] == "85"
    batch = collate_pairs(ds.rows, ds.pad_id)
    assert batch["prompts"].shape[0] == 2 and batch["chosen"].shape == batch["rejected"].shape
    assert batch["prompt_mask"][0, 0] == 0 and batch["prompt_mask"][:, -1].all()  # left-padded
    n = len(ds[0]["rejected_ids"])
    assert batch["rejected_mask"][0].tolist() == [1] * n + [0] * (batch["rejected"].shape[1] - n)
    assert torch.equal(batch["rejected"][0, :n], torch.tensor(ds[0]["rejected_ids"]))


def test_file_without_pair_columns_says_which_keys_to_set(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    rows = [{"prompt": "What is 1+2?", "good": "Answer: 3", "bad": "Answer: 4"}]
    path = write_jsonl(tmp_path / "prefs.jsonl", rows)
    with pytest.raises(DataError) as info:
        load(tok, path)
    assert str(info.value) == (
        f"data.train_files: {path} has no column 'chosen' (data.chosen_key), 'rejected' "
        "(data.rejected_key); its columns are prompt, good, bad. A preference file needs a "
        "prompt, a chosen and a rejected response: set data.prompt_key, data.chosen_key and "
        "data.rejected_key to the columns that hold them"
    )
    # ... and with those keys set in the config, the same file loads.
    cfg = load_config(
        "examples/arithmetic/dpo.yaml",
        [f"model.path={Path(tok.name_or_path)}", "data.chosen_key=good", "data.rejected_key=bad"],
    )
    assert len(load_pairs(cfg, [path], "data.train_files")) == 1


def test_pairs_whose_prompt_is_the_conversation_both_start_with(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    """TRL's implicit-prompt format (Anthropic HH, UltraFeedback binarized): no prompt column,
    chosen and rejected whole conversations that differ in their last, assistant message.
    The shared messages are the prompt, rendered as an explicit one is; DPO and KTO read it."""
    from treadle.data import load_unpaired_dataset

    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"}]
    answer = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    implicit = {
        "chosen": [*asked, *answer("Answer: 3")],
        "rejected": [*asked, *answer("Answer: 4")],
    }
    explicit = {"prompt": asked, "chosen": "Answer: 3", "rejected": "Answer: 4"}
    got = load(tok, write_jsonl(tmp_path / "hh.jsonl", [implicit]))[0]
    want = load(tok, write_jsonl(tmp_path / "explicit.jsonl", [explicit]))[0]
    assert {k: got[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} == {
        k: want[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")
    }
    assert got["prompt_text"] == "1+2?"
    options = TextOptions(max_prompt_length=64, max_response_length=48)
    examples = load_unpaired_dataset([str(tmp_path / "hh.jsonl")], tok, options)
    assert [r["completion_ids"] for r in examples.rows] == [
        want["chosen_ids"],
        want["rejected_ids"],
    ]
    # conversations that part before their last message are not a pair
    two = {**implicit, "rejected": [*asked, *answer("Hm."), *asked[1:], *answer("Answer: 4")]}
    with pytest.raises(
        DataError,
        match=r"hh2\.jsonl row 1: without a 'prompt' field \(data\.prompt_key\), 'chosen' and "
        r"'rejected' must be conversations that differ only in their last message, the "
        r"assistant's \(they share 2 message\(s\), then have 1 and 3\)",
    ):
        load(tok, write_jsonl(tmp_path / "hh2.jsonl", [two]))


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({**PAIRS[0], "rejected": ""}, "row 2: response field 'rejected' is missing or empty"),
        ({**PAIRS[0], "rejected": "Answer: 3"}, "row 2: the chosen and rejected responses are"),
        (
            {**PAIRS[0], "chosen": [{"role": "user", "content": "Answer: 3"}]},
            "row 2: field 'chosen' must be a string or a list of one {'role': 'assistant'",
        ),
    ],
)
def test_bad_pair_row_names_file_and_row(tok, tmp_path: Path, bad_row, message):  # type: ignore[no-untyped-def]
    first = {**PAIRS[0], "chosen": [{"role": "assistant", "content": "Answer: 3"}]}
    path = write_jsonl(tmp_path / "pairs.jsonl", [first, bad_row])
    with pytest.raises(
        DataError, match=rf"^data.train_files: {path} {message}".replace("{", r"\{")
    ):
        load(tok, path)


def test_overlong_pairs_are_filtered_or_rejected(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    long = {**PAIRS[0], "rejected": "Answer: " + "4" * 30}
    path = write_jsonl(tmp_path / "pairs.jsonl", [PAIRS[0], long])
    ds = load(tok, path, max_response_length=20)
    assert len(ds) == 1 and ds.n_filtered == 1
    with pytest.raises(DataError, match=r"row 2: rejected is \d+ tokens, longer than rollout"):
        load(tok, path, max_response_length=20, overlong="error")
    # none left: the keys that set the limits (a DPO user has no reason to look in rollout)
    with pytest.raises(
        DataError,
        match=r"^data\.train_files: every pair is over the length limits: raise "
        r"data\.max_prompt_length \(prompts\) or rollout\.max_new_tokens \(chosen and rejected",
    ):
        load(tok, path, max_response_length=2)


def test_task_pairs_prefer_the_correct_worked_answer(tiny_task):  # type: ignore[no-untyped-def]
    for split in ("train", "test"):
        problems = [json.loads(x) for x in tiny_task[split].read_text().splitlines()]
        pairs = [json.loads(x) for x in tiny_task[f"pairs_{split}"].read_text().splitlines()]
        assert [p["prompt"] for p in pairs] == [p["prompt"] for p in problems]
        for pair in pairs:
            assert ar.compute_score(pair["prompt"], pair["chosen"], pair["answer"]) == 1.0
            assert ar.compute_score(pair["prompt"], pair["rejected"], pair["answer"]) == 0.0
            head = pair["chosen"].split(":")[0]
            assert pair["rejected"].startswith(head + ": ")  # the same problem, worked wrongly
    # The slips, written out as a student would: a carry not applied, a column off by one.
    variants = {ar.wrong_solution(47, "+", 38, random.Random(s)) for s in range(60)}
    assert "47+38: 7+8=15 carry 1, 4+3=7. Answer: 75" in variants
    assert "47+38: 7+8=16 carry 1, 4+3+1=8. Answer: 86" in variants
    assert "83-47: 13-7=6 borrow 1, 8-4=4. Answer: 46" in {
        ar.wrong_solution(83, "-", 47, random.Random(s)) for s in range(60)
    }
    assert all(ar.extract_answer(v) != "85" for v in variants)


# ----------------------------------------------------------------------------- unpaired (KTO)

KEYS = {
    "prompt_key": "prompt",
    "completion_key": "completion",
    "label_key": "label",
    "chosen_key": "chosen",
    "rejected_key": "rejected",
    "answer_key": "answer",
}


def load_unpaired(tok, path, **kwargs):  # type: ignore[no-untyped-def]
    from treadle.data import load_unpaired_dataset

    args = {"max_prompt_length": 64, "max_response_length": 48, **KEYS}
    return load_unpaired_dataset([path], tok, TextOptions(**{**args, **kwargs}))


def test_unpaired_rows_are_prompt_completion_and_label(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    rows = [
        {"prompt": "What is 1+2?", "completion": "Answer: 3", "label": True, "answer": "3"},
        {"prompt": "What is 1+2?", "completion": "Answer: 4", "label": False},
    ]
    ds = load_unpaired(tok, write_jsonl(tmp_path / "u.jsonl", rows))
    pairs = load(tok, write_jsonl(tmp_path / "p.jsonl", PAIRS[:1]))
    assert [r["label"] for r in ds.rows] == [True, False]
    # the same tokens as the pair's chosen and rejected responses
    assert ds[0]["completion_ids"] == pairs[0]["chosen_ids"]
    assert ds[1]["completion_ids"] == pairs[0]["rejected_ids"]
    assert ds[0]["prompt_ids"] == pairs[0]["prompt_ids"]
    assert (ds[0]["ground_truth"], ds[1]["ground_truth"]) == ("3", "")


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "p", "completion": "c", "label": 1}], r"u\.jsonl row 1: label field 'label' "),
        ([{"prompt": "p", "completion": "c", "label": "yes"}], r"must be true or false"),
        ([{"prompt": "p", "completion": "c"}], r"neither the columns 'completion' and 'label'"),
        ([{"prompt": "p", "completion": "", "label": True}], r"field 'completion' is missing"),
    ],
)
def test_unpaired_errors_name_the_row_and_the_keys(tok, tmp_path: Path, rows, message):  # type: ignore[no-untyped-def]
    with pytest.raises(DataError, match=message):
        load_unpaired(tok, write_jsonl(tmp_path / "u.jsonl", rows))


def test_pair_and_unpaired_files_do_not_mix(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    from treadle.data import load_unpaired_dataset

    a = write_jsonl(tmp_path / "a.jsonl", PAIRS[:1])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "completion": "c", "label": True}])
    with pytest.raises(DataError, match="mixes files of pairs and of unpaired examples"):
        load_unpaired_dataset(
            [a, b], tok, TextOptions(max_prompt_length=64, max_response_length=48, **KEYS)
        )


def test_an_overlong_completion_drops_that_example_only(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    rows = [{"prompt": "What is 1+2?", "chosen": "Answer: 3", "rejected": "x " * 80}]
    ds = load_unpaired(tok, write_jsonl(tmp_path / "p.jsonl", rows))
    assert [r["label"] for r in ds.rows] == [True] and ds.n_filtered == 1
    with pytest.raises(DataError, match=r"completion is \d+ tokens, longer than rollout"):
        load_unpaired(tok, write_jsonl(tmp_path / "p.jsonl", rows), overlong="error")
    with pytest.raises(DataError, match=r"every example is over the length limits: raise data"):
        load_unpaired(tok, write_jsonl(tmp_path / "p.jsonl", rows), max_response_length=1)


def test_kto_mismatched_completions_never_come_from_the_same_prompt():
    """A pair file gives each prompt two adjacent examples; rotating completions by one would
    pair half the prompts with their own other completion. The shift skips past them."""
    from treadle.data import collate_unpaired

    def row(prompt: int, completion: int, label: bool) -> dict:
        return {"prompt_ids": [prompt], "completion_ids": [completion], "label": label}

    rows = [row(p, 10 * p + c, c == 0) for p in (1, 2, 3) for c in (0, 1)]
    out = collate_unpaired(rows, pad_id=0)
    # shift 2: row i gets row i-2's completion, always another prompt's
    assert out["kl_completions"][:, 0].tolist() == [30, 31, 10, 11, 20, 21]
    assert out["labels"].tolist() == [1, 0, 1, 0, 1, 0]
    distinct = [row(p, p, True) for p in (1, 2, 3)]  # TRL's rotation by one
    assert collate_unpaired(distinct, 0)["kl_completions"][:, 0].tolist() == [3, 1, 2]
    same = [row(1, c, True) for c in (1, 2)]  # one prompt only: no shift avoids it
    assert collate_unpaired(same, 0)["kl_completions"][:, 0].tolist() == [2, 1]
