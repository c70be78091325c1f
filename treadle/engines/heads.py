"""The FSDP2 roots: one decoder forward on the selected labels, and the heads that read it.

Every training engine's root module is a head around a Hugging Face model (the head holds it
as ``.lm``): :class:`LogProbHead` for causal LMs (actor, reference, PRM) and
:class:`~treadle.engines.value.ValueHead` for value models (critic, reward model). Both run
the decoder through :func:`response_hidden` (:meth:`HeadRoot.hidden`), which keeps only the
hidden states that predict selected label tokens, so no head compute is spent on padding.

:class:`LogProbHead` takes one :class:`LogProbRequest` and returns one :class:`LogProbOutput`:
the request names what to compute beside the log-probs and entropy (``Σ_v π(v)²``, the whole
log-softmax, a term against another model's distribution, the logits at given ids), the
output carries those fields and ``None`` for the others. The chunked float32 arithmetic is
:mod:`treadle.engines.lm_head`; what a model's forward does to its logits beyond
``hidden @ W.T`` (a scale, a soft-cap) it does too (:func:`logit_transform`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from treadle.engines.lm_head import (
    LMHead,
    full_log_softmax,
    full_vocab_term,
    linear_log_probs,
    linear_token_stats,
    linear_topk_logits,
)
from treadle.engines.packing import (
    PackedLayout,
    label_positions,
    pack,
    pack_shared,
    scatter_labels,
)
from treadle.engines.parallel import sequence_parallel_forward
from treadle.engines.pictures import picture_embeddings, picture_tokens
from treadle.runtime.errors import ConfigError


def response_hidden(
    lm: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_labels: int,
    *,
    label_mask: torch.Tensor | None = None,
    row_tokens: int | None = None,
    sequence_group: Any = None,
    pixel_values: torch.Tensor | None = None,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder hidden states that predict the selected labels among the last ``num_labels``.

    The one decoder forward every head (log-probs, values) builds on. Returns ``(hidden [N, H],
    where [B, num_labels])``: ``where`` marks the selected labels (see
    :func:`~treadle.engines.packing.label_positions`) and ``hidden`` holds, in row-major order
    of ``where``, the state of the token before each one (position t's state predicts token
    t + 1, so a value head reads the state before each response token). Heads compute on these
    N states only and put results back with :func:`~treadle.engines.packing.scatter_labels`.

    ``row_tokens`` set: the forward runs on the valid tokens only, packed into rows of at most
    that many tokens (:func:`~treadle.engines.packing.pack`); ``None``: on the padded batch.
    Both give the same states (within float rounding). ``sequence_group`` (packed only): the
    ranks of a sequence-parallel group split each row's width
    (:func:`~treadle.engines.parallel.sequence_parallel_forward`); every rank gets all states.

    ``pixel_values`` ``[B, images, 3, H, W]`` (a vision-language model's pictures, zero ones as
    padding): the decoder takes input embeddings in which the rows' picture tokens hold the
    vision tower's features (:mod:`treadle.engines.pictures`), packed or not; the image tokens
    keep ordinary 1-D positions (Idefics3). Not with ``sequence_group`` (the rules refuse it).

    ``share_prompts`` (packed only): rows with the same prompt have it computed once, the same
    states within float rounding (:func:`~treadle.engines.packing.pack_shared`, a 4-D mask);
    not with ``sequence_group``, ``pixel_values`` or what :func:`can_share_prompts` refuses.
    """
    where = label_positions(attention_mask, num_labels, label_mask)
    decoder = lm.get_decoder()
    if row_tokens is None:  # the padded batch
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        inputs = {**_inputs(lm, input_ids, pixel_values), "use_cache": False}
        hidden = decoder(attention_mask=attention_mask, position_ids=position_ids, **inputs)
        return hidden.last_hidden_state[:, -num_labels - 1 : -1][where], where
    h = getattr(decoder.config, "hidden_size", None)  # weighs a row's width (see pack)
    shared = share_prompts and sequence_group is None and pixel_values is None
    if shared and can_share_prompts(decoder.config):
        layout = pack_shared(input_ids, attention_mask, where, row_tokens, hidden_size=h)
        if layout.attention_mask is not None:  # (else no prompt is shared: pack's layout)
            hidden = decoder(
                input_ids=layout.input_ids,
                attention_mask=_mask_for(decoder, layout.attention_mask),
                position_ids=layout.position_ids,
                use_cache=False,
            ).last_hidden_state
            return layout.label_states(hidden), where
    layout = pack(input_ids, attention_mask, where, row_tokens, hidden_size=h)
    hidden = _packed_hidden(
        lm, layout, (input_ids, attention_mask), row_tokens, sequence_group, pixel_values
    )
    return layout.label_states(hidden), where


