"""Rows with pictures: the ``images`` column, read and turned into tokens and pixel values by
the model's own processor (a vision-language model's, e.g. Idefics3's).

- An image is a file path (absolute, or relative to the data file's folder, as
  ``treadle prepare --task shapes`` writes them), raw bytes, or ``{"bytes": ..., "path": ...}``
  (how ``datasets`` stores an ``Image`` column in Parquet). A missing or unreadable one is a
  DataError naming the file and row.
- The prompt is rendered with the chat template as for text, with one ``<image>`` placeholder
  per picture put before the user's text (unless the text already holds them), then given
  with the pictures to the processor, which expands each placeholder into the model's image
  tokens and computes the pixel values. So training and rollout see exactly the processor's
  token layout.
- Pixel values travel per row as ``[images, 3, H, W]`` float32; :func:`stack_pixels` pads the
  rows of a batch to the same number of images with all-zero pictures, which Idefics3 drops
  before its vision tower. The batch field is ``pixel_values`` ``[B, images, 3, H, W]``.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.data.readers import Record
from treadle.runtime.errors import DataError

if TYPE_CHECKING:
    import torch

PIXELS = "pixel_values"  # the batch field of a batch's pictures


@dataclass(frozen=True)
class ImageProcessor:
    """A vision-language model's processor (``AutoProcessor``) and its image placeholder."""

    processor: Any
    placeholder: str  # the text the processor expands into one picture's tokens

    def encode(self, text: str, images: list[Any]) -> tuple[list[int], torch.Tensor]:
        """``(token ids, pixel values [images, 3, H, W])`` of a rendered prompt and its pictures;
        ``text`` gets one placeholder per picture unless it holds them already."""
        import torch

        if text.count(self.placeholder) != len(images):
            if self.placeholder in text:
                raise ValueError(
                    f"the prompt holds {text.count(self.placeholder)} {self.placeholder} "
                    f"placeholders for {len(images)} images"
                )
            text = _before_user_text(text, self.placeholder * len(images))
        out = self.processor(text=[text], images=[images], add_special_tokens=False)
        pixels = torch.as_tensor(out[PIXELS][0], dtype=torch.float32)
        return list(out["input_ids"][0]), pixels


def _before_user_text(text: str, placeholders: str) -> str:
    """``placeholders`` inserted after the last ``user\\n`` header (ChatML and most templates),
    else at the start."""
    at = text.rfind("user\n")
    cut = at + len("user\n") if at >= 0 else 0
    return text[:cut] + placeholders + text[cut:]


@functools.lru_cache(maxsize=4)
def load_image_processor(path: str) -> ImageProcessor | None:
    """The processor of the model folder at ``path``; None for a text-only model (its
    config.json has no ``vision_config``)."""
    from treadle.models.folders import is_vision_language

    if not is_vision_language(path):
        return None
    from transformers import AutoProcessor  # (its import imports torch)

    try:
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError) as e:
        # transformers 5.17 without torchvision: "None of these classes could be imported", a
        # PIL image processor (SmolVLM's) taken for a torchvision one; 5.19 loads it
        why = str(e).rstrip(".")
        fix = "; pip install torchvision or a newer transformers" if "torchvision" in why else ""
        raise DataError(f"model.path: cannot load the processor of '{path}': {why}{fix}") from None
    placeholder = getattr(processor, "image_token", None)
    if placeholder is None:
        raise DataError(f"model.path: the processor of '{path}' names no image token")
    return ImageProcessor(processor, str(placeholder))


def read_images(record: Record, key: str) -> list[Any]:
    """The pictures of ``record``'s column ``key`` as RGB PIL images ([] when it has none)."""
    value = record.row.get(key)
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    return [_open(record, key, item, i) for i, item in enumerate(items)]


def _open(record: Record, key: str, item: Any, index: int) -> Any:
    from PIL import Image, UnidentifiedImageError

    what = f"{record.where}: '{key}'[{index}]"
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    if isinstance(item, str):
        path = Path(item)
        if not path.is_absolute() and record.file:
            path = Path(record.file).parent / path
        if not path.is_file():
            raise DataError(f"{what}: image file '{path}' does not exist")
        source: Any = path
    elif isinstance(item, (bytes, bytearray)):
        source = io.BytesIO(item)
    else:
        raise DataError(f"{what}: an image is a file path or bytes, got {type(item).__name__}")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        name = f"'{source}'" if isinstance(source, Path) else "bytes"
        raise DataError(f"{what}: cannot read the image {name}: {e}") from e


def image_prompt(
    record: Record,
    key: str,
    text: str,
    processor: ImageProcessor | None,
) -> tuple[list[int], torch.Tensor] | None:
    """``(ids, pixel values)`` of a row with pictures in ``key`` (``text``: its rendered
    prompt); None for a row without. A row with pictures for a text-only model is an error."""
    if not record.row.get(key):
        return None
    if processor is None:
        raise DataError(
            f"{record.where}: has images ('{key}') but model.path is a text-only model (its "
            "config.json has no vision_config): use a vision-language model, or drop the column"
        )
    images = read_images(record, key)
    try:
        return processor.encode(text, images)
    except ValueError as e:
        raise DataError(f"{record.where}: {e}") from e


def stack_pixels(rows: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Per-row pixel values ``[n_i, 3, H, W]`` (None: no picture) as ``[B, max n_i, 3, H, W]``,
    zero pictures as padding; None when no row has one."""
    import torch

    given = [r for r in rows if r is not None and len(r)]
    if not given:
        return None
    shape = given[0].shape[1:]
    if any(r.shape[1:] != shape for r in given):
        raise DataError(
            f"images of one batch have different sizes: {[list(r.shape) for r in given]}"
        )
    most = max(len(r) for r in given)
    out = torch.zeros(len(rows), most, *shape)
    for i, r in enumerate(rows):
        if r is not None and len(r):
            out[i, : len(r)] = r
    return out
