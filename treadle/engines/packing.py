"""Sequences without their padding: packed rows, token-budget micro-batches, balanced ranks.

treadle's batches are padded (prompts left-padded, responses right-padded: see
:mod:`treadle.protocol.batch`), which suits the driver and the algorithms. A decoder forward on that
layout computes on every pad position. Here are the pieces that take the padding out:

- :func:`pack` lays the valid tokens of a padded batch into a few rows, several sequences per
  row, each sequence's position ids restarting at 0. transformers recognises that layout from
  the position ids (``masking_utils.find_packed_sequence_indices``, used when the attention
  mask is ``None``) and builds a block-diagonal causal mask, so attention stays within each
  sequence for every attention implementation (sdpa, eager, flex; flash-attention takes the
  varlen path). Rows hold at most ``row_tokens`` tokens (or the longest sequence when it is
  longer), filled first-fit-decreasing: one long row would make attention quadratic in the
  total length, and on CPU sdpa computes the whole masked square (measured in
  ``bench/train_step.py``; see the actor config). The layout also says where, in the packed
  rows, the hidden state predicting each selected label sits, so heads run on those states
  only and scatter back to the ``[batch, num_labels]`` layout.
- :func:`pack_shared` does the same with each shared prompt laid out once: the samples of a
  GRPO group (:func:`prompt_groups`: identical valid prompt tokens) become one unit, the prompt
  followed by every response, each response attending to the prompt and to its own causal
  prefix only, with the positions it has in its own sequence. The position ids cannot say
  that (a second response's do not restart at 0), so the layout carries an explicit 4-D mask.
- :func:`token_micro_batches` groups a rank's samples into micro-batches by a token budget
  instead of a sample count, with the same number of micro-batches on every rank (FSDP's
  collectives run once per micro-batch; a rank with fewer would hang the others).
- :func:`balanced_order` reorders a batch before it is cut into contiguous per-rank chunks so
  that every rank gets a similar number of tokens (verl's ``seqlen_balancing``).

Everything here is plain index bookkeeping on small integer tensors; no model is involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treadle.protocol import Batch, response_attention


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Groups of indices whose lengths sum to at most ``capacity``, longest items placed first.

    An item longer than ``capacity`` gets a group of its own. Groups come out in the order they
    were opened (the first holds the longest item).
    """
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for g, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    return groups


def token_micro_batches(
    lengths: Sequence[int], budget: int, count: int | None = None
) -> list[list[int]]:
    """Split samples into micro-batches of at most ``budget`` tokens (a longer sample alone).

    With ``count`` (at least the number the budget needs, at most ``len(lengths)``), the
    heaviest micro-batch with two or more samples is halved until there are ``count``: every
    rank can then run the same number of micro-batches without any exceeding the budget.
    Micro-batches are ordered heaviest first, so the i-th ones of different ranks are alike.
    """
    groups = first_fit_decreasing(lengths, budget)
    count = len(groups) if count is None else count
    if not len(groups) <= count <= len(lengths):
        raise ValueError(
            f"cannot make {count} micro-batches of {len(lengths)} samples "
            f"(the budget of {budget} tokens needs {len(groups)})"
        )

    def load(g: list[int]) -> int:
        return sum(lengths[i] for i in g)

    while len(groups) < count:
        heavy = max((g for g in groups if len(g) > 1), key=load)
        groups.remove(heavy)
        groups += [heavy[::2], heavy[1::2]]  # heavy is sorted by length: alternate halves
    return sorted(groups, key=load, reverse=True)


def balanced_order(lengths: Sequence[int], parts: int) -> list[int]:
    """A permutation after which ``parts`` contiguous equal chunks have similar token sums.

    Greedy: the longest remaining sample goes to the lightest part that still has room
    (every part holds ``len(lengths) // parts`` samples, as the data-parallel dispatch needs):
    :func:`balanced_group_order` with every sample a group of its own.
    """
    n = len(lengths)
    return balanced_group_order([[i] for i in range(n)], lengths, [0] * n, parts)


