"""A vision-language prompt for vLLM exactly as treadle built it: its token ids (the HF
processor's expansion, which training sees) and its pixel values, handed to vLLM's engine as
processed input.

Why not vLLM's own processing (a prompt with one ``<image>`` per picture and the raw images in
``multi_modal_data``): vLLM 0.32 expands *every* ``<image>`` of a token prompt into a picture's
whole layout (it does not detect a prompt already expanded), so treadle's ids cannot be given
as they are; the raw images would have to travel with every request in place of the pixel
values, and be processed again; and in a resumed or multi-turn prompt an ``<image>`` token the
policy sampled would be taken for a picture. (vLLM's processing of the raw picture does give
the same ids and pixel values as treadle's: tests/engines/test_vllm_pictures.py checks it.)

So a request's prompt is a ``MultiModalInput`` (what vLLM's renderer hands its engine):

- ``prompt_token_ids``: the ids as given;
- one item per picture row of ``pixel_values`` ``[images, 3, H, W]`` (for Idefics3 a picture,
  or one tile of a split picture): its pixels, a ``pixel_attention_mask`` of ones (treadle's
  training forward passes none, which Idefics3 reads as all ones) and ``num_patches`` 1;
  all-zero rows (batch padding) are dropped, as Idefics3 drops them;
- item ``k``'s placeholder is the ``k``-th run of ``image_seq_len`` image tokens: the
  prompt's first ``pictures x image_seq_len`` image tokens are the pictures' and later ones are
  ordinary tokens, as in the training forward (:func:`treadle.engines.pictures.picture_tokens`);
- its hash is a digest of its pixels: vLLM's encoder cache and prefix cache key on it, so
  equal pictures (the samples of a group) run the vision tower once.

It must go in through ``LLMEngine.add_request``: ``LLM.generate`` takes such a dict for a plain
token prompt and silently drops the pictures (measured). Idefics3-family models only
(Idefics3, SmolVLM: ``image_token_id`` and ``scale_factor`` in config.json), as the training
forward.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PictureLayout:
    """Where a model's pictures go in the prompt: ``image_seq_len`` image tokens each."""

    image_token_id: int
    image_seq_len: int

    @classmethod
    def of(cls, hf_config: Any) -> PictureLayout:
        """The layout of an Idefics3-family config (ValueError for another model)."""
        vision = getattr(hf_config, "vision_config", None)
        token = getattr(hf_config, "image_token_id", None)
        scale = getattr(hf_config, "scale_factor", None)
        if vision is None or token is None or scale is None:
            name = getattr(hf_config, "architectures", None) or type(hf_config).__name__
            raise ValueError(
                f"the vllm engine takes pictures for Idefics3-family models (image_token_id and "
                f"scale_factor in config.json), not {name}: use rollout.engine=hf"
            )
        patches = (vision.image_size // vision.patch_size) ** 2
        return cls(int(token), patches // scale**2)


def picture_prompt(ids: list[int], pixel_values: torch.Tensor, layout: PictureLayout) -> Any:
    """The ``MultiModalInput`` of a prompt ``ids`` whose pictures are ``pixel_values``
    ``[images, 3, H, W]`` (their image tokens already in ``ids``); see the module docstring."""
    from vllm.inputs import TokensPrompt
    from vllm.inputs.engine import mm_input
    from vllm.multimodal.inputs import (
        MultiModalFieldConfig,
        MultiModalKwargsItems,
        PlaceholderRange,
    )

    pictures = pixel_values[(pixel_values.flatten(1) != 0).any(1)].cpu().contiguous()
    if not len(pictures):
        return TokensPrompt(prompt_token_ids=list(ids))
    places = _placeholders(ids, len(pictures), layout)
    ones = torch.ones(len(pictures), dtype=torch.long)
    flat = MultiModalFieldConfig.flat_from_sizes("image", ones)
    fields = {
        "pixel_values": flat,
        "pixel_attention_mask": flat,
        "num_patches": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
    }
    data = {
        "pixel_values": pictures,
        "pixel_attention_mask": torch.ones(len(pictures), *pictures.shape[2:], dtype=torch.bool),
        "num_patches": ones,
    }
    return mm_input(
        prompt_token_ids=list(ids),
        mm_kwargs=MultiModalKwargsItems.from_hf_inputs(data, fields),  # type: ignore[arg-type]
        mm_hashes={"image": [_digest(p) for p in pictures]},
        mm_placeholders={"image": [PlaceholderRange(offset=at, length=n) for at, n in places]},
    )


def _placeholders(ids: list[int], pictures: int, layout: PictureLayout) -> list[tuple[int, int]]:
    """``(offset, length)`` of each picture's run of image tokens."""
    seq = layout.image_seq_len
    at = [i for i, t in enumerate(ids) if t == layout.image_token_id]
    if len(at) < pictures * seq:
        raise ValueError(
            f"{pictures} pictures need {pictures * seq} image tokens ({seq} each), the prompt "
            f"has {len(at)}: its pictures are not those its ids were made with"
        )
    runs = [at[k * seq : (k + 1) * seq] for k in range(pictures)]
    for k, run in enumerate(runs):
        if run[-1] - run[0] != seq - 1:
            raise ValueError(f"the image tokens of picture {k} are not one run of {seq}")
    return [(run[0], seq) for run in runs]


def _digest(picture: torch.Tensor) -> str:
    """A hash of one picture's pixels (with its shape and dtype)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{tuple(picture.shape)}{picture.dtype}".encode())
    h.update(picture.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
