"""Datasets from files: validation messages, templating, length filtering, padding, sampling."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from jinja2 import TemplateError
from tiny_models import chat_style, shipped_style, shipped_templates

from treadle.data import (
    ResumableSampler,
    TextOptions,
    collate_prompts,
    collate_sft,
    load_prompt_dataset,
    load_sft_dataset,
)
from treadle.data.templating import end_of_turn, render
from treadle.models.loading import load_tokenizer
from treadle.runtime.errors import DataError
from treadle.tasks import arithmetic as ar


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("tok")
    rows = ar.generate_problems(200, seed=0)
    ar.build_tokenizer([t for r in rows for t in (r["prompt"], r["solution"])], out)
    return load_tokenizer(out)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [
    {"prompt": "What is 1+2?", "answer": "3", "solution": "1+2: 1+2=3. Answer: 3"},
    {"prompt": "What is 47+38?", "answer": 85, "solution": ar.worked_solution(47, "+", 38)},
    {"prompt": "What is 9-4?", "answer": "5", "solution": "9-4: 9-4=5. Answer: 5"},
]


def trained(tok, row) -> str:  # type: ignore[no-untyped-def]
    """The text of an SFT row's targets."""
    return str(
        tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
    )


def load(tok, files, **kwargs):  # type: ignore[no-untyped-def]
    args = {"max_prompt_length": 64, "prompt_key": "prompt"}
    return load_prompt_dataset(files, tok, TextOptions(**{**args, **kwargs}))


# --- prompts ---------------------------------------------------------------------------------


def test_prompt_rows_are_rendered_tokenized_and_identified(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    ds = load(tok, [write_jsonl(tmp_path / "train.jsonl", ROWS)])
    assert len(ds) == 3 and ds.n_filtered == 0 and ds.pad_id == 0
    row = ds[1]
    assert row["uid"] == "train.jsonl:2"
    assert row["prompt_text"] == "What is 47+38?"
    assert row["ground_truth"] == "85"  # numbers become strings
    rendered = "<|im_start|>user\nWhat is 47+38?<|im_end|>\n<|im_start|>assistant\n"
    assert row["prompt_ids"] == tok.encode(rendered, add_special_tokens=False)


def test_raw_prompts_system_prompt_and_message_lists(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    path = write_jsonl(tmp_path / "a.jsonl", ROWS[:1])
    raw = load(tok, [path], apply_chat_template=False)
    assert tok.decode(raw[0]["prompt_ids"]) == "What is 1+2?"
    system = load(tok, [path], system_prompt="Be brief.")
    assert tok.decode(system[0]["prompt_ids"]).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1+2?"
    )
    chat = [{"role": "user", "content": "What is 1+2?"}]
    listed = load(tok, [write_jsonl(tmp_path / "b.jsonl", [{"prompt": chat, "answer": "3"}])])
    assert listed[0]["prompt_ids"] == load(tok, [path])[0]["prompt_ids"]
    assert listed[0]["prompt_text"] == "What is 1+2?"


def test_several_files_and_parquet(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    parquet = tmp_path / "more.parquet"
    pd.DataFrame(ROWS[:2]).astype({"answer": str}).to_parquet(parquet)
    ds = load(tok, [write_jsonl(tmp_path / "train.jsonl", ROWS), str(parquet)])
    assert [r["uid"] for r in ds.rows] == [
        "train.jsonl:1",
        "train.jsonl:2",
        "train.jsonl:3",
        "more.parquet:1",
        "more.parquet:2",
    ]
    assert ds[4]["ground_truth"] == "85"
    sub = tmp_path / "sub"
    sub.mkdir()
    twin = write_jsonl(sub / "train.jsonl", ROWS[:1])  # same name: ids carry the whole path
    assert load(tok, [str(tmp_path / "train.jsonl"), twin])[3]["uid"] == f"{twin}:1"


def test_missing_file_and_unknown_format(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=f"^data.train_files: file '{missing}' does not exist$"):
        load(tok, [str(missing)])
    csv = tmp_path / "x.csv"
    csv.write_text("prompt\nhi\n")
    with pytest.raises(DataError, match="is not JSONL"):
        load(tok, [str(csv)])
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "What is 1+2?", "answer": "3"}\n{"prompt": \n')
    with pytest.raises(DataError, match=f"data.val_files: cannot read '{broken}'"):
        load(tok, [str(broken)], config_key="data.val_files")


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({"answer": "1"}, "prompt field 'prompt' is missing or empty"),
        ({"prompt": "", "answer": "1"}, "prompt field 'prompt' is missing or empty"),
        ({"prompt": "   ", "answer": "1"}, "prompt field 'prompt' is missing or empty"),
        ({"prompt": "What is 1+1?"}, "answer field 'answer' is missing or empty"),
        ({"prompt": "What is 1+1?", "answer": None}, "answer field 'answer' is missing or empty"),
        (
            {"prompt": [{"role": "user"}], "answer": "1"},
            "field 'prompt' must be a string or a list of {'role': str, 'content': str} messages",
        ),
    ],
)
def test_bad_row_names_file_row_and_key(tok, tmp_path: Path, bad_row, message):  # type: ignore[no-untyped-def]
    path = write_jsonl(tmp_path / "train.jsonl", [*ROWS[:2], bad_row])
    with pytest.raises(DataError) as info:
        load(tok, [path])
    assert str(info.value) == f"data.train_files: {path} row 3: {message}"


