"""Scoring a batch: ``score_batch`` (per sample, in threads for sandboxed rewards),
``score_batched`` (TRL's batched form) and ``Scorer``, which picks between them and the
:class:`~treadle.rewards.pool.RewardPool` as the run's config says, and weighs in a reward
service and an LLM judge (a :class:`Judge`, whose verdicts a higher layer hands in)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, Protocol

from treadle.rewards.functions import SANDBOXED, load_reward_fn
from treadle.rewards.pool import RewardPool
from treadle.rewards.results import (
    Outcome,
    RowSample,
    Sample,
    as_result,
    fail,
    outcome,
    with_rows,
)
from treadle.rewards.service import RewardService, ServiceOptions
from treadle.runtime.errors import ConfigError, RewardError


class Scores(list[float]):
    """The score of each sample; ``components``: each sample's dict of named components
    when the reward function returns dicts, else None."""

    components: list[dict[str, float]] | None = None


class Judge(Protocol):
    """Each sample's verdict from outside this layer (``reward.judge``: the judge's replicas,
    :class:`~treadle.rollout.judge.LLMJudge`), weighed by ``weight``."""

    weight: float

    def __call__(self, samples: Sequence[RowSample]) -> list[Outcome]:
        """Per sample (prompt, response, ground truth and data row, as :func:`with_rows` pairs
        them), (its score, None) or (None, what went wrong, in words)."""
        ...

    def metrics(self) -> dict[str, float]:
        """What the last call reports (``reward/judge_*``, ``timing/judge``)."""
        ...

    def close(self) -> None: ...


def component_matrix(scores: Sequence[float], keys: Sequence[str], spec: str) -> Any:
    """The components ``keys`` of every sample as a float32 tensor [B, len(keys)]; a RewardError
    if the function returned numbers, or a sample's dict lacks a key."""
    import torch

    components = getattr(scores, "components", None)
    if components is None:
        raise RewardError(
            f"reward function '{spec}' returned numbers, but algorithm.gdpo_reward_keys "
            f"{list(keys)} needs it to return a dict of named components per sample (e.g. "
            '{"format": 1.0, "accuracy": 0.0})'
        )
    for i, parts in enumerate(components):
        missing = [k for k in keys if k not in parts]
        if missing:
            raise RewardError(
                f"reward function '{spec}' returned the components {sorted(parts)} for sample "
                f"{i}, without {missing} of algorithm.gdpo_reward_keys"
            )
    return torch.tensor([[parts[k] for k in keys] for parts in components], dtype=torch.float32)


def score_batch(
    fn: Callable[..., Any],
    prompts: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[str],
    *,
    spec: str | None = None,
    workers: int = 1,
    timeout_s: float | None = None,
) -> Scores:
    """`fn` on every (prompt, response, ground truth) in this process; a failure raises one
    RewardError.

    `spec` names the function in errors; by default the RewardFn's own spec or the
    function's name. For a `sandboxed_reward`, `workers` calls run at once and `timeout_s`
    (when given) is passed on; other functions ignore both.
    """
    name = str(spec or getattr(fn, "spec", None) or getattr(fn, "__qualname__", repr(fn)))
    samples = _samples(prompts, responses, ground_truths)
    if getattr(fn, SANDBOXED, False):
        options = {} if timeout_s is None else {"timeout_s": timeout_s}
        outcomes: Iterable[Outcome] = _outcomes_parallel(fn, samples, options, workers)
    else:
        outcomes = (outcome(fn, sample, {}) for sample in samples)  # lazily: stop at a failure
    return _judge(name, samples, outcomes)


