"""The training engine: a Hugging Face causal LM sharded with FSDP2, and its optimizer.

What it owns: the sharded model, AdamW, the learning-rate schedule, gradient clipping, the
one forward pass every role needs (the log-prob, and entropy, of given label tokens) and the
one update loop every role runs (:meth:`TrainEngine.train_step`: micro-batches, backward,
summed metrics, one optimizer step).

Choices:
- The HF model is wrapped in a head, which is the FSDP2 root: every decoder layer is its own
  FSDP unit, the root holds embeddings, final norm and LM head (tied or not). The default,
  :class:`~treadle.engines.heads.LogProbHead`, runs the decoder
  (:func:`~treadle.engines.heads.response_hidden`, shared with the value head), keeps only the
  hidden states that predict selected label tokens and computes log-softmax in float32 chunk
  by chunk over those tokens (:mod:`treadle.engines.lm_head`, one fused autograd function,
  each chunk recomputed in backward), so a float32 ``[batch, seq, vocab]`` tensor never
  exists and no head compute is spent on padding. :meth:`TrainEngine.forward` takes its
  :class:`~treadle.engines.heads.LogProbRequest` and returns its
  :class:`~treadle.engines.heads.LogProbOutput`.
- Packed forwards (``row_tokens``): the decoder runs on the valid tokens only, several
  sequences per row with attention kept within each (:mod:`treadle.engines.packing`); with
  ``share_prompts`` the rows that share a prompt have it computed once.
- Mixed precision (``compute_dtype``): decoder layers and the LM head's matrix products
  compute in bfloat16 from float32 parameters; norms, softmax and the optimizer stay float32.
  On CPU, attention that needs gradients computes in float32 (:mod:`treadle.engines.attention`:
  torch's bfloat16 kernel is the slower one there).
- Log-probs are of ``logits / temperature``: the policy that the rollout engine samples from.
- Full (unsharded) tensors are produced one parameter at a time for weight sync and saving
  (:mod:`treadle.engines.full_weights`), so the whole model never sits twice in memory beyond
  one parameter.
- LoRA (a peft model as ``lm``, :func:`treadle.models.loading.apply_lora`): the optimizer holds the
  trainable parameters only (the adapters); :meth:`TrainEngine.full_state` gives merged
  weights (``W + scaling * B @ A``) under the base model's names, so rollout engines need no
  LoRA support; a checkpoint holds the adapters, not the base; the reference is the same
  engine with its adapters disabled (:meth:`TrainEngine.without_adapters`)
  (:mod:`treadle.engines.lora`).
- An engine's checkpoint (:mod:`treadle.engines.checkpoint`): its model as an HF folder, the
  optimizer state as safetensors and JSON (:mod:`treadle.engines.state`), each rank's RNG.
- Tensor and sequence parallelism (:mod:`treadle.engines.parallel`) are applied before FSDP2;
  :meth:`TrainEngine.full_state`, checkpoints and weight sync see full tensors as without them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils._pytree import tree_map_only

from treadle.engines.attention import use_cpu_float32_backward
from treadle.engines.flops import UpdateRate
from treadle.engines.full_weights import Named, model_tensors
from treadle.engines.heads import LogProbHead, LogProbOutput, LogProbRequest
from treadle.engines.lora import is_lora
from treadle.engines.offload import Residence
from treadle.engines.parallel import Meshes, parallelize
from treadle.engines.schedule import LrSchedule
from treadle.models.folders import packing_problem
from treadle.protocol import Batch
from treadle.runtime.errors import ConfigError

logger = logging.getLogger("treadle")


def shard_model(
    lm: Any, root: nn.Module, compute_dtype: torch.dtype | None = None, mesh: Any = None
) -> Any:
    """Apply FSDP2: one unit per decoder layer of ``lm``, ``root`` (a head wrapping it) as root.

    ``compute_dtype`` (e.g. bfloat16): decoder layers compute in it from parameters kept in
    their own dtype (the optimizer's), their inputs cast to it (:func:`cast_inputs`), gradients
    reduced in float32. The root (embeddings, final norm, heads) keeps the parameter dtype;
    :class:`LogProbHead` casts the LM head for its matrix products only, and value heads read
    full-precision weights. ``mesh``: the data-parallel device mesh to shard over (default:
    every rank). ``lm`` may be on the host: each ``fully_shard`` moves its unit's parameters
    and buffers to the mesh's device before it shards them, so the device holds one unit's
    full tensors at a time, never the whole model.
    """
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in lm.get_decoder().layers:
        if compute_dtype is not None:
            layer.register_forward_pre_hook(cast_inputs(compute_dtype), with_kwargs=True)
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=policy if compute_dtype is not None else MixedPrecisionPolicy(),
        )
    fully_shard(root, mesh=mesh)
    return root


def cast_inputs(dtype: torch.dtype) -> Callable[..., Any]:
    """A forward pre-hook that casts a module's floating-point tensor arguments to ``dtype``:
    what FSDP2's ``cast_forward_inputs`` does, again where torch 2.11 skips it, in a layer that
    activation checkpointing re-runs in the backward (its float32 rotary tables then met bf16
    values: "Expected query, key, and value to have the same dtype"; torch 2.13 casts there)."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    def hook(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return tree_map_only(torch.Tensor, cast, (args, kwargs))

    return hook


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for parameters on different device meshes (tensor-parallel layers
    on the 2-D mesh, the rest on the data-parallel one), which torch's cannot stack: each
    mesh's norm is computed and reduced on its own, then combined."""
    groups: dict[Any, list[nn.Parameter]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    norms = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in members if p.grad is not None])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.tensor(0.0)
    for members in groups.values():
        torch.nn.utils.clip_grads_with_norm_(members, max_norm, total)
    return total