def test_overlong_prompts_are_filtered_with_a_count(tok, tmp_path: Path, caplog):  # type: ignore[no-untyped-def]
    long_row = {"prompt": "What is " + "1" * 40 + "+2?", "answer": "0"}
    path = write_jsonl(tmp_path / "train.jsonl", [ROWS[0], long_row, ROWS[2]])
    limit = len(load(tok, [path], max_prompt_length=200)[1]["prompt_ids"]) - 1
    with caplog.at_level(logging.WARNING, logger="treadle"):
        ds = load(tok, [path], max_prompt_length=limit)
    assert [r["uid"] for r in ds.rows] == ["train.jsonl:1", "train.jsonl:3"]
    assert ds.n_filtered == 1
    assert "filtered 1 of 3 rows longer than max_prompt_length" in caplog.text
    with pytest.raises(DataError) as info:
        load(tok, [path], max_prompt_length=limit, overlong="error")
    assert str(info.value).startswith(
        f"data.train_files: {path} row 2: prompt is {limit + 1} tokens, "
        f"longer than max_prompt_length={limit}"
    )
    with pytest.raises(DataError, match="every prompt is longer"):
        load(tok, [path], max_prompt_length=3)


def test_collate_prompts_left_pads():
    ids, mask = collate_prompts([[5, 6, 7], [8], []], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long


# --- SFT -------------------------------------------------------------------------------------


def test_sft_example_masks_the_prompt(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    ds = load_sft_dataset([path], tok, TextOptions(max_length=128))
    row = ds[1]
    prompt = "<|im_start|>user\nWhat is 47+38?<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    n = len(prompt_ids)
    assert row["input_ids"][:n] == prompt_ids
    assert row["loss_mask"] == [0] * n + [1] * (len(row["input_ids"]) - n)
    assert trained(tok, row) == ar.worked_solution(47, "+", 38) + "<|im_end|>"
    assert row["input_ids"][-1] == tok.eos_token_id and row["loss_mask"][-1] == 1


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 1+2?"},
    {"role": "assistant", "content": "Answer: 3"},
    {"role": "user", "content": "And 3+4?"},
    {"role": "assistant", "content": "Answer: 7"},
]


def test_sft_messages_train_on_assistant_turns_only(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    messages = CHAT
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    row = load_sft_dataset([path], tok, TextOptions(max_length=128))[0]
    assert trained(tok, row) == "Answer: 3<|im_end|>Answer: 7<|im_end|>"
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(row["input_ids"]) == full.removesuffix("\n")
    no_reply = write_jsonl(tmp_path / "bad.jsonl", [{"messages": messages[:2]}])
    with pytest.raises(DataError, match="row 1: 'messages' has no assistant turn"):
        load_sft_dataset([no_reply], tok, TextOptions(max_length=128))


def test_a_template_that_takes_no_system_message_and_ends_turns_with_its_own_token(
    tok, tmp_path: Path
):  # type: ignore[no-untyped-def]
    """Gemma 2's template: the system message goes before the first user message's text (the
    template raises on a system role), and each model turn is trained to end with
    <end_of_turn>, the token the template closes it with, not the tokenizer's <eos> (and
    Phi-3's with <|end|>)."""
    gemma = chat_style(tok, "gemma2")
    assert end_of_turn(tok) == (tok.eos_token_id, "<|im_end|>")  # ChatML: its EOS
    end = gemma.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn(gemma) == (end, "<end_of_turn>") and end != gemma.eos_token_id
    messages = CHAT
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    row = load_sft_dataset([path], gemma, TextOptions(max_length=128))[0]
    assert gemma.decode(row["input_ids"]) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 1+2?<end_of_turn>\n"
        "<start_of_turn>model\nAnswer: 3<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+4?<end_of_turn>\n"
        "<start_of_turn>model\nAnswer: 7<end_of_turn>"
    )
    assert trained(gemma, row) == "Answer: 3<end_of_turn>Answer: 7<end_of_turn>"
    # the turn as the template writes it: Gemma's trims it, ChatML's keeps it as it is
    spaced = [CHAT[1], {"role": "assistant", "content": " Answer: 3\n"}]
    spaced_path = write_jsonl(tmp_path / "spaced.jsonl", [{"messages": spaced}])
    for styled, turn in ((gemma, "Answer: 3<end_of_turn>"), (tok, " Answer: 3\n<|im_end|>")):
        row = load_sft_dataset([spaced_path], styled, TextOptions(max_length=128))[0]
        assert trained(styled, row) == turn
    # a prompt/response row's response too; without the template, the EOS
    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS[:1])
    for templated, closer in ((True, "<end_of_turn>"), (False, "<eos>")):
        options = TextOptions(max_length=128, apply_chat_template=templated)
        row = load_sft_dataset([rows], gemma, options)[0]
        assert trained(gemma, row) == ROWS[0]["solution"] + closer
    # Phi-3's closes a turn with <|end|> and a finished conversation with its EOS
    phi3 = chat_style(tok, "phi3")
    row = load_sft_dataset([path], phi3, TextOptions(max_length=128))[0]
    assert trained(phi3, row) == "Answer: 3<|end|>Answer: 7<|end|>"
    # A refusal that is not about the system message is the template's own, and a data row's
    # names its file, row and field.
    two_users = [messages[1], messages[3]]
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        render(gemma, [messages[0], *two_users], generation=True)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": two_users}])
    with pytest.raises(
        DataError, match=r"bad\.jsonl row 1: the chat template refuses field 'prompt': Conversation"
    ):
        load(gemma, [bad])