def _packed_hidden(
    lm: Any,
    layout: PackedLayout,
    batch: tuple[torch.Tensor, torch.Tensor],
    row_tokens: int,
    sequence_group: Any,
    pixel_values: torch.Tensor | None,
) -> torch.Tensor:
    """The decoder's states ``[rows, width, H]`` of :func:`pack`'s ``layout`` (of rows of at
    most ``row_tokens``) of ``batch`` (input ids, attention mask): split over a
    sequence-parallel group, or with pictures (see :func:`response_hidden`)."""
    decoder = lm.get_decoder()
    input_ids, attention_mask = batch
    if sequence_group is not None:
        assert pixel_values is None, "sequence parallel does not take pictures (config rules)"
        return sequence_parallel_forward(
            decoder, layout.input_ids, layout.position_ids, sequence_group
        )
    inputs = {"input_ids": layout.input_ids}
    if pixel_values is not None:  # the picture positions, packed the same way
        h = getattr(decoder.config, "hidden_size", None)
        pictures = picture_tokens(lm, input_ids, pixel_values).long()
        packed = pack(pictures, attention_mask, layout.where, row_tokens, hidden_size=h)
        pixels = layout.packed_pixels(pixel_values)
        inputs = {
            "inputs_embeds": picture_embeddings(
                lm, layout.input_ids, packed.input_ids.bool(), pixels
            )
        }
    # No attention mask and no cache: transformers then builds the block-diagonal causal mask
    # from the position ids (with a cache it silently attends across the whole row).
    return decoder(position_ids=layout.position_ids, use_cache=False, **inputs).last_hidden_state


SHARED_ATTENTION = ("sdpa", "eager")
"""The attention implementations that take :func:`pack_shared`'s 4-D mask as given."""


def can_share_prompts(config: Any) -> bool:
    """Whether a decoder of ``config`` runs the shared-prompt layout exactly: attention that
    takes a 4-D mask (:data:`SHARED_ATTENTION`) and no sliding window (the mask holds none)."""
    return (
        getattr(config, "_attn_implementation", None) in SHARED_ATTENTION
        and getattr(config, "sliding_window", None) is None
    )