def score_batched(
    fn: Callable[..., Any],
    prompts: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[str],
    rows: Sequence[Mapping[str, Any]] | None = None,
    *,
    spec: str,
) -> Scores:
    """A batched reward (TRL's form) called once on the batch; a failure is one RewardError.

    It gets ``prompts``, ``completions`` and, as lists, every column of ``rows`` except those
    two names and ``prompt`` (without ``rows``: ``ground_truth``); keywords it does not take are
    left out unless it takes ``**kwargs``."""
    samples = _samples(prompts, responses, ground_truths)
    columns: dict[str, list[Any]] = {"prompts": list(prompts), "completions": list(responses)}
    if rows is None:
        columns["ground_truth"] = list(ground_truths)
    else:
        for key in dict.fromkeys(k for row in rows for k in row):
            if key not in ("prompt", "prompts", "completions"):
                columns[key] = [row.get(key) for row in rows]
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        columns = {k: v for k, v in columns.items() if k in params}
    try:
        values = fn(**columns)
    except (Exception, SystemExit) as e:
        raise RewardError(
            f"reward function '{spec}' raised {type(e).__name__}: {e} (on a batch of "
            f"{len(samples)} samples)"
        ) from e
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != len(samples):
        got = f"{len(values)} values" if isinstance(values, Sequence) else repr(values)[:60]
        raise RewardError(
            f"reward function '{spec}' returned {got} for {len(samples)} completions: a batched "
            "reward returns one number per completion"
        )
    return _judge(spec, samples, ((value, None) for value in values))


def _samples(
    prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[str]
) -> list[Sample]:
    if not len(prompts) == len(responses) == len(ground_truths):
        raise ValueError(
            f"score_batch: {len(prompts)} prompts, {len(responses)} responses and "
            f"{len(ground_truths)} ground truths; they must match"
        )
    return list(zip(prompts, responses, ground_truths, strict=True))


def _judge(
    name: str, samples: list[Sample], outcomes: Iterable[Outcome], what: str = "reward function"
) -> Scores:
    """The scores, or the RewardError of the first sample (in order) that failed (``what``:
    what ``name`` is, in the error)."""
    scores = Scores()
    components: list[dict[str, float] | None] = []
    for i, ((prompt, response, _), (value, error)) in enumerate(
        zip(samples, outcomes, strict=False)
    ):
        if isinstance(error, str):
            raise fail(name, i, prompt, response, error, what)
        if error is not None:
            cause = f"raised {type(error).__name__}: {error}"
            raise fail(name, i, prompt, response, cause, what) from error
        result = as_result(value)
        if isinstance(result, str):
            raise fail(name, i, prompt, response, result, what)
        if components and (components[0] is None) != (result[1] is None):
            first = "a number" if components[0] is None else "a dict"
            problem = f"returned {value!r}, but sample 0 returned {first}: return one kind"
            raise fail(name, i, prompt, response, problem, what)
        scores.append(result[0])
        components.append(result[1])
    if len(scores) != len(samples):
        raise AssertionError(f"{len(scores)} outcomes for {len(samples)} samples")
    if components and components[0] is not None:
        scores.components = [c for c in components if c is not None]
    return scores


def _weighted(parts: list[tuple[float, Scores]]) -> Scores:
    """The weighted sum of the sides' scores; one side's components kept (scaled)."""
    if len(parts) == 1:
        weight, scores = parts[0]
        if weight == 1:
            return scores
        out = Scores(weight * x for x in scores)
        if scores.components is not None:
            out.components = [{k: weight * v for k, v in c.items()} for c in scores.components]
        return out
    return Scores(sum(w * s[i] for w, s in parts) for i in range(len(parts[0][1])))


def _outcomes_parallel(
    fn: Callable[..., Any],
    samples: list[Sample],
    options: dict[str, Any],
    workers: int,
) -> list[Outcome]:
    if workers <= 1 or len(samples) <= 1:
        return [outcome(fn, sample, options) for sample in samples]
    with ThreadPoolExecutor(min(workers, len(samples)), thread_name_prefix="reward") as pool:
        return list(pool.map(lambda sample: outcome(fn, sample, options), samples))