def test_a_template_that_reads_content_as_parts_gets_the_row_s_text(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    """SmolVLM's template (Idefics3's, LLaVA-NeXT's) loops over a message's content as a list
    of parts and writes a plain string as nothing: a prompt was the bare headers, the model
    never read the question. A template that writes no content at all is refused by row."""
    smolvlm = shipped_style(tok, "smolvlm")
    ds = load(smolvlm, [write_jsonl(tmp_path / "train.jsonl", ROWS)])
    rendered = "<|im_start|>User: What is 47+38?<end_of_utterance>\nAssistant:"
    assert ds[1]["prompt_ids"] == smolvlm.encode(rendered, add_special_tokens=False)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    row = load_sft_dataset([path], smolvlm, TextOptions(max_length=128))[0]
    assert smolvlm.decode(row["input_ids"]) == (
        "<|im_start|>System: Be brief.<end_of_utterance>\nUser: What is 1+2?<end_of_utterance>\n"
        "Assistant: Answer: 3<end_of_utterance>\nUser: And 3+4?<end_of_utterance>\n"
        "Assistant: Answer: 7<end_of_utterance>"
    )
    assert trained(smolvlm, row) == " Answer: 3<end_of_utterance> Answer: 7<end_of_utterance>"
    blind = copy.deepcopy(tok)
    blind.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% endfor %}"
    with pytest.raises(
        DataError,
        match=r"train\.jsonl row 1: the chat template renders field 'prompt' without the text "
        r"of its user message 'What is 1\+2\?'",
    ):
        load(blind, [write_jsonl(tmp_path / "train.jsonl", ROWS)])


