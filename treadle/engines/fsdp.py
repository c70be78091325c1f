"""The training engine: a Hugging Face causal LM sharded with FSDP2, and its optimizer.

What it owns: the sharded model, AdamW, the learning-rate schedule, gradient clipping, the
one forward pass every role needs (the log-prob, and entropy, of given label tokens) and the
one update loop every role runs (:meth:`TrainEngine.train_step`: micro-batches, backward,
summed metrics, one optimizer step).

Choices:
- The HF model is wrapped in :class:`LogProbHead`, which is the FSDP2 root: every decoder
  layer is its own FSDP unit, the root holds embeddings, final norm and LM head (tied or not).
  Its forward runs the decoder (:func:`response_hidden`, shared with the value head), keeps
  only the hidden states that predict selected label tokens and computes log-softmax in
  float32 chunk by chunk over those tokens (:mod:`treadle.engines.lm_head`, one fused
  autograd function, each chunk recomputed in backward), so a float32 ``[batch, seq, vocab]``
  tensor never exists and no head compute is spent on padding.
- Packed forwards (``row_tokens``): the decoder runs on the valid tokens only, several
  sequences per row with attention kept within each (:mod:`treadle.engines.packing`).
- Mixed precision (``compute_dtype``): decoder layers and the LM head's matrix products
  compute in bfloat16 from float32 parameters; norms, softmax and the optimizer stay float32.
- Log-probs are of ``logits / temperature``: the policy that the rollout engine samples from.
- Full (unsharded) tensors are produced one parameter at a time for weight sync and saving,
  so the whole model never sits twice in memory beyond one parameter.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from treadle.engines.lm_head import linear_log_probs
from treadle.engines.packing import label_positions, pack, scatter_labels
from treadle.models import save_hf_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

M = TypeVar("M")  # a micro-batch, whatever the role's loss function takes


def response_hidden(
    lm: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_labels: int,
    *,
    label_mask: torch.Tensor | None = None,
    row_tokens: int | None = None,
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
    Both give the same states (within float rounding).
    """
    where = label_positions(attention_mask, num_labels, label_mask)
    decoder = lm.get_decoder()
    if row_tokens is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        return hidden[:, -num_labels - 1 : -1][where], where
    layout = pack(input_ids, attention_mask, where, row_tokens)
    # No attention mask and no cache: transformers then builds the block-diagonal causal mask
    # from the position ids (with a cache it silently attends across the whole row).
    hidden = decoder(
        input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False
    ).last_hidden_state
    return hidden.flatten(0, 1)[layout.gather], where


