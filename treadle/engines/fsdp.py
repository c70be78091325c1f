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
- LoRA (a peft model as ``lm``, :func:`treadle.models.apply_lora`): the optimizer holds the
  trainable parameters only (the adapters); :meth:`TrainEngine.full_state` gives merged
  weights (``W + scaling * B @ A``) under the base model's names, so rollout engines need no
  LoRA support; a checkpoint holds the adapters, not the base; the reference is the same
  engine with its adapters disabled (:meth:`TrainEngine.without_adapters`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import re
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
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from treadle.engines.lm_head import (
    full_log_softmax,
    full_vocab_term,
    linear_log_probs,
    linear_token_stats,
)
from treadle.engines.packing import label_positions, pack, scatter_labels
from treadle.models import ADAPTER_DIR, save_adapter, save_hf_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
log = logging.getLogger("treadle")

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
    ``compute_dtype`` when given. With ``sum_pi_squared`` (no gradients) a third output is
    ``Σ_v π(v)²`` of each label position's distribution.
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
        sum_pi_squared: bool = False,
        *,
        full_vocab: bool = False,
        other: torch.Tensor | None = None,
        pair_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> Any:
        """``(logp, entropy)`` ``[B, num_labels]``; with ``sum_pi_squared`` (no gradients):
        also ``Σ_v π(v)²``; with ``full_vocab``: the whole
        log-softmax ``[N, V]`` at the selected labels, in row-major order of the selection;
        with ``pair_fn``: also ``pair_fn(log-softmax, other)`` per label (``other``: another
        model's ``full_vocab`` output on the same batch), e.g. the exact KL."""
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
        if sum_pi_squared:  # no gradients: the old policy's pass
            stats = linear_token_stats(
                hidden, weight, labels, temperature, self.chunk_size, self.compute_dtype
            )
            return tuple(scatter_labels(x, where) for x in stats)
        if full_vocab:
            return full_log_softmax(
                hidden, weight, temperature, self.chunk_size, self.compute_dtype
            )
        if len(labels):
            logp, ent = linear_log_probs(
                hidden, weight, labels, temperature, self.chunk_size, self.compute_dtype
            )
        else:
            # No selected label (every response masked out): still a result on the autograd
            # graph through the decoder and the head, so backward (and FSDP's gradient
            # reduction, which every rank must join) runs as for any micro-batch.
            logp = ent = (hidden @ weight[:1].t()).sum(-1).float()
        if pair_fn is None:
            return scatter_labels(logp, where), scatter_labels(ent, where)
        assert other is not None, "pair_fn needs the other model's full_vocab output"
        term = (
            full_vocab_term(
                hidden, weight, other, pair_fn, temperature, self.chunk_size, self.compute_dtype
            )
            if len(labels)
            else logp
        )
        return scatter_labels(logp, where), scatter_labels(ent, where), scatter_labels(term, where)


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


def full_tensors(
    module: nn.Module, prefix: str = "lm.", only: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) one parameter/buffer at a time; all ranks must iterate.

    ``only``: the names (before removing ``prefix``) to yield; the others are not gathered."""
    for name, tensor in module.state_dict().items():
        if only is not None and not only(name):
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        yield name.removeprefix(prefix), full.detach()


PEFT_PREFIX = "base_model.model."  # what peft puts before the wrapped model's names


def is_lora(lm: Any) -> bool:
    """Whether ``lm`` is a peft model (LoRA adapters on a base model)."""
    return hasattr(lm, "peft_config") and hasattr(lm, "disable_adapter")


def lora_scalings(lm: Any) -> dict[str, float]:
    """Each LoRA layer's ``scaling`` (alpha / rank), by its module name without peft's prefix."""
    return {
        name.removeprefix(PEFT_PREFIX): float(m.scaling["default"])
        for name, m in lm.named_modules()
        if isinstance(getattr(m, "scaling", None), dict) and "default" in m.scaling
    }


def merged_lora(
    state: Iterator[tuple[str, torch.Tensor]], scalings: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft model's full tensors as the base model's: ``W + scaling * B @ A`` under ``W``'s
    name (``...q_proj.weight``), other tensors renamed only. Holds one layer's W, A, B at most."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for peft_name, tensor in state:
        name = peft_name.removeprefix(PEFT_PREFIX)
        module, _, part = name.rpartition(".")
        if module.endswith((".lora_A.default", ".lora_B.default")):
            layer, which = module[: -len(".lora_A.default")], module[-len("A.default")]
        elif module.endswith(".base_layer") and part == "weight":
            layer, which = module.removesuffix(".base_layer"), "W"
        else:  # a base layer's bias, or a layer without adapters
            yield name.replace(".base_layer.", "."), tensor
            continue
        got = pending.setdefault(layer, {})
        got[which] = tensor
        if len(got) == 3:
            del pending[layer]
            w, a, b = got["W"], got["A"], got["B"]
            delta = (b.float() @ a.float()) * scalings[layer]
            yield f"{layer}.weight", (w.float() + delta).to(w.dtype)


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


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
        self.lora = is_lora(lm)
        self.adapters_off = False  # set on the reference view of a LoRA actor
        self.grad_clip = grad_clip
        self.params: list[nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if not trainable:
            self.module.requires_grad_(False)
            self.module.eval()
            return
        self.module.train()  # from_pretrained gives eval mode; checkpointing needs training mode
        # Only what trains (with LoRA: the adapters) gets optimizer state.
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, betas=betas, weight_decay=weight_decay
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
        off = self.module.lm.disable_adapter() if self.adapters_off else contextlib.nullcontext()
        with off:
            return self.module(input_ids, attention_mask, num_labels, temperature, label_mask)

    @torch.no_grad()
    def token_stats(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_labels: int,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`log_probs` (without gradients) plus ``Σ_v π(v)²`` of each label position."""
        off = self.module.lm.disable_adapter() if self.adapters_off else contextlib.nullcontext()
        with off:
            logp, ent, squares = self.module(
                input_ids, attention_mask, num_labels, temperature, None, sum_pi_squared=True
            )
        return logp, ent, squares

    def full_log_softmax(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_labels: int,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """The whole log-softmax ``[N, V]`` at the valid labels (no gradient): the input of
        :meth:`log_probs_with` for another engine on the same batch."""
        off = self.module.lm.disable_adapter() if self.adapters_off else contextlib.nullcontext()
        with off, torch.no_grad():
            out: torch.Tensor = self.module(
                input_ids, attention_mask, num_labels, temperature, full_vocab=True
            )
        return out

    def log_probs_with(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_labels: int,
        temperature: float,
        other: torch.Tensor,
        pair_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`log_probs` plus ``pair_fn(this model's log-softmax, other)`` per label
        ``[B, num_labels]`` (0 off the valid labels), all differentiable: e.g. the exact KL to
        a reference whose :meth:`full_log_softmax` is ``other``."""
        off = self.module.lm.disable_adapter() if self.adapters_off else contextlib.nullcontext()
        with off:
            out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = self.module(
                input_ids, attention_mask, num_labels, temperature, other=other, pair_fn=pair_fn
            )
        return out

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Eval mode (no dropout, LoRA's included) for a pass without gradients."""
        training = self.module.training
        self.module.eval()
        try:
            yield
        finally:
            self.module.train(training)

    def without_adapters(self) -> TrainEngine:
        """This LoRA engine as its base model (the reference policy): the same module, its
        adapters disabled in :meth:`log_probs`; no second copy of the weights."""
        assert self.lora, "without_adapters needs a LoRA engine"
        view = copy.copy(self)
        view.adapters_off = True
        view.optimizer = view.scheduler = None
        return view

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
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
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
        """The model's full tensors under its HF names (LoRA: merged into the base weights)."""
        if self.lora:
            return merged_lora(full_tensors(self.module), lora_scalings(self.module.lm))
        return full_tensors(self.module)

    # -------------------------------------------------------------- checkpoint

    def save_checkpoint(
        self, out: Path, rank: int, tokenizer: Any, with_optimizer: bool = True
    ) -> None:
        """``out/model`` (an HF folder, written by rank 0; LoRA: ``out/adapter``, the adapters
        only), the optimizer gathered to rank 0 (unless not ``with_optimizer``: then the
        learning-rate schedule alone), this rank's RNG state. Every rank must call it (the
        full tensors are collectives)."""
        out.mkdir(parents=True, exist_ok=True)
        if self.lora:
            adapters = {
                name.replace(".default.", "."): t.cpu().clone()
                for name, t in full_tensors(self.module, only=_is_adapter)
                if rank == 0
            }
            if rank == 0:
                config = self.module.lm.peft_config["default"]
                save_adapter(adapters, config, tokenizer, out / ADAPTER_DIR)
        else:
            state = {name: t.cpu().clone() for name, t in self.full_state() if rank == 0}
            if rank == 0:
                save_hf_folder(state, self.module.lm.config, tokenizer, out / "model")
        if with_optimizer:
            self.save_optimizer(out, rank)
        elif rank == 0:
            assert self.scheduler is not None
            meta = {"scheduler": self.scheduler.state_dict()}
            (out / "optimizer.json").write_text(json.dumps(meta, default=_jsonable))
        save_file({"torch": torch.get_rng_state()}, str(out / f"rng_rank{rank}.safetensors"))
        dist.barrier()

    def load_checkpoint(self, out: Path, rank: int) -> None:
        """Optimizer and RNG of :meth:`save_checkpoint`; the weights were loaded at start
        (LoRA: the base model's; the adapters are loaded here)."""
        if self.lora:
            self.load_adapters(out / ADAPTER_DIR)
        elif (out / ADAPTER_DIR).is_dir():
            from treadle.checkpoint import CheckpointError

            raise CheckpointError(
                f"{out} holds LoRA adapters (adapter/): resume it with the run's "
                "actor.lora.rank, or set trainer.resume=false"
            )
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

    def load_adapters(self, folder: Path) -> None:
        """The adapter weights of a peft folder (:func:`~treadle.models.save_adapter`) into
        this LoRA engine's sharded model; every rank reads the file."""
        from treadle.checkpoint import CheckpointError

        weights = folder / "adapter_model.safetensors"
        if not weights.is_file():
            raise CheckpointError(
                f"{weights} is missing: the checkpoint was written without LoRA; resume it "
                "with actor.lora.rank=0, or set trainer.resume=false"
            )
        saved = load_file(str(weights))
        state_dict: dict[str, Any] = {
            "lm." + re.sub(r"\.(lora_[AB])\.", r".\1.default.", k): v for k, v in saved.items()
        }
        shapes = self.module.state_dict()
        if set(state_dict) != {name for name in shapes if _is_adapter(name)}:
            raise CheckpointError(
                f"{weights} holds other adapters than actor.lora makes (rank or "
                "target_modules changed?): resume with the run's actor.lora, or set "
                "trainer.resume=false"
            )
        for name, value in state_dict.items():
            if tuple(shapes[name].shape) != tuple(value.shape):
                raise CheckpointError(
                    f"{weights}: {name} has shape {tuple(value.shape)}, actor.lora makes "
                    f"{tuple(shapes[name].shape)}: resume with the run's actor.lora.rank"
                )
        set_model_state_dict(
            self.module, state_dict, options=StateDictOptions(full_state_dict=True, strict=False)
        )

    def load_optimizer(self, path: Path) -> None:
        assert self.optimizer is not None and self.scheduler is not None
        meta = json.loads((path / "optimizer.json").read_text())
        if not (path / "optimizer.safetensors").is_file():
            log.warning(
                "%s holds no optimizer state (trainer.save_optimizer=false): the optimizer "
                "starts afresh",
                path,
            )
            self._load_scheduler(meta)
            lrs = self.scheduler.get_last_lr()  # the schedule's, not its first step's
            for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            return
        tensors = load_file(str(path / "optimizer.safetensors"))
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
        self._load_scheduler(meta)
        dist.barrier()

    def _load_scheduler(self, meta: dict[str, Any]) -> None:
        assert self.scheduler is not None
        scheduler_state = meta["scheduler"]
        scheduler_state.pop("lr_lambdas", None)
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **scheduler_state})


def _jsonable(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return str(value)
