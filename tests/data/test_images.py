"""Rows with pictures through the model's processor: image tokens in the prompt, pixel values
in the rows and batches, and one clear error for a bad picture or a text-only model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from treadle.data import TextOptions, prompt_batch, sft_dataset
from treadle.data.images import PIXELS, load_image_processor, stack_pixels
from treadle.data.prompts import prompt_dataset
from treadle.data.readers import read_records
from treadle.models.loading import load_tokenizer
from treadle.runtime.errors import DataError


def options(folder: Path, **kw) -> TextOptions:  # type: ignore[no-untyped-def]
    return TextOptions(processor=load_image_processor(str(folder)), max_prompt_length=64, **kw)


def test_prompts_carry_image_tokens_and_pixel_values(shapes_task) -> None:
    folder = shapes_task["model"]
    tok = load_tokenizer(folder)
    records = read_records([shapes_task["test"]], "data.val_files")[:4]
    ds = prompt_dataset(records, tok, options(folder))
    image_id = tok.convert_tokens_to_ids("<image>")
    for row in ds.rows:
        assert row["prompt_ids"].count(image_id) == 16  # one picture, 16 tokens
        assert row["pixel_values"].shape == (1, 3, 64, 64)
        text = tok.decode(row["prompt_ids"])
        assert text.startswith("<|im_start|>user\n<fake_token_around_image><global-img><image>")
        assert text.endswith(
            "How many shapes are in the picture?<|im_end|>\n<|im_start|>assistant\n"
        )
    batch = prompt_batch(ds, [0, 1, 2], ds.pad_id)
    assert batch[PIXELS].shape == (3, 1, 3, 64, 64)
    torch.testing.assert_close(batch[PIXELS][1], ds[1]["pixel_values"])
    assert not torch.equal(batch[PIXELS][0], batch[PIXELS][1])  # the rows' own pictures


def test_smolvlm_s_template_writes_the_pictures_and_the_text_where_its_model_reads_them(
    shapes_task,
) -> None:
    """SmolVLM's own template reads content as parts: the pictures go in as image parts before
    the text (``User:<image>How many...``), not before its first header (and the text was not
    written at all)."""
    from tiny_models import shipped_style

    folder = shapes_task["model"]
    smolvlm = shipped_style(load_tokenizer(folder), "smolvlm")
    records = read_records([shapes_task["test"]], "data.val_files")[:2]
    picture = "<fake_token_around_image><global-img>" + "<image>" * 16 + "<fake_token_around_image>"
    for row in prompt_dataset(records, smolvlm, options(folder)).rows:
        assert smolvlm.decode(row["prompt_ids"]) == (
            f"<|im_start|>User:{picture}How many shapes are in the picture?<end_of_utterance>\n"
            "Assistant:"
        )
        assert row["pixel_values"].shape == (1, 3, 64, 64)


def test_sft_rows_carry_pixel_values_and_train_on_the_answer(shapes_task) -> None:
    folder = shapes_task["model"]
    tok = load_tokenizer(folder)
    records = read_records([shapes_task["train"]], "data.train_files")[:3]
    ds = sft_dataset(records, tok, options(folder))
    for record, row in zip(records, ds.rows, strict=True):
        targets = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert tok.decode(targets) == f"Answer: {record.row['answer']}<|im_end|>"
        assert row["pixel_values"].shape == (1, 3, 64, 64)


def test_pixels_of_rows_with_and_without_pictures_stack_with_zero_padding() -> None:
    a, b = torch.ones(2, 3, 4, 4), torch.full((1, 3, 4, 4), 2.0)
    out = stack_pixels([a, None, b])
    assert out is not None and out.shape == (3, 2, 3, 4, 4)
    assert torch.equal(out[0], a) and not out[1].any() and not out[2, 1].any()
    assert stack_pixels([None, None]) is None


@pytest.mark.parametrize("writer", ["pyarrow", "datasets"])
def test_images_as_bytes_in_parquet_read_like_files(shapes_task, tmp_path, writer) -> None:
    """Parquet written by pyarrow (a struct column) or by `datasets` (an `Image` column, which
    its formatter would decode into PIL pictures: the rows keep the stored bytes instead)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, Features, Image, List, Value

    folder, root = shapes_task["model"], shapes_task["test"].parent
    rows = [json.loads(x) for x in shapes_task["test"].read_text().splitlines()[:2]]
    columns = {
        "prompt": [r["prompt"] for r in rows],
        "answer": [r["answer"] for r in rows],
        "images": [[{"bytes": (root / r["images"][0]).read_bytes()}] for r in rows],
    }
    if writer == "pyarrow":
        pq.write_table(pa.table(columns), tmp_path / "test.parquet")
    else:
        types = {"prompt": Value("string"), "answer": Value("string"), "images": List(Image())}
        Dataset.from_dict(columns, features=Features(types)).to_parquet(tmp_path / "test.parquet")
    tok = load_tokenizer(folder)
    from_files = prompt_dataset(read_records([shapes_task["test"]], "k")[:2], tok, options(folder))
    from_bytes = prompt_dataset(
        read_records([tmp_path / "test.parquet"], "k"), tok, options(folder)
    )
    for a, b in zip(from_files.rows, from_bytes.rows, strict=True):
        assert a["prompt_ids"] == b["prompt_ids"]
        torch.testing.assert_close(a["pixel_values"], b["pixel_values"])


def bad_rows(shapes_task, tmp_path, picture: str) -> Path:  # type: ignore[no-untyped-def]
    """The first 3 test rows, the third pointing at ``picture`` (relative to the new file)."""
    rows = [json.loads(x) for x in shapes_task["test"].read_text().splitlines()[:3]]
    shutil.copytree(shapes_task["test"].parent / "images", tmp_path / "images")
    rows[2]["images"] = [picture]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("picture", "message"),
    [
        (
            "images/nope.png",
            r"bad\.jsonl row 3: 'images'\[0\]: image file '.*nope\.png' does not exist",
        ),
        ("corrupt.png", r"bad\.jsonl row 3: 'images'\[0\]: cannot read the image '.*corrupt\.png'"),
    ],
)
def test_a_missing_or_corrupt_picture_names_file_and_row(
    shapes_task, tmp_path, picture: str, message: str
) -> None:
    (tmp_path / "corrupt.png").write_bytes(b"not a png")
    path = bad_rows(shapes_task, tmp_path, picture)
    folder = shapes_task["model"]
    with pytest.raises(DataError, match=message):
        prompt_dataset(
            read_records([path], "data.train_files"), load_tokenizer(folder), options(folder)
        )


def test_a_processor_that_does_not_load_names_model_path_and_the_fix(
    shapes_task, tmp_path, monkeypatch
) -> None:
    """A damaged processor file, and transformers 5.17's refusal of SmolVLM's PIL image
    processor without torchvision (its words, copied), are one DataError naming model.path."""
    import transformers

    damaged = tmp_path / "damaged"
    shutil.copytree(shapes_task["model"], damaged)
    (damaged / "processor_config.json").write_text("{not json")
    with pytest.raises(DataError, match=f"^model.path: cannot load the processor of '{damaged}': "):
        load_image_processor(str(damaged))
    words = (
        "Could not load any image processor class for x. The model configuration resolves to "
        "the following image processor classes: pil: Idefics3ImageProcessorPil, torchvision: "
        "Idefics3ImageProcessor. None of these classes could be imported. Missing optional "
        "dependencies: torchvision."
    )

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError(words)

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", refuse)
    old = tmp_path / "old_transformers"
    shutil.copytree(shapes_task["model"], old)
    with pytest.raises(DataError) as e:
        load_image_processor(str(old))
    assert str(e.value) == (
        f"model.path: cannot load the processor of '{old}': {words[:-1]}; pip install torchvision "
        "or a newer transformers"
    )


def test_pictures_for_a_text_only_model_are_an_error(shapes_task, tiny_task) -> None:
    assert load_image_processor(str(tiny_task["model"])) is None
    records = read_records([shapes_task["test"]], "data.train_files")[:2]
    with pytest.raises(
        DataError,
        match=r"test\.jsonl row 1: has images \('images'\) but model\.path is a text-only",
    ):
        prompt_dataset(records, load_tokenizer(tiny_task["model"]), TextOptions())


def check_shapes(tmp_path, capsys, data: Path, model: Path, *overrides: str):  # type: ignore[no-untyped-def]
    """``treadle check`` of a GRPO config on ``data`` with ``model``."""
    import yaml
    from test_check import run

    config = {
        "model": {"path": str(model)},
        "data": {"train_files": [str(data)], "max_prompt_length": 64, "batch_size": 2},
        "rollout": {"n": 2, "max_new_tokens": 8},
        "actor": {"ppo_mini_batch_size": 4, "micro_batch_size": 4},
        "reward": {"function": "shapes", "num_workers": 0},
        "trainer": {"backend": "local", "output_dir": str(tmp_path / "run"), "eval_every": 0},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    return run(capsys, "check", str(tmp_path / "c.yaml"), *overrides, "--kind", "train")


@pytest.mark.parametrize("engine", ["hf", "vllm"])  # either rollout engine takes pictures
def test_treadle_check_passes_the_shapes_task(shapes_task, tmp_path, capsys, engine) -> None:
    model = shapes_task["model"]
    code, _, err = check_shapes(
        tmp_path, capsys, shapes_task["train"], model, f"rollout.engine={engine}"
    )
    assert code == 0, err


def test_treadle_check_names_a_missing_picture_in_one_line(shapes_task, tmp_path, capsys) -> None:
    from test_check import assert_bad

    path = bad_rows(shapes_task, tmp_path, "images/gone.png")
    result = check_shapes(tmp_path, capsys, path, shapes_task["model"])
    assert_bad(
        result, r"bad\.jsonl row 3: 'images'\[0\]: image file '.*gone\.png' does not exist", 1
    )


def test_treadle_check_names_an_images_column_for_a_text_only_model(
    shapes_task, tiny_task, tmp_path, capsys
) -> None:
    from test_check import assert_bad

    result = check_shapes(tmp_path, capsys, shapes_task["train"], tiny_task["model"])
    assert_bad(
        result, r"train\.jsonl row 1: has images \('images'\) but model\.path is a text-only", 1
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.adv_estimator=gae", r"adv_estimator=gae: model\.path is a vision-language"),
        ("actor.lora.rank=4", r"actor\.lora\.rank=4: model\.path is a vision-language model"),
        (
            "trainer.backend=ray actor.world_size=2 actor.sequence_parallel_size=2",
            r"actor\.sequence_parallel_size=2: model\.path is a vision-language model; its "
            r"layers are trained data parallel only",
        ),
        (
            "rollout.cache_implementation=paged",
            r"rollout\.cache_implementation=paged: model\.path is a vision-language model; "
            r"transformers' continuous batching takes no pictures",
        ),
    ],
)
def test_what_a_vision_language_model_does_not_go_with(
    shapes_task, tmp_path, capsys, override: str, message: str
) -> None:
    from test_check import assert_bad

    result = check_shapes(
        tmp_path, capsys, shapes_task["train"], shapes_task["model"], *override.split()
    )
    assert_bad(result, message)
