"""The built-in arithmetic task: problems, worked answers, verifier, tokenizer, tiny model."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from treadle.models.loading import load_tokenizer
from treadle.tasks import arithmetic as ar

SMALL_MODEL = ar.ModelShape(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    rows = ar.generate_problems(300, seed=0)
    return [text for r in rows for text in (r["prompt"], r["solution"])]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    out = tmp_path_factory.mktemp("tok")
    ar.build_tokenizer(corpus, out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path):  # type: ignore[no-untyped-def]
    return load_tokenizer(tok_dir)


# --- problems --------------------------------------------------------------------------------


def test_generation_is_deterministic_per_seed():
    assert ar.generate_problems(50, seed=1) == ar.generate_problems(50, seed=1)
    assert ar.generate_problems(50, seed=1) != ar.generate_problems(50, seed=2)


def test_rows_are_distinct_correct_and_non_negative():
    rows = ar.generate_problems(2000, seed=3, min_value=0, max_value=99)
    assert len({r["prompt"] for r in rows}) == 2000
    for r in rows:
        a, op, b = re.fullmatch(r"What is (\d+)([+-])(\d+)\?", r["prompt"]).groups()  # type: ignore[union-attr]
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert r["answer"] == str(expected)
        assert expected >= 0
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
    assert any("+" in r["prompt"] for r in rows) and any("-" in r["prompt"] for r in rows)


def test_ops_and_range_are_respected():
    rows = ar.generate_problems(30, seed=0, min_value=10, max_value=20, ops="-")
    assert all("-" in r["prompt"] and "+" not in r["prompt"] for r in rows)
    with pytest.raises(ValueError, match="only 3"):
        ar.generate_problems(4, seed=0, min_value=0, max_value=1, ops="-")  # 0-0, 1-0, 1-1
    with pytest.raises(ValueError, match="ops"):
        ar.generate_problems(3, seed=0, ops="*")


@pytest.mark.parametrize(
    ("a", "op", "b", "expected"),
    [
        (47, "+", 38, "47+38: 7+8=15 carry 1, 4+3+1=8. Answer: 85"),
        (99, "+", 99, "99+99: 9+9=18 carry 1, 9+9+1=19 carry 1. Answer: 198"),
        (7, "+", 38, "7+38: 7+8=15 carry 1, 0+3+1=4. Answer: 45"),
        (3, "+", 4, "3+4: 3+4=7. Answer: 7"),
        (83, "-", 47, "83-47: 13-7=6 borrow 1, 8-1-4=3. Answer: 36"),
        (50, "-", 47, "50-47: 10-7=3 borrow 1, 5-1-4=0. Answer: 3"),
        (100, "-", 1, "100-1: 10-1=9 borrow 1, 10-1-0=9 borrow 1, 1-1-0=0. Answer: 99"),
        (5, "-", 5, "5-5: 5-5=0. Answer: 0"),
    ],
)
def test_worked_solution_format(a: int, op: str, b: int, expected: str):
    assert ar.worked_solution(a, op, b) == expected


def test_every_step_of_every_worked_solution_is_a_true_equation():
    for r in ar.generate_problems(500, seed=5, max_value=999):
        body = r["solution"].split(": ", 1)[1].rsplit(". Answer: ", 1)[0]
        for step in body.split(", "):
            lhs, rhs = step.removesuffix(" carry 1").removesuffix(" borrow 1").split("=")
            assert eval(lhs) == int(rhs), (r["solution"], step)


def test_write_splits_are_disjoint_and_test_does_not_depend_on_n_train(tmp_path: Path):
    paths = ar.write_splits(tmp_path / "a", n_train=300, n_test=50, seed=0)
    train = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    test = [json.loads(line) for line in paths["test"].read_text().splitlines()]
    assert (len(train), len(test)) == (300, 50)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert set(train[0]) == {"prompt", "answer", "solution"}
    other = ar.write_splits(tmp_path / "b", n_train=10, n_test=50, seed=0)
    assert other["test"].read_text() == paths["test"].read_text()


# --- verifier --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("47+38: 7+8=15 carry 1, 4+3+1=8. Answer: 85", "85"),
        ("Answer: 85", "85"),
        ("answer:85", "85"),
        ("Answer: 12. Wait, Answer: 13", "13"),
        ("Answer: 085", "85"),
        ("Answer: -7", "-7"),
        ("Answer: -00", "0"),
        ("Answer: " + "9" * 5000, "9" * 5000),  # longer than int() accepts
        ("Answer: 9 and then 100", "9"),
        ("the sum is 85", "85"),
        ("83-47: 13-7=6 borrow 1, 8-1-4=3", "3"),
        ("it is -12", "-12"),
        ("5-3", "3"),
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: str | None):
    assert ar.extract_answer(text) == expected


def test_worked_solutions_score_one_and_wrong_answers_zero():
    rows = ar.generate_problems(1000, seed=7, max_value=999)
    assert all(ar.compute_score(r["prompt"], r["solution"], r["answer"]) == 1.0 for r in rows)
    wrong = [str(int(r["answer"]) + 1) for r in rows]
    assert all(
        ar.compute_score(r["prompt"], r["solution"], w) == 0.0
        for r, w in zip(rows, wrong, strict=True)
    )
    assert ar.compute_score("What is 40+45?", "Answer: 85", "85") == 1.0
    assert ar.compute_score("What is 40+45?", "I don't know", "85") == 0.0
    assert ar.compute_score("What is 40+45?", "Answer: 085", " 85") == 1.0
    assert ar.compute_score("What is 40+45?", "8" * 5000, "85") == 0.0
    with pytest.raises(ValueError):
        ar.compute_score("p", "Answer: 1", "one")


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_round_trips_task_texts(tok, corpus: list[str]):  # type: ignore[no-untyped-def]
    texts = [*corpus[:200], "  two  spaces\nand a newline\t", "caf\u00e9 \u00fc 12,345!", ""]
    for text in texts:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_every_digit_is_its_own_token(tok):  # type: ignore[no-untyped-def]
    for digit in "0123456789":
        assert len(tok.encode(digit, add_special_tokens=False)) == 1
    tokens = tok.convert_ids_to_tokens(tok.encode("What is 907+1234? Answer: 2141"))
    digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
    assert digit_tokens == list("907") + list("1234") + list("2141")


def test_tokenizer_special_tokens_and_size(tok):  # type: ignore[no-untyped-def]
    assert 259 < len(tok) <= 400  # 256 bytes + 3 specials + merges
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|pad|>"
    assert tok.bos_token is None
    assert tok.convert_tokens_to_ids(["<|pad|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.encode("What is 1+2?") == tok.encode("What is 1+2?", add_special_tokens=False)


def test_chat_template_is_chatml(tok):  # type: ignore[no-untyped-def]
    user = [{"role": "user", "content": "What is 1+2?"}]
    text = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 1+2?<|im_end|>\n<|im_start|>assistant\n"
    convo = [
        {"role": "system", "content": "Be brief."},
        *user,
        {"role": "assistant", "content": "Answer: 3"},
    ]
    assert tok.apply_chat_template(convo, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 1+2?<|im_end|>\n"
        "<|im_start|>assistant\nAnswer: 3<|im_end|>\n"
    )
    ids = tok.encode(text)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text


# --- model and prepare -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_folder_loads_with_tied_weights(tmp_path: Path, tok_dir: Path, arch: str):
    tokenizer = load_tokenizer(tok_dir)
    state = torch.random.get_rng_state()
    shape = replace(SMALL_MODEL, arch=arch)
    out = ar.build_tiny_model(tokenizer, tmp_path, shape, seed=3)  # type: ignore[arg-type]
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == arch
    assert model.config.eos_token_id == tokenizer.eos_token_id == 2
    assert model.config.pad_token_id == tokenizer.pad_token_id == 0
    logits = model(torch.tensor([[1, 5, 6, 7, 8], [1, 9, 10, 11, 12]])).logits
    assert logits.shape == (2, 5, len(tokenizer))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    reloaded = load_tokenizer(out)
    text = "<|im_start|>user\nWhat is 12+34?<|im_end|>\n"
    assert reloaded.encode(text) == tokenizer.encode(text)


def test_tiny_model_init_is_seeded(tmp_path: Path, tok_dir: Path):
    tokenizer = load_tokenizer(tok_dir)
    weights = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        ar.build_tiny_model(tokenizer, tmp_path / name, SMALL_MODEL, seed=seed)  # type: ignore[arg-type]
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        weights[name] = model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(weights["a"], weights["b"])
    assert not torch.equal(weights["a"], weights["c"])


def test_prepare_builds_everything_and_reuses_it(tmp_path: Path):
    kwargs = {"n_train": 60, "n_test": 20, "shape": SMALL_MODEL}
    paths = ar.prepare(tmp_path, **kwargs)  # type: ignore[arg-type]
    assert paths["model"] == tmp_path / "model_init"
    assert len(paths["train"].read_text().splitlines()) == 60
    assert json.loads(paths["manifest"].read_text())["n_train"] == 60
    weights = paths["model"] / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert ar.prepare(tmp_path, **kwargs) == paths  # type: ignore[arg-type]
    assert weights.stat().st_mtime_ns == mtime  # reused
    ar.prepare(tmp_path, **{**kwargs, "n_train": 70})  # type: ignore[arg-type]
    assert len(paths["train"].read_text().splitlines()) == 70
    assert json.loads(paths["manifest"].read_text())["n_train"] == 70


def test_prepare_builds_a_smaller_student_with_the_same_tokenizer(tmp_path: Path):
    kwargs = {"n_train": 60, "n_test": 20, "shape": SMALL_MODEL}
    paths = ar.prepare(tmp_path, **kwargs)  # type: ignore[arg-type]
    big = json.loads((paths["model"] / "config.json").read_text())
    small = json.loads((paths["model_small"] / "config.json").read_text())
    assert small["vocab_size"] == big["vocab_size"]
    assert small["num_hidden_layers"] == max(big["num_hidden_layers"] // 2, 1)
    assert small["hidden_size"] // small["num_attention_heads"] == (
        big["hidden_size"] // big["num_attention_heads"]
    )  # the head size vLLM's CPU attention needs
    small_tok, big_tok = load_tokenizer(paths["model_small"]), load_tokenizer(paths["model"])
    assert small_tok.get_vocab() == big_tok.get_vocab()
    text = "What is 12+34? 12+34: 2+4=6, 1+3=4. Answer: 46"
    assert small_tok.encode(text) == big_tok.encode(text)
    # a task prepared before the small model existed gets it, and keeps its data
    shutil.rmtree(paths["model_small"])
    train = paths["train"].stat().st_mtime_ns
    assert ar.prepare(tmp_path, **kwargs) == paths  # type: ignore[arg-type]
    assert (paths["model_small"] / "model.safetensors").is_file()
    assert paths["train"].stat().st_mtime_ns == train