def test_multi_turn_sft_on_a_template_that_rewrites_earlier_turns(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Qwen3's template writes the last assistant turn after an empty thinking block and an
    earlier one without it, so no rendering is a prefix of the next: the conversation is its
    rendering of the whole, each assistant turn found in it (refused before)."""
    qwen3 = shipped_style(tok, "qwen3")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    row = load_sft_dataset([path], qwen3, TextOptions(max_length=256))[0]
    whole = qwen3.apply_chat_template(CHAT, tokenize=False)
    assert "<think>" in whole.split("And 3+4?")[1] and "<think>" not in whole.split("And 3+4?")[0]
    assert qwen3.decode(row["input_ids"]) == whole.removesuffix("\n")
    assert trained(qwen3, row) == "Answer: 3<|im_end|>Answer: 7<|im_end|>"
    # a user message that ends as an assistant turn does is context, not the turn
    echo = [{"role": "user", "content": "Say 3"}, {"role": "assistant", "content": "3"}]
    row = load_sft_dataset(
        [write_jsonl(tmp_path / "echo.jsonl", [{"messages": echo}])], qwen3, TextOptions()
    )[0]
    assert trained(qwen3, row) == "3<|im_end|>" and qwen3.decode(row["input_ids"]).count("3") == 2
    # turns with their reasoning: the template keeps the last one's, drops the earlier one's
    thought = [
        CHAT[1],
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nAnswer: 3"},
        CHAT[3],
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\nAnswer: 7"},
    ]
    path = write_jsonl(tmp_path / "thought.jsonl", [{"messages": thought}])
    row = load_sft_dataset([path], qwen3, TextOptions(max_length=256))[0]
    assert trained(qwen3, row) == (
        "Answer: 3<|im_end|><think>\nadd\n</think>\n\nAnswer: 7<|im_end|>"
    )
    # an earlier turn of reasoning alone: its (empty) answer after its own header, not the
    # user's <|im_end|> before it
    silent = [CHAT[1], {"role": "assistant", "content": "<think>x</think>"}, *thought[2:]]
    path = write_jsonl(tmp_path / "silent.jsonl", [{"messages": silent}])
    row = load_sft_dataset([path], qwen3, TextOptions(max_length=256))[0]
    context = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m]
    assert qwen3.decode(context).startswith("<|im_start|>user\nWhat is 1+2?<|im_end|>\n")
    # a last turn whose thinking block the template rewrites (no newlines around it): refused,
    # not trained on its answer alone
    compact = [CHAT[1], {"role": "assistant", "content": "<think>add them</think>Answer: 3"}]
    path = write_jsonl(tmp_path / "compact.jsonl", [{"messages": compact}])
    with pytest.raises(DataError, match=r"compact\.jsonl row 1: the chat template does not write"):
        load_sft_dataset([path], qwen3, TextOptions(max_length=256))


def test_chat_template_kwargs_reach_every_rendering(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    """data.chat_template_kwargs (verl's apply_chat_template_kwargs): Qwen3's template with
    enable_thinking false opens the model's turn with an empty thinking block, in prompts and
    in SFT rows; the tokenizer that holds them is another object than the plain one."""
    from treadle.models.folders import load_tokenizer as load_folder

    folder = tmp_path / "qwen3"
    shipped_style(tok, "qwen3").save_pretrained(folder)
    plain = load_folder(folder)
    quiet = load_folder(folder, template_kwargs={"enable_thinking": False})
    assert quiet is not plain and quiet is load_folder(
        folder, template_kwargs={"enable_thinking": False}
    )
    path = write_jsonl(tmp_path / "train.jsonl", ROWS[:1])
    header = "<|im_start|>user\nWhat is 1+2?<|im_end|>\n<|im_start|>assistant\n"
    assert plain.decode(load(plain, [path])[0]["prompt_ids"]) == header
    thinking = header + "<think>\n\n</think>\n\n"
    assert quiet.decode(load(quiet, [path])[0]["prompt_ids"]) == thinking
    row = load_sft_dataset([path], quiet, TextOptions(max_length=128))[0]
    assert quiet.decode(row["input_ids"]) == thinking + ROWS[0]["solution"] + "<|im_end|>"


def test_sft_text_rows_are_learned_whole(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    """TRL's language-modeling rows ({"text": ...}, data.text_key): every token a target after
    the first, then the EOS; a special-token string in the text stays text; which command a
    config of them is for is SFT, unless the rows have prompts (RL's)."""
    from treadle.check.kind import infer_kind
    from treadle.config import load_config

    text = "1+2: 1+2=3. Answer: 3 <|im_end|>"
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": text}])
    row = load_sft_dataset([path], tok, TextOptions(max_length=128))[0]
    plain = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert row["input_ids"] == [*plain, tok.eos_token_id]
    assert row["loss_mask"] == [0] + [1] * len(plain)
    assert trained(tok, row) == text[1:] + "<|im_end|>"
    cfg = load_config(None, [f"data.train_files=[{path}]"])
    assert infer_kind(cfg)[0] == "sft"
    beside = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "What is 1+2?", "text": "x"}])
    assert infer_kind(load_config(None, [f"data.train_files=[{beside}]"]))[0] == "train"


