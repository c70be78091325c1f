"""What every role's worker shares: engine settings, batch layouts, micro-batch planning.

A role module (:mod:`~treadle.workers.actor`, :mod:`~treadle.workers.critic`,
:mod:`~treadle.workers.reward_model`) builds its engines with :func:`engine_options` (and
:func:`value_engine` for value models), lays a batch out as token sequences with
:func:`prompt_response` or :func:`pair_sequences`, cuts it with :func:`micro_batches` (or
:func:`ppo_mini_batches`; :func:`rows_with_gradient` leaves out the rows without a gradient)
and makes its losses global over ranks with :func:`global_sums`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from treadle.algorithms import masked_sum
from treadle.config import ActorConfig, Config
from treadle.data.images import PIXELS
from treadle.engines.packing import (
    first_fit_decreasing,
    prompt_groups,
    prompt_pieces,
    token_micro_batches,
)
from treadle.engines.schedule import LrSchedule
from treadle.engines.value import ValueHead
from treadle.models.loading import load_value_model
from treadle.protocol import Batch, response_attention
from treadle.runtime.precision import compute_bf16

if TYPE_CHECKING:  # imported where an engine is built: the driver does not need FSDP
    from treadle.engines.fsdp import TrainEngine


def engine_options(cfg: Config) -> dict[str, Any]:
    """How every training engine (actor, reference, critic, reward model) runs its forward:
    packed without padding (``actor.remove_padding``), a shared prompt computed once
    (``actor.share_prompts``), in ``actor.mixed_precision``; when its update reduces the
    gradients (``actor.defer_gradient_sync``); what waits in host memory
    (``actor.offload_params``, ``actor.offload_optimizer``)."""
    a = cfg.actor
    return {
        "chunk_size": a.logprob_chunk_size,
        "row_tokens": a.pack_row_tokens if a.remove_padding else None,
        "share_prompts": a.shares_prompts(),
        "compute_dtype": torch.bfloat16 if compute_bf16(a.mixed_precision) else None,
        "defer_gradient_sync": a.defer_gradient_sync,
        "offload_params": a.offload_params,
        "offload_optimizer": a.offload_optimizer,
    }


def actor_optimizer(cfg: Config, optimizer_steps: int) -> dict[str, Any]:
    """The ``actor`` section's optimizer settings (the actor's, and the reward-model trainer's),
    its lr schedule ending at ``optimizer_steps``, the run's count (:func:`ppo_steps`, or one
    per trainer step)."""
    a = cfg.actor
    return {
        "lr": a.lr,
        "betas": a.betas,
        "weight_decay": a.weight_decay,
        "schedule": LrSchedule(a.warmup_steps, a.lr_schedule, a.min_lr_ratio, optimizer_steps),
        "grad_clip": a.grad_clip,
        "gradient_checkpointing": a.gradient_checkpointing,
    }


def ppo_steps(cfg: Config, epochs: int, mini_batch_size: int, world_size: int) -> int:
    """Optimizer steps of one RL update of the nominal batch (``data.batch_size x rollout.n``
    rows, cut into ``world_size`` equal chunks: the data-parallel ranks) by
    :func:`ppo_mini_batches`: ``epochs`` passes in mini-batches of ``mini_batch_size //
    world_size`` rows per rank."""
    rows = cfg.data.batch_size * cfg.rollout.n // world_size
    return epochs * math.ceil(rows / max(mini_batch_size // world_size, 1))


def train_engine(model: nn.Module, **options: Any) -> TrainEngine:
    """``TrainEngine(model, **options)``, FSDP2 imported only here: the driver imports the
    worker classes (to start them as Ray actors) and would pay ~1 s for FSDP's imports."""
    from treadle.engines.fsdp import TrainEngine

    return TrainEngine(model, **options)


def value_engine(cfg: Config, path: str, key: str, trainable: bool, **opt: Any) -> TrainEngine:
    """A value model (critic, reward model) as a training engine; ``opt``: optimizer settings
    (and the engine's ``meshes`` and ``section`` of a parallel layout). The model goes to the
    engine on the host: FSDP2 moves it to the device unit by unit
    (:meth:`~treadle.workers.base.RoleWorker.load_lm` says why)."""
    model: nn.Module = load_value_model(
        path, cfg.model.dtype, key=key, allow_download=cfg.model.allow_download
    )
    return train_engine(model, **engine_options(cfg), trainable=trainable, head=ValueHead, **opt)


