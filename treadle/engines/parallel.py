"""Tensor and sequence parallelism of a training engine, beside FSDP2's data parallelism.

A role's ``world_size`` ranks are laid out as ``dp x tp`` or ``dp x sp`` (consecutive ranks form
one tensor- or sequence-parallel group; :class:`Layout`). The ranks of one group read the same
micro-batches: the controller gives them the same shard of a batch
(:meth:`Layout.data_parallel`, read by :class:`~treadle.controller.WorkerGroup`).

- **Tensor parallel** (``tp``): every decoder layer's attention projections and MLP are split
  across the group with DTensor (:data:`TP_COLUMNS` column-wise: q/k/v, gate/up;
  :data:`TP_ROWS` row-wise: o, down; one all-reduce after attention, one after the MLP), then
  FSDP2 shards each layer over the ``dp`` dimension of a 2-D device mesh. Embeddings, norms and
  the LM head stay whole within the group (FSDP-sharded over ``dp``): the chunked log-prob head
  (:mod:`treadle.engines.lm_head`) then runs unchanged on replicated hidden states.
- **Sequence parallel** (``sp``, DeepSpeed-Ulysses, verl's ``ulysses_sequence_parallel_size``):
  the packed rows (:func:`~treadle.engines.packing.pack`) are cut along their width, each rank
  runs the decoder on its slice; inside attention an all-to-all turns the sequence-sharded
  ``[b, heads, s/sp, d]`` queries, keys and values (rotary embeddings already applied with
  the slice's own positions) into head-sharded ``[b, heads/sp, s, d]``, attention runs over
  each packed sequence of the row on its own (causal, no mask: flash kernels may run, and no
  ``s x s`` mask grows with the row; a sequence longer than a layer's sliding window gets a
  banded mask of its own length; :func:`segment_attention`), and a second all-to-all turns
  the output back.
  The final hidden states are all-gathered (:func:`gather_sequence`) so the heads see the whole
  row. FSDP2 shards over all ranks; a rank's decoder gradients hold only its slice's share,
  so the gather's backward scales them by ``sp`` (FSDP averages over ``sp`` too).

Not combined here: ``tp`` and ``sp`` together, and either with LoRA (config rules refuse them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from treadle.config.rules import parallel_model_problems
from treadle.engines.attention import sdpa_attention
from treadle.runtime.errors import ConfigError

TP_COLUMNS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
"""Modules of a decoder layer split by output features (ColwiseParallel)."""
TP_ROWS = ("self_attn.o_proj", "mlp.down_proj")
"""Modules split by input features (RowwiseParallel: an all-reduce of their outputs)."""

ULYSSES = "treadle_ulysses"
"""The name of the Ulysses attention in transformers' attention registry."""


@dataclass(frozen=True)
class Layout:
    """How one role's ranks split the work: ``tp`` x ``sp`` ranks a group, ``dp`` groups."""

    world_size: int
    tp: int = 1
    sp: int = 1

    def __post_init__(self) -> None:
        if self.world_size % (self.tp * self.sp):
            raise ConfigError(
                f"world_size={self.world_size} must be divisible by tensor_parallel_size x "
                f"sequence_parallel_size = {self.tp * self.sp}"
            )

    @property
    def group_size(self) -> int:
        """Ranks that read the same data (one tensor- or sequence-parallel group)."""
        return self.tp * self.sp

    @property
    def dp(self) -> int:
        """Data-parallel groups: the shards a batch is cut into."""
        return self.world_size // self.group_size

    def data_parallel(self, rank: int) -> tuple[int, bool]:
        """``(data-parallel rank, whether this rank's results are collected)`` of ``rank``:
        the first rank of each group answers for it."""
        return rank // self.group_size, rank % self.group_size == 0


def check_model(config: Any, tp: int, sp: int, section: str) -> None:
    """The model's shape allows the layout (a ConfigError naming ``<section>.<key>`` if not:
    :func:`~treadle.config.rules.parallel_model_problems`)."""
    problem = next(parallel_model_problems(section, tp, sp, config.to_dict()), None)
    if problem is not None:
        raise ConfigError(problem)