def test_sft_errors_and_length_filter(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    path = write_jsonl(tmp_path / "train.jsonl", [ROWS[0], {"prompt": "What is 2+2?"}])
    with pytest.raises(DataError) as info:
        load_sft_dataset([path], tok, TextOptions(max_length=128))
    assert str(info.value) == (
        f"data.train_files: {path} row 2: response field 'solution' is missing or empty"
    )
    path = write_jsonl(tmp_path / "ok.jsonl", ROWS)
    lengths = [
        len(r["input_ids"]) for r in load_sft_dataset([path], tok, TextOptions(max_length=999)).rows
    ]
    ds = load_sft_dataset([path], tok, TextOptions(max_length=max(lengths) - 1))
    assert len(ds) == 2 and ds.n_filtered == 1
    with pytest.raises(DataError, match=r"example is .* longer than max_length"):
        load_sft_dataset([path], tok, TextOptions(max_length=max(lengths) - 1, overlong="error"))


def test_collate_sft_right_pads():
    rows = [
        {"uid": "a", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"uid": "b", "input_ids": [8, 9], "loss_mask": [0, 1]},
    ]
    ids, mask, loss_mask = collate_sft(rows, pad_id=0)  # type: ignore[arg-type]
    assert ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert loss_mask.tolist() == [[0, 1, 1], [0, 1, 0]]


# --- sampler ---------------------------------------------------------------------------------


def test_sampler_epochs_are_permutations_and_seeded():
    sampler = ResumableSampler(10, 5, seed=0, drop_last=False)
    epoch0 = sampler.next_indices() + sampler.next_indices()
    epoch1 = sampler.next_indices() + sampler.next_indices()
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    assert sampler.state_dict() == {"epoch": 1, "position": 10, "seed": 0, "n": 10}
    other = ResumableSampler(10, 5, seed=1, drop_last=False)
    assert other.next_indices() + other.next_indices() != epoch0
    plain = ResumableSampler(5, 2, seed=0, shuffle=False, drop_last=False)
    assert [plain.next_indices() for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]


def test_sampler_drop_last_never_spans_epochs():
    sampler = ResumableSampler(10, 4, seed=0)
    assert sampler.steps_per_epoch == 2
    batches = [sampler.next_indices() for _ in range(4)]
    assert all(len(b) == 4 for b in batches)
    assert len(set(batches[0] + batches[1])) == 8
    assert sampler.state_dict()["epoch"] == 1
    with pytest.raises(DataError, match="fewer than one batch of 16"):
        ResumableSampler(10, 16, seed=0)


@pytest.mark.parametrize("drop_last", [True, False])
def test_sampler_resume_gives_the_same_batches(drop_last: bool):
    straight = ResumableSampler(11, 3, seed=7, drop_last=drop_last)
    expected = [straight.next_indices() for _ in range(12)]
    first = ResumableSampler(11, 3, seed=7, drop_last=drop_last)
    head = [first.next_indices() for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = ResumableSampler(11, 3, seed=7, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert head + [resumed.next_indices() for _ in range(7)] == expected


def test_sampler_rejects_state_of_another_dataset():
    state = ResumableSampler(10, 2, seed=0).state_dict()
    with pytest.raises(DataError, match="dataset of 10 rows, this one has 12"):
        ResumableSampler(12, 2, seed=0).load_state_dict(state)
    with pytest.raises(DataError, match="lacks"):
        ResumableSampler(12, 2, seed=0).load_state_dict({"epoch": 0})


# --- unreadable files and special-token strings (issue 15 item 8) ----------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b'{"prompt": "a", "answer": "1"}\n{"prompt": "b\xff", "answer": "2"}\n',
            r"row 2: not UTF-8",
        ),
        (
            b'{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": \n',
            r"row 2: not valid JSON",
        ),
        (b'{"prompt": "a", "answer": "1"}\n[1, 2]\n', r"row 2: not a JSON object \(a list\)"),
        (b'{"prompt": "a", "answer": "1"}\n"text"\n', r"row 2: not a JSON object \(a string\)"),
        (b'[{"prompt": "a", "answer": "1"}, 7]', r"row 2: not a JSON object \(a number\)"),
        (
            b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2", "answer": "3"}\n',
            r"row 2: key 'answer' is given twice: keep one$",
        ),
        (
            b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": 1180591620717411303424}\n',
            r"row 2: field 'answer' holds an integer beyond 64 bits: quote it as a string$",
        ),
    ],
)
def test_unparsable_row_names_file_and_row(tok, tmp_path: Path, content: bytes, message: str):  # type: ignore[no-untyped-def]
    path = tmp_path / ("bad.json" if content.startswith(b"[") else "bad.jsonl")
    path.write_bytes(content)
    with pytest.raises(
        DataError, match=rf"data\.train_files: cannot read '.*bad\.jsonl?': {message}"
    ):
        load(tok, [str(path)])


