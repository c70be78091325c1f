"""How the transformers engine (:mod:`treadle.engines.inference`) draws a token and records
its log-prob: logits processors around ``generate``, which itself decodes greedily
(:data:`NEUTRAL`). :class:`SampledLogProbs` keeps each sampled token's log-prob of the raw
scores over the temperature, one step's full-vocabulary scores at a time; the warpers
(temperature, top-k, top-p) follow in transformers' order; :class:`GumbelSample` draws last."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


class SampledLogProbs(LogitsProcessor):
    """The log-prob of each sampled token, from the raw scores of its step divided by the
    temperature, without keeping a step's full-vocabulary scores past the next step.

    ``generate`` calls it at each step with the sequences so far and the step's raw scores
    (it comes first among the processors): it gathers the previous step's log-softmax at the
    token that step sampled (now the sequences' last) and keeps this step's until the next.
    :meth:`finish` gathers the last step's from the final sequences. With ``top_k`` (the
    request's ``top_logprobs``) it keeps each step's ``top_k`` most likely ids and log-probs
    too, ``[B, top_k]`` a step."""

    def __init__(self, temperature: float, top_k: int = 0) -> None:
        self.temperature, self.top_k = temperature, top_k
        self.steps: list[torch.Tensor] = []  # [B] per decoding step
        self.tops: list[tuple[torch.Tensor, torch.Tensor]] = []  # (values, ids) [B, k] a step
        self._last: torch.Tensor | None = None  # the last step's log-softmax [B, V]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._take(input_ids[:, -1])
        self._last = torch.log_softmax(scores.float() / self.temperature, -1)
        if self.top_k:
            self.tops.append(tuple(self._last.topk(self.top_k, -1)))  # type: ignore[arg-type]
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self._last is not None:
            self.steps.append(self._last.gather(-1, tokens[:, None]).squeeze(-1))
            self._last = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """``[B, steps]``: each step's sampled token's log-prob (``sequences`` ``[B, P + steps]``,
        ``generate``'s output)."""
        self._take(sequences[:, -1])
        if not self.steps:
            return sequences.new_zeros((sequences.shape[0], 0), dtype=torch.float32)
        return torch.stack(self.steps, 1)

    def top(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``([B, steps, k] log-probs, [B, steps, k] ids)`` of the steps' most likely ids, or
        None when ``top_k`` is 0."""
        if not self.top_k or not self.tops:
            return None
        return torch.stack([v for v, _ in self.tops], 1), torch.stack([i for _, i in self.tops], 1)


class GumbelSample(LogitsProcessor):
    """The last processor of a sampled generation: the processed scores (temperature, top-k,
    top-p applied) plus Gumbel noise, ``-log(-log(u))``, whose argmax (``generate``'s greedy
    pick) is a draw from their softmax: the law of ``generate``'s own sampling. On a CPU it
    costs less: ``torch.rand`` takes 6 ms for 32 x 49,152 scores on 2 cores where
    ``torch.multinomial`` (its ``exponential_``) takes 30, and no softmax is taken (a
    generation of SmolLM2's shape, 32 rows x 32 tokens: 7% faster)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        noise = torch.rand_like(scores, dtype=torch.float32)
        return scores.float() - noise.log_().neg_().log_()  # type: ignore[return-value]


def processors(
    temperature: float, top_k: int, top_p: float, top_logprobs: int
) -> tuple[SampledLogProbs, LogitsProcessorList]:
    """The recorder of the sampled tokens' log-probs first, then temperature, top-k and top-p
    in transformers' order, then the draw (:class:`GumbelSample`); ``generate`` itself is
    given neutral values (:data:`NEUTRAL`) and adds none. ``temperature`` 0: greedy."""
    greedy = temperature == 0
    record = SampledLogProbs(1.0 if greedy else temperature, top_logprobs)
    chain: list[LogitsProcessor] = [record]
    if not greedy:
        if temperature != 1.0:
            chain.append(TemperatureLogitsWarper(temperature))
        if top_k > 0:
            chain.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            chain.append(TopPLogitsWarper(top_p))
        chain.append(GumbelSample())
    return record, LogitsProcessorList(chain)


# ``generate``'s own sampling arguments: greedy (the processors draw the token), and no warper
# of its own (the model's generation config may name some)
NEUTRAL: dict[str, Any] = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
