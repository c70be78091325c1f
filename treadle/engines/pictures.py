"""A vision-language model's pictures in a training forward: which image tokens are pictures,
and the decoder's input embeddings with those tokens replaced by the vision tower's features.

Why not the model's own forward (``Idefics3Model.forward``): it replaces *every* image token
of ``input_ids`` with picture features, and a sampled response may hold the image token too
(a policy can emit any id). The rollout engine embedded such a token as an ordinary token
(transformers ``generate`` passes the pictures at prefill only; later steps are plain token
embeddings), so the log-probs of the update must see it the same way. Here only the image
tokens that belong to the rows' pictures are replaced: per row, the first
``pictures x image_seq_len`` image tokens (the prompt's; a picture's tokens are never cut).

Idefics3-family models (Idefics3, SmolVLM): ``lm.config.image_token_id``,
``lm.model.image_seq_len`` and ``lm.model.get_image_features``. Positions stay 1-D, so packed
rows need nothing more than the pictures in the order of their tokens
(:meth:`~treadle.engines.packing.PackedLayout.packed_pixels`).
"""

from __future__ import annotations

from typing import Any

import torch


def picture_tokens(lm: Any, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` bool: the image tokens of each row that its pictures fill (all-zero pictures
    are padding and have none)."""
    is_image = input_ids == lm.config.image_token_id
    real = (pixel_values.flatten(2) != 0).any(-1).sum(1)  # pictures per row
    budget = real * lm.model.image_seq_len
    return is_image & (is_image.long().cumsum(1) <= budget.to(input_ids.device)[:, None])


def picture_embeddings(
    lm: Any, input_ids: torch.Tensor, pictures: torch.Tensor, pixel_values: torch.Tensor
) -> torch.Tensor:
    """The decoder's input embeddings of ``input_ids`` with the ``pictures`` positions (row-major
    order) replaced by the features of ``pixel_values`` ``[b, images, 3, H, W]``, in order."""
    embeds = lm.get_input_embeddings()(input_ids)
    features = lm.model.get_image_features(pixel_values, return_dict=True).pooler_output
    features = features.reshape(-1, features.shape[-1]).to(embeds.dtype)
    if features.shape[0] != int(pictures.sum()):
        raise ValueError(
            f"{int(pictures.sum())} image tokens for {features.shape[0]} picture features: "
            "a prompt's image tokens do not match its pictures"
        )
    return embeds.masked_scatter(pictures[..., None], features)