@pytest.mark.parametrize(
    ("answers", "truths"),
    [
        # a column of strings and numbers: datasets stored it as JSON text and decoded "007"
        (["007", "007", 7, "1.50", "abc"], ["007", "007", "7", "1.50", "abc"]),
        (["007", ["7", "07"]], ["007", '["7", "07"]']),
        # ints in a column with a float: Arrow made every one a float ("79.0")
        ([79, 99, 7.5], ["79", "99", "7.5"]),
        ([[1, 2], [1, 2.5]], ["[1, 2]", "[1, 2.5]"]),
        ([2**63 + 1, 5], [str(2**63 + 1), "5"]),  # not an int64: Arrow made it a float
        (["2020-01-01", "2020-01-01 10:00"], ["2020-01-01", "2020-01-01 10:00"]),  # timestamps
    ],
)
def test_ground_truths_are_what_the_file_writes(tok, tmp_path: Path, answers, truths):  # type: ignore[no-untyped-def]
    rows = [{"prompt": "What is 1+2?", "answer": answer} for answer in answers]
    ds = load(tok, [write_jsonl(tmp_path / "train.jsonl", rows)])
    assert [ds[i]["ground_truth"] for i in range(len(rows))] == truths
    array = tmp_path / "train.json"  # a .json file holding one array of rows
    array.write_text(json.dumps(rows, indent=1))
    assert [row["ground_truth"] for row in load(tok, [str(array)])] == truths


def _eos_prompt_ids(tok, tmp_path: Path, **kwargs: Any) -> list[int]:  # type: ignore[no-untyped-def]
    rows = [{"prompt": f"What is 1+2?{tok.eos_token} 3", "answer": "3"}]
    return load(tok, [write_jsonl(tmp_path / "eos.jsonl", rows)], **kwargs)[0]["prompt_ids"]


@pytest.mark.parametrize("template", [True, False])
def test_special_token_text_in_a_prompt_stays_text(tok, tmp_path: Path, template: bool):  # type: ignore[no-untyped-def]
    eos = tok.eos_token_id
    ids = _eos_prompt_ids(tok, tmp_path, apply_chat_template=template)
    old = _eos_prompt_ids(tok, tmp_path, apply_chat_template=template, allow_special_tokens=True)
    template_eos = 1 if template else 0  # the template closes the user turn with <|im_end|>
    assert ids.count(eos) == template_eos
    assert old.count(eos) == template_eos + 1  # allow_special_tokens: the old behaviour
    if template:  # the template's own special tokens are intact, at the same places
        assert ids[:2] == old[:2] and ids[-5:] == old[-5:] and ids[-5] == eos


def test_prompts_without_special_strings_keep_their_ids(tok):  # type: ignore[no-untyped-def]
    from treadle.data import encode_rendered, special_strings

    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 4+5?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    whole = tok.encode(text, add_special_tokens=False)
    contents = [m["content"] for m in messages]
    assert encode_rendered(tok, text, contents, special_strings(tok)) == whole