class Scorer:
    """Scores batches with the function ``reward.function`` names, as ``reward.num_workers``
    and ``reward.timeout_s`` say (see the module docstring), with a reward service
    (``service``, :mod:`treadle.rewards.service`) and an LLM judge (``judge``) when given.
    Close it (or use ``with``): that closes the judge too.

    A sample's score is ``rule_weight`` x the function's + ``service.weight`` x the service's
    + ``judge.weight`` x the judge's verdict; a weight of 0 leaves its side uncalled. The named
    components of a dict reward are kept (and scaled by its weight) when only one side is
    called. A sample the judge gives no verdict is one RewardError naming ``reward.judge``;
    ``last`` holds what the last judged call reports (``reward/judge_mean``, the verdicts'
    mean before the weight, and the judge's own metrics)."""

    def __init__(
        self,
        spec: str,
        num_workers: int = 0,
        timeout_s: float = 10.0,
        key: str = "reward.function",
        service: ServiceOptions | None = None,
        rule_weight: float = 1.0,
        judge: Judge | None = None,
    ) -> None:
        self.fn = load_reward_fn(spec, key)
        self.spec, self.num_workers, self.timeout_s = spec, num_workers, timeout_s
        self.rule_weight = rule_weight
        self.judge = judge if judge is not None and judge.weight else None
        self.last: dict[str, float] = {}
        if not rule_weight and (service is None or not service.weight) and self.judge is None:
            raise ConfigError(
                "reward.function_weight is 0 and there is no reward.url or reward.judge (or "
                "their weights are 0): nothing would score the samples"
            )
        use_pool = num_workers > 0 and not self.fn.treadle_sandboxed and not self.fn.batched
        self.pool = RewardPool(spec, num_workers, timeout_s) if use_pool and rule_weight else None
        self.service = None if service is None or not service.weight else RewardService(service)

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[str],
        rows: Sequence[Mapping[str, Any]] | None = None,
    ) -> Scores:
        """The scores; ``rows`` (the data rows, for a batched reward's columns and the reward
        service) is optional."""
        parts: list[tuple[float, Scores]] = []
        if self.rule_weight:
            parts.append((self.rule_weight, self.rule(prompts, responses, ground_truths, rows)))
        if self.service is None and self.judge is None:
            return _weighted(parts)
        samples = _samples(prompts, responses, ground_truths)  # (what their errors name)
        rowed = with_rows(prompts, responses, ground_truths, rows)  # (what they are sent)
        if self.service is not None:
            values = self.service(rowed)
            url = self.service.options.url
            served = _judge(url, samples, ((v, None) for v in values), "reward service")
            parts.append((self.service.options.weight, served))
        if self.judge is None:
            return _weighted(parts)
        outcomes = self.judge(rowed)
        judged = _judge("reward.judge", samples, outcomes, "judge")
        parts.append((self.judge.weight, judged))
        mean = sum(judged) / len(judged) if judged else 0.0
        self.last = {"reward/judge_mean": mean, **self.judge.metrics()}
        return _weighted(parts)

    def rule(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[str],
        rows: Sequence[Mapping[str, Any]] | None = None,
    ) -> Scores:
        """The reward function's scores alone."""
        if self.fn.batched:
            return score_batched(
                self.fn._fn, prompts, responses, ground_truths, rows, spec=self.spec
            )
        if self.pool is None:
            workers = max(1, self.num_workers)
            return score_batch(
                self.fn, prompts, responses, ground_truths, spec=self.spec, workers=workers,
                timeout_s=self.timeout_s,
            )  # fmt: skip
        samples = _samples(prompts, responses, ground_truths)
        return _judge(self.spec, samples, self.pool.map(samples))

    @property
    def restarts(self) -> int:
        """How many worker processes ended while scoring and were started again, so far."""
        return 0 if self.pool is None else self.pool.restarts

    def close(self) -> None:
        try:
            if self.pool is not None:
                self.pool.close()
            if self.service is not None:
                self.service.close()
        finally:
            if self.judge is not None:
                self.judge.close()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