def global_sums(*values: float, group: Any = None) -> list[float]:
    """Each value summed over the ranks of ``group`` (default: every rank), in float64. A role
    with tensor- or sequence-parallel groups passes its data-parallel group
    (:class:`~treadle.engines.parallel.Meshes`), where each sample is counted once."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.tolist()


# ----------------------------------------------------------------------------- batch layouts

SEQUENCES = ("prompts", "prompt_mask", "responses", "response_mask")
"""The fields of prompt + response sequences (:func:`prompt_response`), for ``reads=``."""

ATTENTION = ("response_attention_mask", PIXELS)
"""What :func:`prompt_response` (and :func:`pixels`) also read when the batch has it, for
``optional=``."""

SFT_EXAMPLES = ("input_ids", "attention_mask", "loss_mask")
"""The fields of right-padded SFT examples (:func:`~treadle.data.collate_sft`), for ``reads=``."""

PAIRS = ("prompts", "prompt_mask", "chosen", "chosen_mask", "rejected", "rejected_mask")
"""The fields of preference pairs (:func:`pair_sequences`), for ``reads=``."""


def prompt_response(mb: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt then response: token ids and attention mask ``[B, P + R]`` on ``device``."""
    ids = torch.cat([mb["prompts"], mb["responses"]], 1).to(device)
    mask = torch.cat([mb["prompt_mask"], response_attention(mb)], 1).to(device)
    return ids, mask


def pixels(mb: Batch, device: torch.device) -> torch.Tensor | None:
    """A vision-language batch's pictures ``[B, images, 3, H, W]`` on ``device`` (None: text)."""
    return mb[PIXELS].to(device) if PIXELS in mb else None