def test_special_token_text_in_responses_stays_text(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    from treadle.data import TextOptions, load_pair_dataset

    eos = tok.eos_token_id
    row = {
        "prompt": "What is 1+2?",
        "solution": f"3{tok.eos_token}4",
        "chosen": f"3{tok.eos_token}",
    }
    row["rejected"] = "4"
    path = write_jsonl(tmp_path / "r.jsonl", [row])
    sft = load_sft_dataset([path], tok, TextOptions(max_length=128))[0]
    response = [t for t, m in zip(sft["input_ids"], sft["loss_mask"], strict=True) if m]
    assert response.count(eos) == 1 and response[-1] == eos  # only the appended EOS
    old = load_sft_dataset([path], tok, TextOptions(max_length=128, allow_special_tokens=True))[0]
    assert old["input_ids"].count(eos) == sft["input_ids"].count(eos) + 1
    pair = load_pair_dataset(
        [path], tok, TextOptions(max_prompt_length=64, max_response_length=64)
    )[0]
    assert pair["chosen_ids"].count(eos) == 1 and pair["chosen_ids"][-1] == eos


def test_special_token_text_in_chat_turns_stays_text(tok, tmp_path: Path):  # type: ignore[no-untyped-def]
    eos = tok.eos_token_id
    chat = [
        {"role": "user", "content": f"What is 1+2?{tok.eos_token}"},
        {"role": "assistant", "content": f"3{tok.eos_token}"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])
    ex = load_sft_dataset([path], tok, TextOptions(max_length=128))[0]
    assert ex["input_ids"].count(eos) == 2  # closing the user turn, and the assistant's EOS
    old = load_sft_dataset([path], tok, TextOptions(max_length=128, allow_special_tokens=True))[0]
    assert old["input_ids"].count(eos) == 4


# --- chat templates as their models ship them ------------------------------------------------

# All TRL 1.16 keeps a copy of (41: Qwen2.5-3.8, gpt-oss, Gemma 1-4, Llama 3-3.2, DeepSeek, GLM
# 4.5, Phi-3, LFM2, Nemotron 3, Cohere, SmolVLM...). Multi-turn rows are refused on gpt-oss's
# (it closes an earlier turn with <|end|>, the last with <|return|>, the token the model stops
# at) and GLM 4.5's (no token after a turn).
NO_MULTI_TURN_SFT = {"gptoss", "glm4moe"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]


def test_the_shipped_templates_are_all_here():
    names = set(shipped_templates())
    assert len(names) == 41 and names >= NO_MULTI_TURN_SFT  # (TRL 1.16's)


@pytest.mark.parametrize("name", shipped_templates())
def test_a_shipped_template_keeps_the_text_and_the_results(tok, tmp_path: Path, name: str):  # type: ignore[no-untyped-def]
    """On the tiny tokenizer with the template's special tokens: a prompt row, a
    prompt/response SFT row, a multi-turn SFT row, tool results appended by the agent loops
    and a tool conversation through the endpoint each keep the user's text and the results."""
    from treadle.agents.loops import AgentClient, Limits
    from treadle.agents.tools import ToolCall, numbered, result_messages
    from treadle.engines.inference import SamplingParams
    from treadle.serving.completions import chat_prompt_ids

    styled = shipped_style(tok, name)
    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS[:1])
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    options = TextOptions(max_prompt_length=4096, max_length=4096)
    prompt = styled.decode(load(styled, [rows], max_prompt_length=4096)[0]["prompt_ids"])
    assert "What is 1+2?" in prompt
    end_id, end = end_of_turn(styled)
    assert (
        trained(styled, load_sft_dataset([rows], styled, options)[0]) == ROWS[0]["solution"] + end
    )
    if name in NO_MULTI_TURN_SFT:
        with pytest.raises(DataError, match="does not write the conversation's assistant turns"):
            load_sft_dataset([chat], styled, options)
    else:
        turns = trained(styled, load_sft_dataset([chat], styled, options)[0])
        assert turns.replace(" Answer", "Answer") == f"Answer: 3{end}Answer: 7{end}"
    # the tools loop's results after a call turn the model ended as the template ends a turn
    client = AgentClient(None, styled, SamplingParams(), Limits(), "s")  # type: ignore[arg-type]
    calls = numbered([ToolCall("add", {"a": 1})])
    results = result_messages(styled, ["42"], calls)
    assert "42" in styled.decode(client.encode_messages(results, after=[5, end_id], calls=calls))
    # an OpenAI client's conversation with a call and its result, through the endpoint
    call = {"id": "abcdefghi", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    history = [
        *CHAT[:2],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "abcdefghi", "name": "add"},
    ]
    sent = styled.decode(chat_prompt_ids(styled, history, TOOLS))
    assert "42" in sent.split("What is 1+2?")[1]