class LogProbHead(nn.Module):
    """The FSDP2 root: causal LM -> log-probs (and entropy) of the last ``num_labels`` tokens.

    Outputs are ``[B, num_labels]`` float32, 0 where a label is not selected (padding, or
    outside ``label_mask``): the LM head runs on selected positions only, ``chunk_size`` label
    tokens at a time (:func:`~treadle.engines.lm_head.linear_log_probs`), its matrix products in
    ``compute_dtype`` when given.
    """

    def __init__(
        self,
        lm: nn.Module,
        chunk_size: int = 512,
        row_tokens: int | None = None,
        compute_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.lm: Any = lm  # a transformers PreTrainedModel
        self.chunk_size = chunk_size
        self.row_tokens = row_tokens
        self.compute_dtype = compute_dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_labels: int,
        temperature: float = 1.0,
        label_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, where = response_hidden(
            self.lm,
            input_ids,
            attention_mask,
            num_labels,
            label_mask=label_mask,
            row_tokens=self.row_tokens,
        )
        labels = input_ids[:, -num_labels:][where]
        weight = self.lm.get_output_embeddings().weight
        if len(labels):
            logp, ent = linear_log_probs(
                hidden, weight, labels, temperature, self.chunk_size, self.compute_dtype
            )
        else:
            # No selected label (every response masked out): still a result on the autograd
            # graph through the decoder and the head, so backward (and FSDP's gradient
            # reduction, which every rank must join) runs as for any micro-batch.
            logp = ent = (hidden @ weight[:1].t()).sum(-1).float()
        return scatter_labels(logp, where), scatter_labels(ent, where)


def shard_model(lm: Any, root: nn.Module, compute_dtype: torch.dtype | None = None) -> Any:
    """Apply FSDP2: one unit per decoder layer of ``lm``, ``root`` (a head wrapping it) as root.

    ``compute_dtype`` (e.g. bfloat16): decoder layers compute in it from parameters kept in
    their own dtype (the optimizer's), gradients reduced in float32. The root (embeddings,
    final norm, heads) keeps the parameter dtype; :class:`LogProbHead` casts the LM head for
    its matrix products only, and value heads read full-precision weights.
    """
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in lm.get_decoder().layers:
        fully_shard(
            layer, mp_policy=policy if compute_dtype is not None else MixedPrecisionPolicy()
        )
    fully_shard(root)
    return root


def full_tensors(module: nn.Module, prefix: str = "lm.") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) one parameter/buffer at a time; all ranks must iterate."""
    for name, tensor in module.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        yield name.removeprefix(prefix), full.detach()


class TrainEngine:
    """FSDP2 model + AdamW + warm-up schedule. ``trainable=False`` gives a frozen reference.

    ``head`` builds the FSDP2 root around the LM (default :class:`LogProbHead`); a value
    model passes its own, called as ``head(lm, row_tokens=row_tokens)``, which must hold the
    LM as ``.lm``. ``row_tokens`` set: forwards run packed, without padding
    (:func:`response_hidden`). ``compute_dtype``: mixed precision (:func:`shard_model`).
    """

    def __init__(
        self,
        lm: Any,
        *,
        chunk_size: int,
        trainable: bool = True,
        lr: float = 1e-5,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        grad_clip: float = 1.0,
        gradient_checkpointing: bool = False,
        row_tokens: int | None = None,
        compute_dtype: torch.dtype | None = None,
        head: Callable[..., nn.Module] | None = None,
    ) -> None:
        if gradient_checkpointing and trainable:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # The FSDP2 root: a head around the LM (log-probs by default), now an FSDPModule.
        root = (
            head(lm, row_tokens=row_tokens)
            if head is not None
            else LogProbHead(lm, chunk_size, row_tokens, compute_dtype)
        )
        self.module: Any = shard_model(lm, root, compute_dtype)
        self.grad_clip = grad_clip
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if not trainable:
            self.module.requires_grad_(False)
            self.module.eval()
            return
        self.module.train()  # from_pretrained gives eval mode; checkpointing needs training mode
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=lr, betas=betas, weight_decay=weight_decay
        )
        warm = max(warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0
        )

    def log_probs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_labels: int,
        temperature: float = 1.0,
        label_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module(input_ids, attention_mask, num_labels, temperature, label_mask)

    def train_step(
        self,
        micros: Sequence[M],
        loss_fn: Callable[[M], tuple[torch.Tensor, dict[str, float]]],
        prefix: str = "",
    ) -> dict[str, float]:
        """One optimizer step over ``micros``: every role's update loop (actor, critic, reward
        model, SFT, DPO) is this one.

        ``loss_fn(micro)`` returns the micro-batch's share of the step's loss (already scaled
        by global counts: the gradients are summed over micro-batches and averaged over
        ranks) and its metrics. Gradients are reduced across ranks after the last micro-batch
        only. Returns the metrics summed over micro-batches plus ``<prefix>grad_norm`` and
        ``<prefix>lr`` of :meth:`step`.
        """
        sums: dict[str, float] = defaultdict(float)
        for i, micro in enumerate(micros):
            self.module.set_requires_gradient_sync(i == len(micros) - 1)
            loss, metrics = loss_fn(micro)
            loss.backward()
            for k, v in metrics.items():
                sums[k] += v
        return {**sums, **{prefix + k: v for k, v in self.step().items()}}

    def step(self) -> dict[str, float]:
        """Clip, step, zero. Returns the pre-clip gradient norm and the learning rate."""
        assert self.optimizer is not None and self.scheduler is not None
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        lr = self.scheduler.get_last_lr()[0]
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": float(lr)}

    def full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        return full_tensors(self.module)

    # -------------------------------------------------------------- checkpoint

    def save_checkpoint(
        self, out: Path, rank: int, tokenizer: Any, with_optimizer: bool = True
    ) -> None:
        """``out/model`` (an HF folder, written by rank 0), the optimizer gathered to rank 0,
        this rank's RNG state. Every rank must call it (the full tensors are collectives)."""
        out.mkdir(parents=True, exist_ok=True)
        state = {name: t.cpu().clone() for name, t in self.full_state() if rank == 0}
        if rank == 0:
            save_hf_folder(state, self.module.lm.config, tokenizer, out / "model")
        if with_optimizer:
            self.save_optimizer(out, rank)
        save_file({"torch": torch.get_rng_state()}, str(out / f"rng_rank{rank}.safetensors"))
        dist.barrier()

    def load_checkpoint(self, out: Path, rank: int) -> None:
        """Optimizer and RNG of :meth:`save_checkpoint`; the weights were loaded at start."""
        self.load_optimizer(out)
        rng = out / f"rng_rank{rank}.safetensors"
        if not rng.is_file():
            from treadle.checkpoint import CheckpointError

            raise CheckpointError(
                f"{rng} is missing: the checkpoint was saved by fewer ranks, or damaged; "
                "resume with the same actor.world_size, or set trainer.resume=false"
            )
        torch.set_rng_state(load_file(str(rng))["torch"])

    def save_optimizer(self, path: Path, rank: int) -> None:
        """Gather the optimizer state to rank 0 and write it as safetensors + JSON (no pickle)."""
        assert self.optimizer is not None and self.scheduler is not None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        osd: Any = get_optimizer_state_dict(self.module, self.optimizer, options=options)
        if rank != 0:
            return
        tensors = {
            f"{fqn}::{key}": value.contiguous()
            for fqn, state in osd["state"].items()
            for key, value in state.items()
        }
        groups = [{k: v for k, v in g.items()} for g in osd["param_groups"]]
        save_file(tensors, str(path / "optimizer.safetensors"))
        meta = {"param_groups": groups, "scheduler": self.scheduler.state_dict()}
        (path / "optimizer.json").write_text(json.dumps(meta, default=_jsonable))

    def load_optimizer(self, path: Path) -> None:
        assert self.optimizer is not None and self.scheduler is not None
        tensors = load_file(str(path / "optimizer.safetensors"))
        meta = json.loads((path / "optimizer.json").read_text())
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            fqn, _, name = key.rpartition("::")
            state.setdefault(fqn, {})[name] = value
        for group in meta["param_groups"]:
            if isinstance(group.get("betas"), list):
                group["betas"] = tuple(group["betas"])
        osd = {"state": state, "param_groups": meta["param_groups"]}
        set_optimizer_state_dict(
            self.module, self.optimizer, osd, options=StateDictOptions(full_state_dict=True)
        )
        scheduler_state = meta["scheduler"]
        scheduler_state.pop("lr_lambdas", None)
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **scheduler_state})
        dist.barrier()


def _jsonable(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return str(value)