def pair_sequences(
    mb: Batch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Preference pairs as ``2B`` sequences: every prompt with its chosen, then with its rejected.

    Returns ``(input_ids [2B, P+R], attention_mask, R, response_mask [2B, R])``.
    """
    prompts = torch.cat([mb["prompts"], mb["prompts"]])
    pmask = torch.cat([mb["prompt_mask"], mb["prompt_mask"]])
    responses = torch.cat([mb["chosen"], mb["rejected"]])
    rmask = torch.cat([mb["chosen_mask"], mb["rejected_mask"]])
    ids = torch.cat([prompts, responses], 1).to(device)
    mask = torch.cat([pmask, rmask], 1).to(device)
    return ids, mask, responses.shape[1], rmask


UNPAIRED = (
    "prompts",
    "prompt_mask",
    "completions",
    "completion_mask",
    "kl_completions",
    "kl_completion_mask",
)
"""The fields of unpaired examples with their mismatched KL completions, for ``reads=``."""


# ----------------------------------------------------------------------------- sequence scores


def pair_logps(
    engine: TrainEngine, mb: Batch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence log-probs (summed over response tokens) of chosen and rejected, one forward."""
    ids, mask, width, rmask = pair_sequences(mb, device)
    logp, _ = engine.log_probs(ids, mask, width)  # temperature 1: the model's own policy
    seq = masked_sum(logp, rmask.to(logp.device), dim=-1).float()
    return seq[: len(mb)], seq[len(mb) :]


def unpaired_logps(
    engine: TrainEngine,
    mb: Batch,
    device: torch.device,
    names: tuple[str, ...] = ("completions",),
) -> torch.Tensor:
    """Sequence log-probs of each prompt with the completions of ``names``
    (``kl_completions``: the mismatched ones), one column after the other."""
    prompts = torch.cat([mb["prompts"]] * len(names))
    pmask = torch.cat([mb["prompt_mask"]] * len(names))
    responses = torch.cat([mb[n] for n in names])
    rmask = torch.cat([mb[n.removesuffix("s") + "_mask"] for n in names])
    ids = torch.cat([prompts, responses], 1).to(device)
    mask = torch.cat([pmask, rmask], 1).to(device)
    logp, _ = engine.log_probs(ids, mask, responses.shape[1])
    return masked_sum(logp, rmask.to(logp.device), dim=-1).float()


def per_pair(
    batch: Batch, size: int, score: Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``score`` (chosen, rejected ``[b]``) of every pair, ``size`` pairs a forward, as
    float32 on the CPU."""
    chosen, rejected = [], []
    for mb in batch.split(size):
        c, r = score(mb)
        chosen.append(c.float().cpu())
        rejected.append(r.float().cpu())
    return torch.cat(chosen), torch.cat(rejected)


# ----------------------------------------------------------------------------- batch plans


def micro_batches(
    batch: Batch, actor: ActorConfig, lengths: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Index groups of ``batch``, one per micro-batch, the same count on every rank.

    By ``actor.max_tokens_per_micro_batch`` (``lengths`` = valid tokens per sample;
    default: prompt + response tokens) when set, else ``actor.micro_batch_size`` samples each.

    With shared prompts (``actor.share_prompts``, a batch of prompts and responses) the
    samples of one prompt (:func:`~treadle.engines.packing.prompt_groups`) stay together,
    so that the packed forward computes their prompt once: by samples, the batch is cut in
    the order of its groups; by tokens, a group weighs its prompt once plus its responses
    (:func:`shared_prompt_units`).
    """
    budget = actor.max_tokens_per_micro_batch
    shared = actor.shares_prompts() and "prompts" in batch
    if budget is None:
        order = torch.arange(len(batch))
        if shared:
            groups = prompt_groups(batch["prompts"], batch["prompt_mask"])
            order = torch.tensor([i for g in groups for i in g])
        return list(order.split(actor.micro_batch_size))
    if lengths is None:
        lengths = batch["prompt_mask"].sum(1) + response_attention(batch).sum(1)
    units = [[i] for i in range(len(batch))]
    lens = lengths.tolist()
    tokens = _Tokens(batch) if shared else None
    if tokens is not None:
        units, lens = shared_prompt_units(batch, budget, tokens)
    need = torch.tensor([len(first_fit_decreasing(lens, budget))])
    dist.all_reduce(need, op=dist.ReduceOp.MAX)  # FSDP collectives: same count everywhere
    # another rank needs more micro-batches than this one has units: cut units of a prompt
    while tokens is not None and len(units) < int(need) and any(len(u) > 1 for u in units):
        units, lens = _halve_heaviest(units, lens, tokens)
    groups = token_micro_batches(lens, budget, int(need))
    return [torch.tensor([i for u in g for i in units[u]], dtype=torch.long) for g in groups]


class _Tokens:
    """Valid tokens of a batch's samples of one prompt, counting the prompt once."""

    def __init__(self, batch: Batch) -> None:
        self.prompt = batch["prompt_mask"].sum(1).tolist()
        self.response = response_attention(batch).sum(1).tolist()

    def __call__(self, rows: list[int]) -> int:
        return int(self.prompt[rows[0]] + sum(self.response[i] for i in rows))


def shared_prompt_units(
    batch: Batch, budget: int, tokens: _Tokens | None = None
) -> tuple[list[list[int]], list[int]]:
    """The samples of ``batch`` as units for token-budget micro-batches with shared prompts,
    and each unit's tokens (its prompt once plus its responses): the samples of one prompt,
    cut in consecutive pieces where they would exceed ``budget`` (a sample that alone
    exceeds it is a piece of its own). ``tokens``: the batch's :class:`_Tokens`, if made."""
    tokens = tokens or _Tokens(batch)
    units = [
        piece
        for group in prompt_groups(batch["prompts"], batch["prompt_mask"])
        for piece in prompt_pieces(group, tokens.prompt[group[0]], tokens.response, budget)
    ]
    return units, [tokens(u) for u in units]


def _halve_heaviest(
    units: list[list[int]], lens: list[int], tokens: _Tokens
) -> tuple[list[list[int]], list[int]]:
    """The heaviest unit of several samples cut in two, ``tokens`` weighing the halves."""
    heavy = max((u for u in range(len(units)) if len(units[u]) > 1), key=lambda u: lens[u])
    rows = units[heavy]
    halves = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    rest = [u for k, u in enumerate(units) if k != heavy]
    rest_lens = [n for k, n in enumerate(lens) if k != heavy]
    return rest + halves, rest_lens + [tokens(h) for h in halves]


def rows_with_gradient(batch: Batch) -> torch.Tensor:
    """Indices (in order) of the rows of ``batch`` with a non-zero advantage on a response
    token, topped up with zero-advantage rows to the most any rank has, and at least one:
    every rank must run as many forward and backward passes (FSDP's collectives), and a
    zero-advantage row adds nothing to an advantage-scaled loss (``actor.skip_zero_advantage``)."""
    live = ((batch["advantages"] != 0) & batch["response_mask"].bool()).any(1)
    most = torch.tensor([int(live.sum())])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    filler = (~live).nonzero().flatten()[: max(int(most), 1) - int(live.sum())]
    return torch.cat([live.nonzero().flatten(), filler]).sort().values


def ppo_mini_batches(batch: Batch, epochs: int, size: int) -> Iterator[Batch]:
    """``epochs`` shuffled passes over ``batch`` in mini-batches of ``size`` (one optimizer
    step each); the shuffle is seeded by ``batch.meta["step"]``, so a resumed run repeats it."""
    gen = torch.Generator().manual_seed(int(batch.meta.get("step", 0)))
    for _ in range(epochs):
        shuffled = batch.select(torch.randperm(len(batch), generator=gen))
        yield from shuffled.split(size)


def mean_over_steps(
    step: Callable[[Batch], dict[str, float]], minis: Iterator[Batch]
) -> dict[str, float]:
    """``step`` run on every mini-batch; each metric averaged over the optimizer steps."""
    per_step = [step(mb) for mb in minis]
    return {k: sum(m[k] for m in per_step) / len(per_step) for k in per_step[0]}
