"""The rollout engine interface and the transformers-based engine.

A rollout engine turns prompt token ids into sampled responses with the log-prob of every
sampled token, and takes new weights from the training engine after each update. Every
engine (transformers here, vLLM beside it) implements :class:`RolloutEngine`; the rollout
server (:mod:`treadle.serving.server`) knows only this interface. Two ways in:

- request by request: ``add_request``, then ``step`` until every request has come back from
  one (:class:`Finished`). vLLM batches whatever is in flight itself (continuous batching);
  the transformers engine generates everything added since its last step in one batched
  ``generate`` call (requests with equal sampling parameters together, seeded by the first
  one's ``seed``).
- a whole batch in one call: ``generate`` (the in-process baseline of ``bench/rollout.py``).

Besides sampling, an engine **scores** given token sequences (``score``: the frozen teacher of
``treadle distill``): for every position ``i >= start`` the log-prob of ``tokens[i]`` given
``tokens[:i]`` and the ``top_k`` most likely ids there, from the raw logits at temperature 1,
log-softmax in float32 (what the training engine computes), whatever sampling options the
engine's rollouts use. The transformers engine runs one forward per ``micro_batch_size``
sequences (right-padded, longest first; only the logits from the first scored position on,
turned into float32 one sequence at a time). Scoring is safe between ``step`` calls with
generation requests in flight: the transformers engine does not touch them; vLLM's engine
(:mod:`treadle.engines.vllm`) scores through its own request queue and keeps what the
in-flight requests produce meanwhile for the next ``step``.

The transformers engine is the debugging engine, the fallback and, on a GPU without vLLM, the
rollout: plain ``generate`` with a KV cache on a left-padded batch. ``cache="static"``
(``rollout.cache_implementation``, TRL's setting of that name) preallocates the cache for the
prompt width, rounded up to a multiple of :data:`STATIC_WIDTH`, plus ``max_new_tokens``; on a
GPU transformers then compiles the decoding step (``torch.compile``, CUDA graphs), again for
each new batch size or cache length, which the rounding keeps few. ``cache="paged"`` hands the
batch to transformers' continuous batching on its paged cache: sequences are scheduled one by
one, and a finished one's pages go to a waiting one (:mod:`treadle.engines.paged`).
With flash attention (flash-attn installed) transformers runs it on varlen kernels and CUDA
graphs; without, on sdpa with a mask over every sequence in flight (a decoding step attends
from each of B sequences to all B sequences' tokens: B times the work), no graphs.
Log-probs are taken from the raw logits divided by the temperature (the policy the actor
trains), not from the top-p/top-k-filtered scores (except on the paged cache: there, as
vLLM's, they are the filtered ones'). A token is drawn by the Gumbel-max trick
(:class:`~treadle.engines.sampling.GumbelSample`, the last processor: ``generate`` then takes
the argmax), the law of ``generate``'s own softmax and multinomial at less cost on a CPU.
``SamplingParams.ignore_eos`` means what vLLM's option of that name means: EOS does not end a
response (every response runs to ``max_new_tokens``, for benchmarks); stop tokens still do.
``SamplingParams.top_logprobs = k`` also returns, per sampled token, the k most likely ids of
that position and their log-probs, from the same distribution (the OpenAI endpoint's
``top_logprobs``); an engine that does not give them returns empty lists.

Memory follows the work, not the tokens generated. A decoding step's full-vocabulary scores live
only until the next step: :class:`~treadle.engines.sampling.SampledLogProbs`, the first of the
logits processors, keeps that step's log-softmax until the next step shows which token was
sampled and keeps the ``[B]`` log-probs of it (``generate``'s ``output_logits`` kept every
step's ``[B, V]`` and a float32 copy of them all: 139 GB on an H200 for 256 sequences of 256
tokens at a vocabulary of 49,152). A batch is generated in chunks: at most ``micro_batch_size``
sequences a ``generate`` call and, on CUDA, as many as the KV cache, the per-step scores and the
prompt's forward of each (:func:`~treadle.engines.generation_memory.sequence_bytes`) fit in the
memory ``gpu_memory_utilization`` leaves
(:func:`~treadle.engines.generation_memory.generation_budget`: that fraction of the device's
memory, less what this process's tensors hold already, the actor's weights and optimizer among
them when colocated, and never more than is free). On CPU, ``micro_batch_size`` alone sets the
chunks.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from safetensors.torch import load as load_safetensors_bytes
from torch import nn

from treadle.data.images import stack_pixels
from treadle.engines.generation_memory import chunk_size, generation_budget, sequence_bytes
from treadle.engines.offload import HostCopy
from treadle.engines.paged import generate_paged
from treadle.engines.sampling import NEUTRAL, processors


def stop_token_ids(
    eos_token_id: int | None, generation_config: Any, end_of_turn: int | None = None
) -> list[int]:
    """What ends a response: the tokenizer's EOS, then the ids of the model's generation
    config's ``eos_token_id`` (one or a list: Gemma's ``<end_of_turn>``, Phi-3's ``<|end|>``,
    Llama 3.1's ``<|eom_id|>``, none of them its tokenizer's EOS), where vLLM
    (``SamplingParams.update_from_generation_config``) and transformers' ``generate`` stop,
    then ``end_of_turn``, the token the chat template closes a turn with (ChatML's
    ``<|im_end|>`` on a base model whose EOS and generation config say ``<|endoftext|>``)."""
    more = getattr(generation_config, "eos_token_id", None)
    ids = [eos_token_id, *(more if isinstance(more, list) else [more]), end_of_turn]
    return list(dict.fromkeys(i for i in ids if i is not None))


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 32
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # run every response to max_new_tokens (stop_token_ids still stop)
    top_logprobs: int = 0  # also the k most likely ids per sampled position, with log-probs


@dataclass
class RolloutOutput:
    """Per sequence (prompt-major, n consecutive samples per prompt)."""

    token_ids: list[list[int]] = field(default_factory=list)
    log_probs: list[list[float]] = field(default_factory=list)
    stop_reasons: list[str] = field(default_factory=list)  # "stop" (EOS/stop token) | "length"
    top_ids: list[list[list[int]]] = field(default_factory=list)  # params.top_logprobs > 0
    top_log_probs: list[list[list[float]]] = field(default_factory=list)

    def add(self, tokens: list[int], log_probs: list[float], stops: list[int]) -> int:
        """One generated sequence, cut after its first token of ``stops`` (``"stop"``) or
        whole (``"length"``); returns the length kept."""
        end = next((i + 1 for i, t in enumerate(tokens) if t in stops), None)
        length = end if end is not None else len(tokens)
        self.token_ids.append(tokens[:length])
        self.log_probs.append(log_probs[:length])
        self.stop_reasons.append("stop" if end is not None else "length")
        return length


@dataclass(frozen=True)
class Finished:
    """One finished request of :meth:`RolloutEngine.step`."""

    request_id: str
    token_ids: list[int]
    log_probs: list[float]
    stop_reason: str  # "stop" | "length"
    # per token the top_logprobs most likely ids and their log-probs (empty: not asked for)
    top_ids: list[list[int]] = field(default_factory=list)
    top_log_probs: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class Scored:
    """What :meth:`RolloutEngine.score` computed for one sequence, positions ``start..L-1``."""

    log_probs: list[float]  # log p(tokens[i] | tokens[:i]), temperature 1, float32 math
    topk_ids: list[list[int]]  # per position the top_k most likely ids, most likely first
    topk_log_probs: list[list[float]]  # their log-probs ([] per position when top_k == 0)


def check_one_sample(params: SamplingParams) -> None:
    """ValueError unless ``params`` asks for one response: ``add_request`` queues one sample,
    which ``step`` returns as one :class:`Finished` under its request id (a group of ``n`` is
    ``n`` requests)."""
    if params.n != 1:
        raise ValueError(f"a request samples one response, got n={params.n}")


def check_score_args(sequences: list[list[int]], starts: list[int], top_k: int) -> None:
    """ValueError unless every start is within its sequence (>= 1: the first token has no
    log-prob) and ``top_k >= 0``."""
    if len(sequences) != len(starts):
        raise ValueError(f"score: {len(sequences)} sequences but {len(starts)} starts")
    if top_k < 0:
        raise ValueError(f"score: top_k must be >= 0, got {top_k}")
    for i, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
        if not 1 <= start <= len(seq):
            raise ValueError(
                f"score: sequence {i} has {len(seq)} tokens and start {start}; a start is "
                "1..len (the first token has no log-prob)"
            )


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput: ...

    def score(self, sequences: list[list[int]], starts: list[int], top_k: int) -> list[Scored]:
        """Per sequence, the log-probs of its tokens from ``start`` on and the ``top_k`` most
        likely ids of each of those positions (see the module docstring)."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        pixel_values: torch.Tensor | None = None,
    ) -> None:
        """Queue one sample of ``prompt``; ``pixel_values`` ``[images, 3, H, W]``: the pictures
        of a vision-language model's prompt (its image tokens already in ``prompt``)."""
        ...

    def step(self) -> list[Finished]: ...

    def abort(self, request_id: str) -> tuple[list[int], list[float]]:
        """Stop a request in flight; the tokens (and their log-probs) it has so far."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def load_payloads(self, payloads: Iterable[bytes]) -> None:
        """Weights as safetensors buckets (:func:`treadle.engines.weights.weight_buckets`)."""
        ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


STATIC_WIDTH = 64  # a static cache's prompt width is a multiple of it (fewer shapes to compile)

Cache = Literal["dynamic", "static", "paged"]


class HFRolloutEngine:
    """Batched sampling with transformers ``generate`` on a private copy of the weights.

    ``micro_batch_size``: sequences a ``generate`` call takes at most; ``gpu_memory_utilization``
    (CUDA): the fraction of the device's memory the process may hold while generating, which
    may make the chunks smaller; ``cache``: ``generate``'s KV cache (see the module
    docstring); ``sleep_to_host``: whether :meth:`sleep` moves the weights to host memory
    (:class:`~treadle.engines.offload.HostCopy`; None: on CUDA, but not with a static cache,
    whose compiled decoding step's CUDA graphs hold the weights' addresses)."""

    def __init__(
        self,
        model: nn.Module,
        eos_token_ids: list[int],
        pad_token_id: int,
        micro_batch_size: int = 64,
        gpu_memory_utilization: float = 0.5,
        cache: Cache = "dynamic",
        sleep_to_host: bool | None = None,
    ) -> None:
        self.model: Any = model.eval()  # a transformers model with .generate
        self.eos = list(eos_token_ids)
        self.pad = pad_token_id
        self.micro_batch_size = micro_batch_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.cache = cache
        # parameters and the buffers a checkpoint holds (DeepSeek V3's router bias), which a
        # weight sync sends too
        self.params = self.model.state_dict(keep_vars=True)
        if sleep_to_host is None:
            sleep_to_host = cache != "static" and next(model.parameters()).device.type == "cuda"
        self.host = HostCopy(self.params.values()) if sleep_to_host else None
        self._pending: list[tuple[str, list[int], SamplingParams, torch.Tensor | None]] = []

    def chunk(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """Sequences of ``prompts`` one ``generate`` call takes (see :func:`chunk_size`)."""
        param = next(self.model.parameters())
        longest = self._width(prompts)
        per = sequence_bytes(self.model.config, param.dtype, longest, params.max_new_tokens)
        budget = generation_budget(param.device, self.gpu_memory_utilization)
        return chunk_size(budget, per, self.micro_batch_size)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        pixel_values: list[torch.Tensor | None] | None = None,
    ) -> RolloutOutput:
        """``params.n`` samples of each prompt; ``pixel_values``: each prompt's pictures
        ``[images, 3, H, W]`` (None: a text prompt) for a vision-language model."""
        expanded = [p for p in prompts for _ in range(params.n)]
        pictures = [x for x in pixel_values or [None] * len(prompts) for _ in range(params.n)]
        out = RolloutOutput()
        # what ends a response (ignore_eos: its stop tokens alone)
        stops = ([] if params.ignore_eos else self.eos) + list(params.stop_token_ids)
        if self.cache == "paged":
            if any(x is not None for x in pictures):
                raise ValueError(
                    "rollout.cache_implementation=paged generates from text prompts only; a "
                    "vision-language model's pictures need dynamic or static"
                )
            for tokens, logps in generate_paged(
                self.model,
                expanded,
                params,
                stops,
                self.pad,
                self.micro_batch_size,
                self.gpu_memory_utilization,
            ):
                out.add(tokens, logps, stops)
            return out
        torch.manual_seed(params.seed)
        size = self.chunk(expanded, params)
        for start in range(0, len(expanded), size):
            end = start + size
            self._generate_chunk(expanded[start:end], params, stops, out, pictures[start:end])
        return out

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stops: list[int],
        out: RolloutOutput,
        pictures: list[torch.Tensor | None],
    ) -> None:
        device = next(self.model.parameters()).device
        width = self._width(prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        stacked = stack_pixels(pictures)  # zero pictures pad a row; Idefics3 drops them
        images = {} if stacked is None else {"pixel_values": stacked.to(device)}
        record, chain = processors(
            params.temperature, params.top_k, params.top_p, params.top_logprobs
        )
        gen = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=params.max_new_tokens,
            eos_token_id=stops or None,  # None: no stopping, not the model's default EOS
            pad_token_id=self.pad,
            logits_processor=chain,
            **({"cache_implementation": "static"} if self.cache == "static" else {}),
            **NEUTRAL,
            **images,
        )
        sequences = gen if isinstance(gen, torch.Tensor) else gen.sequences
        logps = record.finish(sequences).cpu()
        top = record.top()
        seqs = sequences[:, width:].cpu()
        for k, (row, lp) in enumerate(zip(seqs.tolist(), logps.tolist(), strict=True)):
            length = out.add(row, lp, stops)
            if top is not None:
                out.top_log_probs.append(top[0][k, :length].tolist())
                out.top_ids.append(top[1][k, :length].tolist())

    def _width(self, prompts: list[list[int]]) -> int:
        """The left-padded batch's width: its longest prompt, rounded up to a multiple of
        :data:`STATIC_WIDTH` for a static cache."""
        longest = max((len(p) for p in prompts), default=1)
        if self.cache == "static":
            return -(-longest // STATIC_WIDTH) * STATIC_WIDTH
        return longest

    @torch.no_grad()
    def score(self, sequences: list[list[int]], starts: list[int], top_k: int) -> list[Scored]:
        """See :meth:`RolloutEngine.score`: ``micro_batch_size`` sequences a forward."""
        check_score_args(sequences, starts, top_k)
        out: list[Scored | None] = [None] * len(sequences)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))  # less padding
        for k in range(0, len(order), self.micro_batch_size):
            chunk = order[k : k + self.micro_batch_size]
            for i, scored in zip(
                chunk, self._score_chunk(sequences, starts, chunk, top_k), strict=True
            ):
                out[i] = scored
        return [s for s in out if s is not None]

    def _score_chunk(
        self, sequences: list[list[int]], starts: list[int], chunk: list[int], top_k: int
    ) -> list[Scored]:
        device = next(self.model.parameters()).device
        width = max(len(sequences[i]) for i in chunk)
        ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(chunk):  # right padding: positions count from 0 in every row
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
            mask[row, : len(sequences[i])] = 1
        first = min(starts[i] for i in chunk) - 1  # the first position whose logits are used
        kwargs = {"logits_to_keep": width - first} if _keeps_logits(self.model) else {}
        logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        logits = logits.logits
        offset = width - logits.shape[1]  # kept: positions offset..width-1
        out = []
        for row, i in enumerate(chunk):
            seq, start = sequences[i], starts[i]
            lp = torch.log_softmax(
                logits[row, start - 1 - offset : len(seq) - 1 - offset].float(), -1
            )
            target = torch.tensor(seq[start:], device=lp.device)
            chosen = lp.gather(-1, target[:, None]).squeeze(-1)
            if top_k:
                values, indices = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
                top = (indices.cpu().tolist(), values.cpu().tolist())
            else:
                top = ([[] for _ in seq[start:]], [[] for _ in seq[start:]])
            out.append(Scored(chosen.cpu().tolist(), *top))
        return out

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        pixel_values: torch.Tensor | None = None,
    ) -> None:
        check_one_sample(params)
        self._pending.append((request_id, list(prompt), params, pixel_values))

    def step(self) -> list[Finished]:
        """Generate every request added since the last step; equal parameters together."""
        pending, self._pending = self._pending, []
        Pending = tuple[str, list[int], torch.Tensor | None]
        groups: dict[SamplingParams, tuple[int, list[Pending]]] = {}
        for rid, prompt, params, picture in pending:
            key = dataclasses.replace(params, seed=0)
            groups.setdefault(key, (params.seed, []))[1].append((rid, prompt, picture))
        done = []
        for key, (seed, requests) in groups.items():
            prompts, pictures = [p for _, p, _ in requests], [x for _, _, x in requests]
            out = self.generate(prompts, dataclasses.replace(key, seed=seed), pictures)
            tops = list(zip(out.top_ids, out.top_log_probs, strict=True))
            done += [
                Finished(rid, t, lp, r, *top)
                for (rid, _, _), t, lp, r, top in zip(
                    requests,
                    out.token_ids,
                    out.log_probs,
                    out.stop_reasons,
                    tops or [([], [])] * len(requests),
                    strict=True,
                )
            ]
        return done

    def abort(self, request_id: str) -> tuple[list[int], list[float]]:
        """Drop a request not yet generated (a step generates what it has to the end)."""
        self._pending = [p for p in self._pending if p[0] != request_id]
        return [], []

    def load_payloads(self, payloads: Iterable[bytes]) -> None:
        self.update_weights(
            (name, t) for payload in payloads for name, t in load_safetensors_bytes(payload).items()
        )

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights (and saved buffers) in place. Tied parameters share storage, so one
        copy serves both."""
        for name, tensor in named_tensors:
            param = self.params.get(name)
            if param is None:
                if name.endswith("lm_head.weight"):  # tied head: not a separate parameter here
                    continue
                raise KeyError(f"rollout engine has no parameter named {name!r}")
            if param.shape != tensor.shape:  # (copy_ would broadcast it in silence)
                raise ValueError(
                    f"weight {name!r} of shape {tuple(tensor.shape)} does not fit the rollout "
                    f"engine's {tuple(param.shape)}"
                )
            param.copy_(tensor.to(param.dtype))
        if self.host is not None:
            self.host.changed()

    def sleep(self) -> None:
        """The weights to host memory, with ``sleep_to_host`` (the KV cache is ``generate``'s
        and gone after each call); otherwise nothing (on CPU the memory is the same)."""
        if self.host is not None:
            self.host.sleep()

    def wake(self) -> None:
        """Undo :meth:`sleep`."""
        if self.host is not None:
            self.host.wake()


def _keeps_logits(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes ``logits_to_keep`` (transformers' causal LMs)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters
