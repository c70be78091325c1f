"""The built-in image task: count the shapes in a small picture, with an exact answer.

Everything is built here from nothing, as for ``arithmetic``:

- images (``draw_shapes``): a 64 x 64 white picture cut into a 4 x 4 grid of 16-pixel cells;
  ``count`` cells (1..``max_count``), drawn at random from a seed, each hold one filled circle,
  square or triangle of a random colour. Written as PNG files under ``images/``;
- rows ``{"prompt", "answer", "solution", "images": ["images/<split>_<i>.png"]}`` in
  ``train.jsonl`` / ``test.jsonl`` (image paths relative to the JSONL file). No test image is
  in train (each picture is a distinct layout);
- the SFT target ``Answer: <count>`` and the verifier (``compute_score``: the arithmetic task's
  integer reader, so ``Answer: 3`` and a bare ``3`` both score);
- a tokenizer trained on the prompts and answers (``arithmetic.build_tokenizer``) plus the
  image tokens Idefics3 uses (``<fake_token_around_image>``, ``<image>``, ``<global-img>``,
  ``<end_of_utterance>``);
- a randomly initialised Idefics3 model (a SigLIP-shaped vision tower, a pixel-shuffle
  connector and a Llama decoder) with its processor (``Idefics3Processor`` over the PIL image
  processor, no image splitting: one picture is 16 image tokens), saved as one HF folder.

Why Idefics3 and not Qwen2-VL: Idefics3's image tokens take ordinary 1-D positions in the
decoder, so packed sequences (positions restarting per sequence) work unchanged; Qwen2-VL's
3-D rotary positions would need their own packing. The vision tower's patch grid matches the
task's cells: 8-pixel patches, shuffled by 2, make one image token per 16-pixel cell.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

from treadle.tasks.arithmetic import (
    build_tokenizer,
    compute_score,
    extract_answer,
    manifest_matches,
    write_jsonl,
    write_manifest,
)

__all__ = ["answer_of", "compute_score", "draw_shapes", "prepare"]

logger = logging.getLogger(__name__)

IMAGE_SIZE = 64
GRID = 4  # cells per side
CELL = IMAGE_SIZE // GRID
SHAPES = ("circle", "square", "triangle")
COLORS = ("red", "green", "blue", "orange", "purple", "black")
PROMPT = "How many shapes are in the picture?"
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")
PREPARE_FORMAT = 1


def draw_shapes(count: int, rng: random.Random) -> tuple[Any, tuple[tuple[int, str, str], ...]]:
    """A picture of ``count`` shapes in distinct grid cells, and its layout
    ``((cell, shape, colour), ...)`` (what makes two pictures the same)."""
    from PIL import Image, ImageDraw

    cells = sorted(rng.sample(range(GRID * GRID), count))
    layout = tuple((c, rng.choice(SHAPES), rng.choice(COLORS)) for c in cells)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "white")
    draw = ImageDraw.Draw(image)
    for cell, shape, color in layout:
        x0, y0 = (cell % GRID) * CELL + 3, (cell // GRID) * CELL + 3
        x1, y1 = x0 + CELL - 6, y0 + CELL - 6
        if shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=color)
        elif shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=color)
        else:
            draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=color)
    return image, layout


def write_rows(out: Path, n_train: int, n_test: int, seed: int, max_count: int) -> None:
    """``train.jsonl`` / ``test.jsonl`` and their pictures under ``out/images``: distinct
    layouts, test first (so the test set does not depend on ``n_train``)."""
    rng = random.Random(seed)
    images = out / "images"
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir(parents=True)
    seen: set[tuple[tuple[int, str, str], ...]] = set()
    splits: dict[str, list[dict[str, Any]]] = {"test": [], "train": []}
    for split, n in (("test", n_test), ("train", n_train)):
        while len(splits[split]) < n:
            count = rng.randint(1, max_count)
            image, layout = draw_shapes(count, rng)
            if layout in seen:
                continue
            seen.add(layout)
            name = f"images/{split}_{len(splits[split]):05d}.png"
            image.save(out / name)
            splits[split].append(
                {
                    "prompt": PROMPT,
                    "answer": str(count),
                    "solution": f"Answer: {count}",
                    "images": [name],
                }
            )
    for split, rows in splits.items():
        write_jsonl(rows, out / f"{split}.jsonl")


def answer_of(response: str, row: Any) -> str | None:
    """The answer ``compute_score`` reads in ``response`` (what maj@k votes on)."""
    del row
    return extract_answer(response)


def _text_config(tok: Any, hidden_size: int, num_layers: int) -> dict[str, Any]:
    """The decoder's config: a Llama of ``num_layers`` x ``hidden_size`` (head size 32)."""
    return {
        "model_type": "llama",
        "vocab_size": len(tok),
        "hidden_size": hidden_size,
        "intermediate_size": 3 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": hidden_size // 32,
        "num_key_value_heads": max(hidden_size // 64, 1),
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def build_tiny_vlm(
    out_dir: str | Path,
    corpus: list[str],
    *,
    seed: int = 0,
    vocab_size: int = 300,
    hidden_size: int = 128,
    num_layers: int = 4,
    vision_hidden_size: int = 64,
    vision_layers: int = 2,
) -> Path:
    """A randomly initialised Idefics3 model with its processor and tokenizer in ``out_dir``.

    Loads with ``AutoModelForImageTextToText`` and ``AutoProcessor`` like a hub model. The
    global torch RNG is left as it was."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    from treadle.models.loading import count_parameters, save_tokenizer

    out = Path(out_dir)
    tok = build_tokenizer(corpus, out, vocab_size=vocab_size)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *IMAGE_TOKENS]})
    patch, scale = 8, 2  # 8-pixel patches, 2 x 2 of them an image token: one a grid cell
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(  # PIL: torchvision's build is broken here
            do_image_splitting=False,
            size={"longest_edge": IMAGE_SIZE},
            max_image_size={"longest_edge": IMAGE_SIZE},
        ),
        tokenizer=tok,
        image_seq_len=(IMAGE_SIZE // patch) ** 2 // scale**2,
    )
    text = _text_config(tok, hidden_size, num_layers)
    vision = {"hidden_size": vision_hidden_size, "intermediate_size": 2 * vision_hidden_size}
    vision |= {"num_hidden_layers": vision_layers, "num_attention_heads": 2}
    vision |= {"image_size": IMAGE_SIZE, "patch_size": patch}
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=scale,
        image_token_id=tok.get_vocab()["<image>"],
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
    )
    config.eos_token_id = tok.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    save_tokenizer(tok, out)
    logger.info("built idefics3 model with %d parameters in %s", count_parameters(model), out)
    return out


def prepare(
    out_dir: str | Path,
    *,
    seed: int = 0,
    n_train: int = 4000,
    n_test: int = 500,
    max_count: int = 6,
    hidden_size: int = 128,
    num_layers: int = 4,
) -> dict[str, Path]:
    """Pictures, ``train.jsonl``, ``test.jsonl`` and the initial model ``model_init`` under
    ``out_dir``; reused when ``prepare.json`` records the same arguments (written last)."""
    if not 1 <= max_count <= GRID * GRID:
        raise ValueError(f"max_count must be in 1..{GRID * GRID}, got {max_count}")
    manifest = {
        "task": "shapes",
        "format": PREPARE_FORMAT,
        "seed": seed,
        "n_train": n_train,
        "n_test": n_test,
        "max_count": max_count,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
    }
    out = Path(out_dir)
    paths = {
        "train": out / "train.jsonl",
        "test": out / "test.jsonl",
        "model": out / "model_init",
        "manifest": out / "prepare.json",
    }
    files = [paths["train"], paths["test"], paths["model"] / "model.safetensors"]
    if manifest_matches(paths["manifest"], manifest, files):
        logger.info("reusing prepared shapes task in %s", out)
        return paths
    out.mkdir(parents=True, exist_ok=True)
    paths["manifest"].unlink(missing_ok=True)
    write_rows(out, n_train, n_test, seed, max_count)
    shutil.rmtree(paths["model"], ignore_errors=True)
    with paths["train"].open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    corpus = [text for row in rows for text in (row["prompt"], row["solution"])]
    build_tiny_vlm(
        paths["model"], corpus, seed=seed, hidden_size=hidden_size, num_layers=num_layers
    )
    write_manifest(paths["manifest"], manifest)
    return paths