def balanced_group_order(
    groups: Sequence[Sequence[int]], prompt: Sequence[int], response: Sequence[int], parts: int
) -> list[int]:
    """:func:`balanced_order` of groups of samples that share a prompt, which a part counts
    once: the heaviest remaining group goes whole to the lightest part with room for it;
    where no part has room, it fills the lightest part with room and the rest goes on.
    ``prompt`` / ``response``: each sample's tokens. Groups of one: :func:`balanced_order`."""
    n = len(prompt)
    if n % parts:
        raise ValueError(f"{n} samples cannot be cut into {parts} equal parts")
    size = n // parts
    members: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts

    def cost(g: Sequence[int]) -> int:
        return prompt[g[0]] + sum(response[i] for i in g)

    for group in sorted(groups, key=lambda g: -cost(g)):
        rest = list(group)
        while rest:
            room = [p for p in range(parts) if len(members[p]) < size]
            whole = [p for p in room if size - len(members[p]) >= len(rest)]
            p = min(whole or room, key=lambda p: loads[p])
            take, rest = rest[: size - len(members[p])], rest[size - len(members[p]) :]
            members[p] += take
            loads[p] += cost(take)
    return [i for part in members for i in sorted(part)]


def balance_ranks(batch: Batch, ranks: int, share_prompts: bool = False) -> Batch:
    """``batch`` reordered by :func:`balanced_order` of its valid tokens (prompt + response);
    ``share_prompts``: by :func:`balanced_group_order`, a prompt's samples kept on one rank
    where the counts allow, so that its forwards compute the prompt once."""
    prompt, response = batch["prompt_mask"].sum(1), response_attention(batch).sum(1)
    if share_prompts and ranks > 1:
        groups = prompt_groups(batch["prompts"], batch["prompt_mask"])
        order = balanced_group_order(groups, prompt.tolist(), response.tolist(), ranks)
        return batch.select(order)
    return batch.select(balanced_order((prompt + response).tolist(), ranks))


@dataclass
class PackedLayout:
    """A padded batch's valid tokens packed into rows, and where its labels' states are.

    ``input_ids`` / ``position_ids`` are ``[rows, width]``; positions restart at 0 for every
    sequence (the filler after the last sequence of a row goes on counting it: rows of one
    sequence each then need no attention mask). ``where`` is the
    ``[batch, num_labels]`` mask of selected labels; ``gather`` holds, for each selected label
    in row-major order of ``where``, the flat index into ``rows * width`` of the hidden state
    that predicts it. ``order``: the samples in the order their tokens appear in the packed
    rows, row-major (a vision-language model fills its image tokens with the pictures in that
    order: :meth:`packed_pixels`). ``attention_mask``: see :func:`pack_shared`.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    where: torch.Tensor
    gather: torch.Tensor
    order: torch.Tensor
    # [rows, 1, width, width] bool (True: the row's query position attends to the key
    # position) of a layout with shared prompts (:func:`pack_shared`); None: the position ids
    # say it all
    attention_mask: torch.Tensor | None = None

    def label_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The states at ``gather`` of the packed rows' ``hidden`` ``[rows, width, H]``:
        ``[N, H]``, with a backward that adds a state's gradients in the same order every run.

        ``gather`` repeats a state where rows share a prompt (:func:`pack_shared`: its last
        state predicts every response's first token). Indexing's backward on the CPU adds
        repeated rows from several threads at once, in whatever order they come
        (``torch.use_deterministic_algorithms`` lists it): beside a busy core the last bits of
        the gradients changed from run to run, and the demo's RL line by 2 points.
        ``index_select``'s backward (``index_add_``) adds them in order on the CPU; on CUDA it
        is ``index_add_`` that adds atomically and indexing's backward that sorts, so there
        indexing stays."""
        flat = hidden.flatten(0, 1)
        if flat.device.type == "cpu":
            return flat.index_select(0, self.gather)
        return flat[self.gather]

    def packed_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """A batch's pictures ``[B, images, 3, H, W]`` as the packed rows' one sample
        ``[1, B * images, 3, H, W]``, in the order of their image tokens (all-zero padding
        pictures stay; the model drops them)."""
        return pixel_values[self.order.to(pixel_values.device)].flatten(0, 1)[None]