def _mask_for(decoder: Any, allowed: torch.Tensor) -> torch.Tensor:
    """A bool 4-D mask (True: attend) as the decoder's attention takes it: sdpa the bool
    mask, eager an additive one (0 or the dtype's minimum, as ``masking_utils.eager_mask``)."""
    if decoder.config._attn_implementation == "sdpa":
        return allowed
    dtype = decoder.get_input_embeddings().weight.dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def _inputs(
    lm: Any, input_ids: torch.Tensor, pixel_values: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The decoder's input: the token ids, or with pictures the embeddings holding them."""
    if pixel_values is None:
        return {"input_ids": input_ids}
    pictures = picture_tokens(lm, input_ids, pixel_values)
    return {"inputs_embeds": picture_embeddings(lm, input_ids, pictures, pixel_values)}


class HeadRoot(nn.Module):
    """A head around an HF model (``.lm``): the decoder's states at the selected labels."""

    def __init__(self, lm: nn.Module, row_tokens: int | None = None) -> None:
        super().__init__()
        self.lm: Any = lm  # a transformers PreTrainedModel
        self.row_tokens = row_tokens  # set: packed forward, no compute on padding
        self.sequence_group: Any = None  # set (by the engine): sequence-parallel forward
        self.share_prompts = False  # set (by the engine): a shared prompt computed once

    def hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_labels: int,
        label_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`response_hidden` of this head's model."""
        return response_hidden(
            self.lm,
            input_ids,
            attention_mask,
            num_labels,
            label_mask=label_mask,
            row_tokens=self.row_tokens,
            sequence_group=self.sequence_group,
            pixel_values=pixel_values,
            share_prompts=self.share_prompts,
        )


@dataclass(frozen=True)
class PairTerm:
    """A per-label term between this model's log-softmax and another's at the same labels:
    ``fn(log-softmax [n, V], other [n, V]) -> [n]`` (e.g. the exact KL to a reference)."""

    other: torch.Tensor  # the other model's LogProbOutput.full_log_softmax on the same batch
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LogProbRequest:
    """What a :class:`LogProbHead` forward computes: the log-probs (and entropy) of the last
    ``num_labels`` tokens of ``input_ids`` under ``softmax(logits / temperature)``, of the
    labels ``label_mask`` selects (default: every valid one), and, when asked, one of:

    - ``sum_pi_squared``: ``Σ_v π(v)²`` of each label position (no gradients);
    - ``full_vocab``: the whole log-softmax ``[N, V]`` at the selected labels (no gradients);
    - ``pair``: a :class:`PairTerm` per label, differentiable.

    ``topk_ids`` ``[B, num_labels, K]`` (long; K ids at each label position, e.g. a teacher's
    top-k) adds the logits at those ids, differentiable, beside the log-probs and entropy (and
    ``pair``); not with ``sum_pi_squared`` or ``full_vocab``.

    ``pixel_values`` ``[B, images, 3, H, W]``: the pictures of a vision-language model's rows
    (the ``pixel_values`` batch field), whose image tokens are in ``input_ids``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    num_labels: int
    temperature: float = 1.0
    label_mask: torch.Tensor | None = None
    sum_pi_squared: bool = False
    full_vocab: bool = False
    pair: PairTerm | None = None
    topk_ids: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.topk_ids is None:
            return
        if self.sum_pi_squared or self.full_vocab:
            raise ValueError(
                "LogProbRequest: topk_ids goes with neither sum_pi_squared nor full_vocab"
            )
        want = (self.input_ids.shape[0], self.num_labels)
        if self.topk_ids.dim() != 3 or tuple(self.topk_ids.shape[:2]) != want:
            raise ValueError(
                f"LogProbRequest: topk_ids must be [B, num_labels, K] = [{want[0]}, {want[1]}, K], "
                f"got {list(self.topk_ids.shape)}"
            )


@dataclass(frozen=True)
class LogProbOutput:
    """A :class:`LogProbHead` forward's result. ``[B, num_labels]`` float32 fields are 0 where
    a label is not selected; the fields the request did not ask for are ``None``."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    sum_pi_squared: torch.Tensor | None = None
    full_log_softmax: torch.Tensor | None = None  # [N, V], in row-major order of the labels
    pair_term: torch.Tensor | None = None
    # [N, K] logits / temperature at the request's topk_ids, in row-major order of the labels
    topk_logits: torch.Tensor | None = None


def logit_transform(config: Any) -> tuple[float, float | None]:
    """``(scale, softcap)``: what the model's own forward does to ``hidden @ W.T`` before its
    logits are returned, which the chunked head must do too (vLLM and the transformers engine
    sample from the model's logits): times Cohere's ``logit_scale``, divided by Granite's
    ``logits_scaling`` (a scale: folded into the temperature), Gemma 2's
    ``final_logit_softcapping`` (``c tanh(z / c)``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = float(getattr(text, "logit_scale", None) or 1.0)
    scale /= float(getattr(text, "logits_scaling", None) or 1.0)
    softcap = getattr(text, "final_logit_softcapping", None)
    if softcap is not None and scale != 1.0:
        raise ConfigError(
            f"model.path: a {text.model_type} model both scales and soft-caps its logits, "
            "which treadle's LM head does not do"
        )
    return scale, softcap


class LogProbHead(HeadRoot):
    """The FSDP2 root of a causal LM: a :class:`LogProbRequest` in, a :class:`LogProbOutput` out.

    The LM head runs on selected positions only, ``chunk_size`` label tokens at a time
    (:func:`~treadle.engines.lm_head.linear_log_probs`), its matrix products in
    ``compute_dtype`` when given.
    """

    def __init__(
        self,
        lm: nn.Module,
        chunk_size: int = 512,
        row_tokens: int | None = None,
        compute_dtype: torch.dtype | None = None,
    ):
        super().__init__(lm, row_tokens)
        self.chunk_size = chunk_size
        self.compute_dtype = compute_dtype
        self.logit_scale, self.softcap = logit_transform(lm.config)

    def forward(self, req: LogProbRequest) -> LogProbOutput:
        hidden, where = self.hidden(
            req.input_ids, req.attention_mask, req.num_labels, req.label_mask, req.pixel_values
        )
        labels = req.input_ids[:, -req.num_labels :][where]
        weight = self.lm.get_output_embeddings().weight
        temperature = req.temperature / self.logit_scale
        head = LMHead(weight, temperature, self.chunk_size, self.compute_dtype, self.softcap)
        if req.sum_pi_squared:  # no gradients: the old policy's pass
            stats = linear_token_stats(hidden, labels, head)
            return LogProbOutput(*(scatter_labels(x, where) for x in stats))
        if req.full_vocab:
            full = full_log_softmax(hidden, head)
            logp = full.gather(-1, labels[:, None])[:, 0]
            # chunk by chunk: one [chunk, V] block beside the [N, V] result at a time
            ent = torch.cat([-(c.exp() * c).sum(-1) for c in full.split(self.chunk_size)])
            return LogProbOutput(
                scatter_labels(logp, where), scatter_labels(ent, where), full_log_softmax=full
            )
        if len(labels):
            logp, ent = linear_log_probs(hidden, labels, head)
        else:
            # No selected label (every response masked out): still a result on the autograd
            # graph through the decoder and the head, so backward (and FSDP's gradient
            # reduction, which every rank must join) runs as for any micro-batch.
            logp = ent = (hidden @ weight[:1].t()).sum(-1).float()
        term = None
        if req.pair is not None:
            pair = req.pair
            term = full_vocab_term(hidden, head, pair.other, pair.fn) if len(labels) else logp
            term = scatter_labels(term, where)
        topk = None
        if req.topk_ids is not None:
            topk = linear_topk_logits(hidden, req.topk_ids[where], head)
        return LogProbOutput(
            scatter_labels(logp, where),
            scatter_labels(ent, where),
            pair_term=term,
            topk_logits=topk,
        )
