"""The built-in image task: pictures that show what their answers say, held-out splits, and a
model folder that loads with its processor."""

from __future__ import annotations

import json
import random

import numpy as np
from PIL import Image

from treadle.tasks.shapes import CELL, GRID, IMAGE_SIZE, compute_score, draw_shapes


def drawn_cells(image: Image.Image) -> int:
    """Grid cells holding any non-white pixel."""
    pixels = np.asarray(image.convert("RGB"))
    return sum(
        bool((pixels[r * CELL : (r + 1) * CELL, c * CELL : (c + 1) * CELL] != 255).any())
        for r in range(GRID)
        for c in range(GRID)
    )


def test_a_picture_shows_as_many_shapes_as_asked() -> None:
    rng = random.Random(3)
    for count in range(1, GRID * GRID + 1):
        image, layout = draw_shapes(count, rng)
        assert image.size == (IMAGE_SIZE, IMAGE_SIZE)
        assert len(layout) == count
        assert drawn_cells(image) == count


def test_prepared_rows_answer_what_their_pictures_show(shapes_task) -> None:
    rows = {}
    for split in ("train", "test"):
        lines = shapes_task[split].read_text().splitlines()
        rows[split] = [json.loads(line) for line in lines]
    assert (len(rows["train"]), len(rows["test"])) == (48, 16)
    root = shapes_task["train"].parent
    for row in rows["train"] + rows["test"]:
        assert row["solution"] == f"Answer: {row['answer']}"
        assert compute_score(row["prompt"], row["solution"], row["answer"]) == 1.0
        with Image.open(root / row["images"][0]) as image:
            assert drawn_cells(image) == int(row["answer"])
    pictures = {
        split: {(root / r["images"][0]).read_bytes() for r in rows[split]} for split in rows
    }
    assert not pictures["train"] & pictures["test"]  # no test picture in train
    assert len({r["answer"] for r in rows["train"]}) > 3  # counts vary


def test_the_model_folder_loads_with_its_processor(shapes_task) -> None:
    from transformers import AutoProcessor

    from treadle.models.loading import is_vision_language, load_causal_lm, load_tokenizer

    folder = shapes_task["model"]
    assert is_vision_language(folder)
    model = load_causal_lm(folder)
    processor = AutoProcessor.from_pretrained(folder)
    tok = load_tokenizer(folder)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<image>")
    assert model.config.text_config.vocab_size == len(tok)
    assert processor.image_seq_len == 16  # one image token a 16-pixel cell


def test_prepare_reuses_a_prepared_directory(shapes_task) -> None:
    from treadle.tasks.shapes import prepare

    weights = shapes_task["model"] / "model.safetensors"
    before = weights.stat().st_mtime_ns
    prepare(
        shapes_task["train"].parent, seed=0, n_train=48, n_test=16, hidden_size=64, num_layers=2
    )
    assert weights.stat().st_mtime_ns == before