def label_positions(
    attention_mask: torch.Tensor, num_labels: int, label_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, num_labels]`` bool: labels that are valid tokens preceded by a valid token.

    The state predicting column c is that of column c - 1; without a valid token there (an
    empty prompt) there is nothing to predict from. ``label_mask`` narrows the selection
    further (e.g. SFT's loss mask: no head compute on prompt positions).
    """
    valid = attention_mask.bool()
    where = valid[:, -num_labels:] & valid[:, -num_labels - 1 : -1]
    if label_mask is not None:
        where = where & label_mask.bool()
    return where


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    where: torch.Tensor,
    row_tokens: int,
    pad_id: int = 0,
    hidden_size: int | None = None,
) -> PackedLayout:
    """Pack the valid tokens of ``input_ids [B, L]`` into rows of at most ``row_tokens``.

    Each sequence keeps its tokens in order with positions ``0 .. n-1`` (what the padded
    forward gives through ``cumsum(mask) - 1``); rows are filled first-fit-decreasing. Rows
    are as wide as the fullest one, so several capacities are tried, from the longest sequence
    (one sequence a row at equal lengths) to ``row_tokens``, and the cheapest layout wins, the
    narrower at a tie. Its cost: row positions, each weighted by ``3 h + width`` with the
    model's ``hidden_size`` h (a decoder layer's matrix products cost ~12 h² a position, its
    attention ~4 h x width, as attention computes the whole square of every row); without
    ``hidden_size``, positions alone, between the two end capacities only. Measured on the
    tiny model (h = 128), 256 sequences of 24-64 tokens, one thread: rows of 256 1.19 s an
    update, of 128 1.13 s, of 96 1.05 s, one sequence a row (64) 1.26 s.
    """
    valid = attention_mask.bool()
    lengths = valid.sum(1)
    device = input_ids.device
    width, groups = _cheapest_rows(lengths.tolist(), row_tokens, hidden_size)
    # Where each sequence starts in the flat [rows * width] layout.
    seq_start = torch.zeros(len(lengths), dtype=torch.long)
    for r, g in enumerate(groups):
        offsets = torch.cumsum(lengths[g], 0) - lengths[g]
        seq_start[g] = r * width + offsets.cpu()
    seq_start = seq_start.to(device)
    # Every valid token's local position and its flat destination.
    local = (valid.long().cumsum(1) - 1).clamp(min=0)
    dest = torch.full(valid.shape, -1, dtype=torch.long, device=device)
    dest[valid] = (seq_start[:, None] + local)[valid]
    flat_ids = torch.full((len(groups) * width,), pad_id, dtype=input_ids.dtype, device=device)
    flat_ids[dest[valid]] = input_ids[valid]
    # Filler positions go on counting the row's last sequence: a row holding one sequence is
    # then one run of positions, and when every row is, transformers needs no mask (causal
    # attention alone; the filler comes after every valid token it could disturb).
    last_start = torch.tensor([int(lengths[g].sum() - lengths[g[-1]]) for g in groups])
    flat_pos = torch.arange(len(groups) * width, device=device) % width
    flat_pos -= last_start.to(device).repeat_interleave(width)
    flat_pos[dest[valid]] = local[valid]
    num_labels = where.shape[1]
    gather = dest[:, -num_labels - 1 : -1][where]
    return PackedLayout(
        input_ids=flat_ids.view(len(groups), width),
        position_ids=flat_pos.view(len(groups), width),
        where=where,
        gather=gather,
        order=seq_start.cpu().argsort(stable=True),
    )


def prompt_groups(prompts: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """The rows of ``prompts [B, P]`` grouped by identical valid tokens (``prompt_mask``), in
    the order of their first rows; a row with an empty prompt is a group of its own.

    Identity is by tokens, not by a prompt id: the samples of a GRPO group share a prompt, a
    multi-turn sample whose prompt differs does not."""
    groups: dict[tuple[int, ...] | int, list[int]] = {}
    valid = prompt_mask.bool()
    for i, (row, keep) in enumerate(zip(prompts.tolist(), valid.tolist(), strict=True)):
        key = tuple(t for t, k in zip(row, keep, strict=True) if k)
        groups.setdefault(key if key else -1 - i, []).append(i)
    return list(groups.values())


def pack_shared(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    where: torch.Tensor,
    row_tokens: int,
    pad_id: int = 0,
    hidden_size: int | None = None,
) -> PackedLayout:
    """:func:`pack`, with the prompt of the rows that share one laid out once.

    The prompt is what comes before the last ``where.shape[1]`` columns (the labels: the
    responses); rows with identical valid prompt tokens (:func:`prompt_groups`) form a unit,
    ``P R1 R2 ... Rk`` in one packed row, a row without a partner the unit ``P R``. Each
    token keeps its position in its own sequence (Ri's continue P's); a response token
    attends to P and to its own response's earlier tokens, not to the other responses, so
    every state is the one of the unshared sequence, P's states computed once for the k
    responses (their gradients add up over them). The state predicting Ri's first token is
    P's last, shared. The layout's ``attention_mask`` says so (filler attends to itself).
    Units are laid into rows as :func:`pack` lays sequences; a unit that would pass
    ``row_tokens`` (or the longest sequence) is cut into consecutive units, each with the
    prompt, so that no row grows wider than unshared packing makes it (attention computes
    each row's whole square).

    Without a prompt shared by two rows this is :func:`pack` (no attention mask), and so it is
    with a prompt of one column (SFT's labels: every position but the first), which would
    save a token a row.
    """
    num_labels = where.shape[1]
    split = input_ids.shape[1] - num_labels
    valid = attention_mask.bool()
    prompt = valid[:, :split].sum(1).cpu()
    response = valid[:, split:].sum(1).cpu()
    cap = max(row_tokens, int((prompt + response).max()))
    responses = response.tolist()
    groups = [
        piece
        for g in prompt_groups(input_ids[:, :split], valid[:, :split])
        for piece in prompt_pieces(g, int(prompt[g[0]]), responses, cap)
    ]
    if split < 2 or all(len(g) == 1 for g in groups):
        return pack(input_ids, attention_mask, where, row_tokens, pad_id, hidden_size)
    sizes = [int(prompt[g[0]] + response[g].sum()) for g in groups]
    width, rows = _cheapest_rows(sizes, row_tokens, hidden_size)
    places = _places(groups, rows, sizes, width, response, len(valid))
    return _pack_units(input_ids, valid, where, (width, len(rows)), places, pad_id)


def _pack_units(
    input_ids: torch.Tensor,
    valid: torch.Tensor,
    where: torch.Tensor,
    shape: tuple[int, int],
    places: tuple[torch.Tensor, ...],
    pad_id: int,
) -> PackedLayout:
    """:func:`pack_shared`'s layout of the samples at ``places`` (:func:`_places`) in
    ``shape`` = (width, rows)."""
    width, n_rows = shape
    num_labels = where.shape[1]
    split = input_ids.shape[1] - num_labels
    device = input_ids.device
    start, before, branch, unit = (x.to(device) for x in places)
    # A prompt token goes to start + its position, a response token after the responses of
    # its unit that come before it: start + before + its position.
    local = (valid.long().cumsum(1) - 1).clamp(min=0)
    is_response = torch.zeros_like(valid)
    is_response[:, split:] = True
    dest = start[:, None] + local + torch.where(is_response, before[:, None], 0)
    dest = torch.where(valid, dest, -1)
    size = n_rows * width
    flat_ids = torch.full((size,), pad_id, dtype=input_ids.dtype, device=device)
    flat_ids[dest[valid]] = input_ids[valid]  # a shared prompt's rows write the same ids
    flat_pos = torch.zeros(size, dtype=torch.long, device=device)
    flat_pos[dest[valid]] = local[valid]
    flat_unit = torch.full((size,), -1, dtype=torch.long, device=device)
    flat_unit[dest[valid]] = unit[:, None].expand_as(valid)[valid]
    flat_branch = torch.zeros(size, dtype=torch.long, device=device)
    flat_branch[dest[valid]] = torch.where(is_response, branch[:, None], 0)[valid]
    mask = _shared_mask(flat_unit.view(n_rows, width), flat_branch.view(n_rows, width))
    order = (start + before).cpu().argsort(stable=True)
    return PackedLayout(
        input_ids=flat_ids.view(n_rows, width),
        position_ids=flat_pos.view(n_rows, width),
        where=where,
        gather=dest[:, -num_labels - 1 : -1][where],
        order=order,
        attention_mask=mask,
    )


def _places(
    groups: list[list[int]],
    rows: list[list[int]],
    sizes: list[int],
    width: int,
    response: torch.Tensor,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample of :func:`pack_shared`'s units (``groups``, laid into ``rows``): where its
    unit starts in the flat ``[rows * width]`` layout, how many response tokens of its unit
    come before its own, its branch (1 + its place in the unit) and its unit."""
    unit_start = torch.zeros(len(groups), dtype=torch.long)
    for r, units in enumerate(rows):
        lengths = torch.tensor([sizes[u] for u in units])
        unit_start[units] = r * width + lengths.cumsum(0) - lengths
    start, before, branch, unit = (torch.zeros(n, dtype=torch.long) for _ in range(4))
    for u, g in enumerate(groups):
        start[g] = unit_start[u]
        before[g] = response[g].cumsum(0) - response[g]
        branch[g] = torch.arange(1, len(g) + 1)
        unit[g] = u
    return start, before, branch, unit


def _shared_mask(units: torch.Tensor, branches: torch.Tensor) -> torch.Tensor:
    """``[rows, 1, query, key]`` bool: a query attends to a key of its unit (``units``, -1 for
    filler) at or before it that is in the prompt (branch 0) or in its own response; filler to
    itself."""
    width = units.shape[1]
    idx = torch.arange(width, device=units.device)
    same_unit = (units[:, :, None] == units[:, None, :]) & (units[:, :, None] >= 0)
    causal = idx[None, :] <= idx[:, None]
    own_branch = (branches[:, None, :] == 0) | (branches[:, None, :] == branches[:, :, None])
    eye = torch.eye(width, dtype=torch.bool, device=units.device)
    return ((same_unit & causal & own_branch) | eye)[:, None]


def prompt_pieces(group: list[int], prompt: int, response: list[int], cap: int) -> list[list[int]]:
    """``group`` (rows of one prompt) cut into consecutive pieces of at most ``cap`` tokens,
    the prompt once a piece (a row that alone passes it is a piece of its own)."""
    pieces: list[list[int]] = []
    piece: list[int] = []
    size = prompt
    for i in group:
        if piece and size + response[i] > cap:
            pieces.append(piece)
            piece, size = [], prompt
        piece.append(i)
        size += response[i]
    pieces.append(piece)
    return pieces


def _cheapest_rows(
    lengths: list[int], row_tokens: int, hidden_size: int | None
) -> tuple[int, list[list[int]]]:
    """``(width, rows)`` of the cheapest first-fit-decreasing layout (see :func:`pack`)."""
    longest = max(lengths)
    widest = max(row_tokens, longest)
    capacities = {longest, widest}
    if hidden_size is not None:  # up to six capacities in between
        step = max(longest // 2, (widest - longest) // 6, 1)
        capacities.update(range(longest + step, widest, step))
    layouts = []
    for capacity in sorted(capacities):
        rows = first_fit_decreasing(lengths, capacity)
        wide = max(sum(lengths[i] for i in g) for g in rows)
        weight = 1 if hidden_size is None else 3 * hidden_size + wide
        layouts.append((len(rows) * wide * weight, wide, rows))
    _, width, groups = min(layouts, key=lambda t: t[:2])
    return width, groups


def scatter_labels(values: torch.Tensor, where: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Put per-label ``values [N]`` back into the ``[B, num_labels]`` layout of ``where``."""
    out = values.new_full(where.shape, fill)
    return out.masked_scatter(where, values)