class Meshes:
    """This process's device meshes and groups for a :class:`Layout` (every rank builds them
    together, once per worker): ``dp_mesh`` for FSDP2 (``None``: the whole world), ``tp_mesh``
    and ``sp_group`` when those are used, ``dp_group`` for sums over the data."""

    def __init__(self, layout: Layout, device_type: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.layout = layout
        self.dp_mesh: Any = None
        self.tp_mesh: Any = None
        self.sp_group: Any = None
        inner = "tp" if layout.tp > 1 else "sp"
        mesh = init_device_mesh(
            device_type, (layout.dp, layout.group_size), mesh_dim_names=("dp", inner)
        )
        # The ranks at the same place in every group: sums over them count each sample once.
        self.dp_group: Any = mesh["dp"].get_group()
        if layout.tp > 1:
            self.dp_mesh, self.tp_mesh = mesh["dp"], mesh["tp"]
        else:
            self.sp_group = mesh["sp"].get_group()


def parallelize(lm: Any, meshes: Meshes | None, section: str) -> None:
    """Tensor-parallel decoder layers (before FSDP2) or Ulysses attention, as ``meshes`` say."""
    if meshes is None:
        return
    layout = meshes.layout
    check_model(lm.config, layout.tp, layout.sp, section)
    if meshes.tp_mesh is not None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan: dict[str, Any] = {name: ColwiseParallel() for name in TP_COLUMNS}
        plan.update({name: RowwiseParallel() for name in TP_ROWS})
        layers = lm.get_decoder().layers
        names = dict(layers[0].named_modules())
        missing = [name for name in plan if name not in names]
        if missing:
            raise ConfigError(
                f"{section}.tensor_parallel_size={layout.tp}: the model's decoder layers have "
                f"no {missing} (Llama/Qwen2-style layers are supported): set it to 1"
            )
        for layer in layers:
            parallelize_module(layer, meshes.tp_mesh, plan)
    if meshes.sp_group is not None:
        _register_ulysses()
        lm.set_attn_implementation(ULYSSES)
        for layer in lm.get_decoder().layers:
            layer.self_attn.sequence_group = meshes.sp_group


# ----------------------------------------------------------------------------- Ulysses


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of equal chunks along dim 0; its own backward (a permutation)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # (of a strided input it would keep the strides)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def heads_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[b, h, s/sp, d]`` (this rank's positions, every head) to ``[b, h/sp, s, d]`` (every
    position, this rank's heads)."""
    sp = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = x.reshape(b, sp, h // sp, s, d).transpose(0, 1)  # [sp (to rank), b, h/sp, s, d]
    got = _AllToAll.apply(parts, group)  # [sp (from rank), b, h/sp, s, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def sequence_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[b, s, h/sp, d]`` (every position, this rank's heads) to ``[b, s/sp, h, d]``."""
    sp = dist.get_world_size(group)
    b, s, h, d = x.shape
    parts = x.reshape(b, sp, s // sp, h, d).transpose(0, 1)  # [sp (to rank), b, s/sp, h/sp, d]
    got = _AllToAll.apply(parts, group)  # [sp (from rank: its heads), b, s/sp, h/sp, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // sp, sp * h, d)


Segments = list[list[tuple[int, int]]]
"""Per packed row, the ``(start, end)`` of each sequence in it, in order, covering the row."""


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    sequence_segments: Segments | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`segment_attention` over the whole row, reached by two all-to-alls.
    ``sequence_segments``: the packed sequences of each row, passed down by
    :func:`sequence_parallel_forward` (transformers hands a forward's extra keyword arguments
    to the attention; it drops a mask it does not build itself for an attention it does not
    know, Llama's forward among others)."""
    if sequence_segments is None:
        raise RuntimeError(
            "sequence-parallel attention got no sequence_segments: it runs on packed rows "
            "through treadle.engines.parallel.sequence_parallel_forward, and needs a model "
            "whose layers pass their forward's keyword arguments on to the attention"
        )
    group: Any = module.sequence_group
    q, k, v = (heads_to_sequence(t, group) for t in (query, key, value))
    if kwargs.get("s_aux") is not None:  # attention sinks, one a head: this rank's heads'
        heads = q.shape[1]
        kwargs["s_aux"] = kwargs["s_aux"].narrow(0, dist.get_rank(group) * heads, heads)
    out = segment_attention(module, q, k, v, sequence_segments, **kwargs)
    return sequence_to_heads(out, group), None


def packed_segments(position_ids: torch.Tensor) -> Segments:
    """The sequences of packed rows ``[rows, s]``: each starts where its position is 0 (the
    first at 0 whatever its position; filler continues the last, as :func:`pack` lays it)."""
    rows, width = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    begin: list[list[int]] = [[] for _ in range(rows)]
    for r, i in starts.nonzero().tolist():
        begin[r].append(i)
    return [list(zip(b, [*b[1:], width], strict=True)) for b in begin]


def segment_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    **kwargs: Any,
) -> torch.Tensor:
    """Causal sdpa attention (:func:`~treadle.engines.attention.sdpa_attention`) within each
    packed sequence of ``[b, heads, s, d]`` rows, ``[b, s, heads, d]`` out: what the rows'
    block-diagonal causal mask gives, computed on the blocks alone. Rows laid out alike
    (one long sequence each, say) go through each call together. A sliding-window layer's
    ``sliding_window`` (Qwen2's attention passes it) holds each sequence longer than the window
    to it, with a mask of that sequence alone. The rows and sequences are cut with ``split``,
    whose backward is one concatenation (a slice's backward writes a zero tensor of the whole
    input: per sequence, the row's size)."""
    window = kwargs.get("sliding_window")
    if any(row != segments[0] for row in segments):
        rows = zip(query.split(1), key.split(1), value.split(1), segments, strict=True)
        return torch.cat([segment_attention(module, *r[:3], [r[3]], **kwargs) for r in rows], 0)
    lengths = [e - a for a, e in segments[0]]
    qs, ks, vs = (t.split(lengths, 2) for t in (query, key, value))
    attend = sink_attention if kwargs.get("s_aux") is not None else sdpa_attention
    parts = [
        attend(module, q, k, v, _window_mask(n, window, query.device), **kwargs)[0]
        for q, k, v, n in zip(qs, ks, vs, lengths, strict=True)
    ]
    return torch.cat(parts, 1)


def sink_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    *,
    s_aux: torch.Tensor,
    scaling: float,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention of one sequence ``[b, heads, s, d]`` (``allowed``: a window's bool
    mask) with a sink a head (``s_aux``, gpt-oss's ``sinks``): a logit beside every query's
    scores that takes its share of the softmax and adds nothing to the output, as the model's
    own eager attention computes it (sdpa has no sinks: dropping them put log-probs 0.16 off).
    ``[b, s, heads, d]`` out, as ``sdpa_attention``'s."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    length = query.shape[2]
    if allowed is None:
        allowed = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    sinks = s_aux.reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1).to(scores.dtype)
    logits = torch.cat([scores, sinks], -1)
    logits = logits - logits.max(-1, keepdim=True).values
    weights = torch.softmax(logits, -1)[..., :-1].to(value.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


def _window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """``[length, length]`` bool: causal attention within ``window`` positions (a key more than
    ``window - 1`` before the query is not seen, as transformers' sliding window); None where
    plain causal attention is the same."""
    if window is None or length <= window:
        return None
    i = torch.arange(length, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


def _register_ulysses() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES, ulysses_attention)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 1; backward keeps this rank's slice, times the group size."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        sp, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        # Every rank of the group computes the same loss from the gathered states; FSDP2
        # averages gradients over all ranks, the group's included: times sp makes the sum of
        # the slices' shares.
        return grad.chunk(sp, 1)[rank] * sp, None


def gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[b, s/sp, ...]`` slices of the group's ranks, concatenated to ``[b, s, ...]``."""
    return _GatherSequence.apply(x, group)


def sequence_parallel_forward(
    decoder: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, group: Any
) -> torch.Tensor:
    """The decoder's last hidden states ``[rows, width, H]`` of packed rows, each rank running
    its slice of the width (padded to a multiple of the group size)."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    width = input_ids.shape[1]
    pad = -width % sp
    if pad:  # filler continuing each row's last sequence, as pack's
        input_ids = nn.functional.pad(input_ids, (0, pad))
        more = torch.arange(1, pad + 1, device=position_ids.device)
        position_ids = torch.cat([position_ids, position_ids[:, -1:] + more], 1)
    local = slice(rank * (width + pad) // sp, (rank + 1) * (width + pad) // sp)
    hidden = decoder(
        input_ids=input_ids[:, local],
        position_ids=position_ids[:, local],
        use_cache=False,
        sequence_segments=packed_segments(position_ids),
    ).last_hidden_state
    return gather_sequence(hidden, group)[:, :width]