def update_ratio(optimizer: torch.optim.Optimizer) -> float:
    """``||Δθ|| / ||θ||`` of the AdamW step just taken, over every parameter it holds (``θ``: the
    weights before the step), from the optimizer's state rather than a copy of the weights.

    torch's AdamW step is ``θ' = θ (1 - c) - u`` with ``c = lr·wd`` and ``u = lr / (1 - β1^t) ·
    m / (√v / √(1 - β2^t) + eps)``, so ``Δθ = -(c θ' + u) / (1 - c)`` and ``θ = (θ' + u) / (1 -
    c)``: both squared norms follow from ``θ'·θ'``, ``θ'·u`` and ``u·u``, summed on the device
    one parameter (one temporary ``u``) at a time, then over the mesh dimensions the parameters
    are sharded on (one all-reduce per mesh, no other synchronisation)."""
    sums: dict[tuple[Any, float], torch.Tensor] = {}  # (shards, c) -> [θ'·θ', θ'·u, u·u]
    for group in optimizer.param_groups:
        lr, eps, c = group["lr"], group["eps"], group["lr"] * group["weight_decay"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or "exp_avg" not in state:
                continue
            t = float(state["step"])
            m, v, new = (_local(x).flatten() for x in (state["exp_avg"], state["exp_avg_sq"], p))
            if lr == 0:  # a schedule's lr of 0 (a warm-up's start, a decay's end): u = 0
                zero = new.new_zeros(())
                dots = torch.stack([new.dot(new), zero, zero]).double()
            else:  # u = m / d, d = (√v / √(1 - β2^t) + eps) (1 - β1^t) / lr: one pass a term
                scale = (1 - beta1**t) / lr
                u = v.sqrt().mul_(scale / math.sqrt(1 - beta2**t)).add_(eps * scale)
                u = torch.div(m, u, out=u)
                dots = torch.stack([new.dot(new), new.dot(u), u.dot(u)]).double()
            key = ((p.device_mesh, p.placements) if isinstance(p, DTensor) else None, c)
            sums[key] = sums[key] + dots if key in sums else dots
    change = weights = 0.0
    for (shards, c), local in sums.items():
        ww, wu, uu = _over_shards(shards, local).tolist()
        change += (c * c * ww + 2 * c * wu + uu) / (1 - c) ** 2
        weights += (ww + 2 * wu + uu) / (1 - c) ** 2
    return math.sqrt(change / weights) if weights > 0 else 0.0


def _local(x: torch.Tensor) -> torch.Tensor:
    return (x.to_local() if isinstance(x, DTensor) else x).detach()


def _over_shards(shards: Any, local: torch.Tensor) -> torch.Tensor:
    """``local`` sums (this rank's) added over the mesh dimensions ``shards`` (a mesh and
    placements; None: not sharded) is sharded on."""
    if shards is None:
        return local
    mesh, placements = shards
    partial = [Partial() if p.is_shard() else Replicate() for p in placements]
    return DTensor.from_local(local, mesh, partial, run_check=False).full_tensor()


def adamw(
    params: list[nn.Parameter],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    schedule: LrSchedule | None,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` and its lr ``schedule`` (default constant)."""
    # fused: one kernel over all the parameters (CPU and CUDA); SmolLM2's step against the
    # default (foreach): 0.40 -> 0.10 s on 2 CPU threads, 17 -> 1.5 ms on an H100
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
    factor = schedule or LrSchedule()
    # LambdaLR counts from 0, the schedule's steps from 1
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: factor(s + 1))


def packed_row_tokens(
    config: Any, row_tokens: int | None, meshes: Meshes | None, section: str
) -> int | None:
    """``row_tokens``, or ``None`` (forwards on the padded batch) for a model whose packed
    sequences would meet (:func:`~treadle.models.folders.packing_problem`). Sequence
    parallel's attention takes each sequence alone, so it keeps its packed rows (the rules
    refuse it where a layer carries a state along the sequence), and needs them."""
    split = meshes is not None and meshes.sp_group is not None
    if split and row_tokens is None:
        raise ConfigError(
            f"{section}.sequence_parallel_size > 1 splits packed rows: set "
            "actor.remove_padding=true"
        )
    unpacked = packing_problem(config)
    if unpacked is None or row_tokens is None or split:
        return row_tokens
    logger.info("%s: forwards run on the padded batch: %s", section, unpacked)
    return None


class TrainEngine:
    """FSDP2 model + AdamW + lr schedule (default constant). ``trainable=False``: a frozen
    reference.

    ``head`` builds the FSDP2 root around the LM (default :class:`LogProbHead`); a value
    model passes its own, called as ``head(lm, row_tokens=row_tokens)``, which must hold the
    LM as ``.lm``. ``row_tokens`` set: forwards run packed, without padding
    (:func:`response_hidden`), with ``share_prompts`` a prompt several rows share computed
    once. ``compute_dtype``: mixed precision (:func:`shard_model`).
    ``offload_params``, ``offload_optimizer``: weights and moments in host memory while they
    wait (:mod:`treadle.engines.offload`; :meth:`offload` says when the weights go).
    ``meshes``: tensor-parallel layers or Ulysses attention
    (:mod:`treadle.engines.parallel`), ``section`` the config section that asked for them.
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
        schedule: LrSchedule | None = None,
        grad_clip: float = 1.0,
        gradient_checkpointing: bool = False,
        row_tokens: int | None = None,
        share_prompts: bool = False,
        compute_dtype: torch.dtype | None = None,
        head: Callable[..., nn.Module] | None = None,
        meshes: Meshes | None = None,
        section: str = "actor",
        defer_gradient_sync: bool = True,
        offload_params: bool = False,
        offload_optimizer: bool = False,
    ) -> None:
        use_cpu_float32_backward()  # bfloat16 attention's backward on CPU (see the module)
        row_tokens = packed_row_tokens(lm.config, row_tokens, meshes, section)
        if gradient_checkpointing and trainable:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # The FSDP2 root: a head around the LM (log-probs by default), now an FSDPModule.
        root: Any = (  # a HeadRoot (sequence_group, share_prompts)
            head(lm, row_tokens=row_tokens)
            if head is not None
            else LogProbHead(lm, chunk_size, row_tokens, compute_dtype)
        )
        root.share_prompts = share_prompts and row_tokens is not None
        # Tensor-parallel layers or Ulysses attention first, then FSDP2 over data-parallel ranks.
        parallelize(lm, meshes, section)
        if meshes is not None and meshes.sp_group is not None:
            root.sequence_group = meshes.sp_group
        self.tensor_parallel = meshes is not None and meshes.tp_mesh is not None
        dp_mesh = meshes.dp_mesh if meshes is not None else None
        self.module: Any = shard_model(lm, root, compute_dtype, dp_mesh)
        self.residence = Residence(self.module, offload_params, offload_optimizer and trainable)
        self.rate = UpdateRate(self.module, section, meshes.layout.group_size if meshes else 1)
        self.lora = is_lora(lm)
        self.adapters_off = False  # set on the reference view of a LoRA actor
        self.grad_clip = grad_clip
        self.defer_gradient_sync = defer_gradient_sync
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
        self.optimizer, self.scheduler = adamw(self.params, lr, betas, weight_decay, schedule)

    @property
    def device(self) -> torch.device:
        """Where the caller put the model, and :meth:`train_step` puts each micro-batch."""
        return self.residence.home

    def offload(self) -> None:
        """The weights to host memory until this engine's next use, with ``offload_params``
        (else nothing): its worker calls it where the engine waits. Not a reference view's (the
        actor's weights: :meth:`without_adapters`)."""
        if not self.adapters_off:
            self.residence.weights_out()

    def loaded(self) -> Any:
        """The FSDP2 module, its weights on the device (brought back if offloaded): for a
        caller that runs it directly (a value model's forward)."""
        self.residence.weights_in()
        return self.module

    def forward(self, request: LogProbRequest) -> LogProbOutput:
        """The head's forward on ``request`` (a reference view of a LoRA engine: with the
        adapters disabled); without gradients when it asks for ``sum_pi_squared`` or the
        full vocabulary."""
        self.residence.weights_in()
        off = self.module.lm.disable_adapter() if self.adapters_off else contextlib.nullcontext()
        grad_free = request.sum_pi_squared or request.full_vocab
        with off, torch.no_grad() if grad_free else contextlib.nullcontext():
            out: LogProbOutput = self.module(request)
        return out

    def log_probs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_labels: int,
        temperature: float = 1.0,
        label_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log-probs, entropy)`` ``[B, num_labels]``: :meth:`forward` of the plain request
        (``pixel_values``: a vision-language model's pictures of the rows)."""
        req = LogProbRequest(input_ids, attention_mask, num_labels, temperature, label_mask)
        if pixel_values is not None:
            req = dataclasses.replace(req, pixel_values=pixel_values)
        out = self.forward(req)
        return out.log_probs, out.entropy

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
        micros: Sequence[Batch],
        loss_fn: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]],
        prefix: str = "",
    ) -> dict[str, float]:
        """One optimizer step over ``micros``: every role's update loop (actor, critic, reward
        model, SFT, DPO) is this one.

        ``loss_fn(micro)`` returns the micro-batch's share of the step's loss (already scaled
        by global counts: the gradients are summed over micro-batches and averaged over
        ranks) and its metrics. Each micro-batch reaches it on this engine's device, whole:
        the one place where the driver's batch (on the CPU, by design) crosses to the device,
        so no loss moves its inputs field by field (verl and torchtitan move theirs at one
        seam too); a micro-batch is moved when its turn comes, so the device holds one.
        Gradients are reduced across ranks after the last micro-batch only, or after each
        unless ``defer_gradient_sync`` (``actor.defer_gradient_sync``). Returns the
        metrics summed over micro-batches plus ``<prefix>grad_norm`` and ``<prefix>lr`` of
        :meth:`step`, and its model FLOP rate (:class:`~treadle.engines.flops.UpdateRate`).
        """
        sums: dict[str, float] = defaultdict(float)
        self.residence.weights_in()
        with self.rate.measure(prefix) as speed:
            for i, micro in enumerate(micros):
                last = i == len(micros) - 1
                self.module.set_requires_gradient_sync(last or not self.defer_gradient_sync)
                loss, metrics = loss_fn(micro.to(self.device))
                loss.backward()
                for k, v in metrics.items():
                    sums[k] += v
            sums.update({prefix + k: v for k, v in self.step().items()})  # (its norm syncs)
        return {**sums, **speed}

    def step(self) -> dict[str, float]:
        """Clip, step, zero. Returns the pre-clip gradient norm, the learning rate and the
        step's size relative to the weights (:func:`update_ratio`). A gradient that is not
        finite, or exactly 0 (a batch with nothing to learn from: every advantage 0 and no KL or
        entropy term), changes nothing: AdamW would otherwise move the weights by its momentum
        and decay alone."""
        assert self.optimizer is not None and self.scheduler is not None
        if self.tensor_parallel:
            norm = clip_grad_norm(self.params, self.grad_clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        lr = self.scheduler.get_last_lr()[0]
        ratio = 0.0  # a step skipped changes nothing
        if math.isfinite(grad_norm) and grad_norm > 0:
            self.residence.moments_in(self.optimizer)
            self.optimizer.step()
            ratio = update_ratio(self.optimizer)
            self.residence.moments_out(self.optimizer)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": float(lr), "update_ratio": ratio}

    def full_state(
        self, dtype: torch.dtype | None = None, as_saved: bool = False
    ) -> Iterator[Named]:
        """:func:`model_tensors` of this engine's model."""
        self.residence.weights_in()
        return model_tensors(self.module, self.lora, dtype, as_saved)
