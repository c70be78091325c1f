"""The LLM judge of ``reward.judge``: a frozen causal LM whose answer about each training
sample is read as a reward (verl's generative reward models beside the actors, TRL's judges).

:class:`LLMJudge` is made when the run's roles are planned, before anything starts
(:func:`~treadle.trainers.roles.plan_roles`: it loads the judge's tokenizer and checks its
settings), :meth:`LLMJudge.start` serves it after the side roles, once the actors are up, and
the run's :class:`~treadle.rewards.Scorer` calls it on every scored training batch, weighing
its verdicts with the reward function's (and a reward service's) by ``reward.judge.weight``;
closing the scorer closes the judge.

- **Served as the distillation teacher is** (:mod:`treadle.rollout.frozen`): colocated, a
  transformers engine in every actor rank's process
  (:class:`~treadle.serving.replica.ServesJudge`); split, ``reward.judge.replicas`` Ray actors
  in a pool of their own, with either engine. Its requests go through a client of its own, to
  the least loaded replica; its weights never change.
- **It reads text, with its own tokenizer.** Each sample's prompt is ``reward.judge.template``
  filled from the sample (:func:`~treadle.rewards.verdicts.fill`), given as the user message of
  the judge's chat template (``reward.judge.chat_template``) and tokenized by the judge's
  tokenizer; the special-token strings of the sample's own text stay text, so a response
  cannot end the judge's turn. Any causal LM judges, whatever the policy's vocabulary.
- **One batch, one call.** All of a batch's requests are sent at once (the transformers engine
  runs them ``reward.judge.micro_batch_size`` at a time, vLLM batches them itself), and the
  whole batch must be answered within ``reward.judge.timeout_s``: past it, one RewardError
  line naming ``reward.judge`` stops the run.
- **Verdicts** (:class:`~treadle.rewards.verdicts.Verdict`): ``number`` and ``choice`` read
  the judge's answer, generated with ``reward.judge.temperature`` (greedy by default) and at
  most ``reward.judge.max_new_tokens`` tokens; ``prob`` generates nothing: one scoring request
  per sample (two with ``against``) gives the log-probs of ``reward.judge.token``'s tokens
  after the prompt, at temperature 1, as the engine's ``score`` computes them (float32
  log-softmax of the raw logits): the same number a forward pass of the judge gives.
  ``token`` and ``against`` are filled from the sample as the template is: ``token:
  "{answer}"`` makes the verdict the judge's probability of the reference answer after
  reading the response, a reference-probability reward (RLPR, arXiv 2506.18254, takes it
  from the policy itself; here any frozen model gives it, and no answer format is needed).
- **A sample without a verdict** (an answer with no number in the scale or none of the choices,
  a judge prompt over ``reward.judge.max_length``) gets ``reward.judge.unparsed`` when it is
  set (counted in ``reward/judge_unparsed``, the fraction of the batch), and is otherwise one
  RewardError naming ``reward.judge``, the sample, what the judge answered and this setting. A
  template column the sample's row lacks is always that error (``treadle check`` finds it
  first).
- **Metrics**, of a step's last scored batch: ``reward/judge_mean`` (the verdicts' mean,
  before the weight; the Scorer's), ``timing/judge`` and, with ``unparsed`` set,
  ``reward/judge_unparsed``.
- **Threads.** Ray replicas are reached from a loop in a thread of the client's own, so the
  judge can be called from any thread; a local replica (the local backend) steps in the
  caller's thread, as the rollout's does.

Held-out evaluation is scored without the judge (``reward.eval_rule_weight``), as with a
reward model: ``eval/*/accuracy`` stays the task's answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.agents.loops import single_turn
from treadle.agents.tools import Toolbox
from treadle.config import Config
from treadle.controller import WorkerGroup
from treadle.data.templating import encode_plain, encode_prompt, render, special_strings
from treadle.engines.inference import SamplingParams
from treadle.models.loading import load_tokenizer, resolve_model_path
from treadle.rewards import Outcome
from treadle.rewards.results import RowSample
from treadle.rewards.verdicts import NoVerdict, Verdict, check_prompting, fill, prob_score
from treadle.rollout.fleet import Agents, Rollout
from treadle.rollout.frozen import frozen_cpus, serve_frozen
from treadle.runtime.errors import RewardError
from treadle.serving.client import LocalReplica
from treadle.serving.replica import judge_length
from treadle.serving.server import Request, ScoreRequest

KEY = "reward.judge.model_path"


@dataclass(frozen=True)
class JudgePrompt:
    """One sample's judge prompt as the judge's token ids, and (prob) the ids of the answers
    whose probabilities make the verdict: ``token``'s, then ``against``'s."""

    ids: list[int]
    answers: tuple[list[int], ...] = ()


Asked = JudgePrompt | NoVerdict | str  # a sample's judge prompt, or why it has none


def judge_cpus(cfg: Config) -> float:
    """CPUs of the split judge pool (0 when colocated or without a judge)."""
    j = cfg.reward.judge
    return 0.0 if j.model_path is None else frozen_cpus(j)


def make_judge(cfg: Config) -> LLMJudge | None:
    """The run's judge (not started), or None without ``reward.judge.model_path``."""
    return None if cfg.reward.judge.model_path is None else LLMJudge(cfg)


class LLMJudge:
    """``reward.judge``'s verdicts on samples (see the module docstring): make it, ``start``
    it on the actors' group, call it, ``close`` it."""

    def __init__(self, cfg: Config) -> None:
        j = cfg.reward.judge
        assert j.model_path is not None, "reward.judge.model_path is not set"
        self.cfg, self.options, self.weight = cfg, j, j.weight
        allow = cfg.model.allow_download
        self.path = str(resolve_model_path(j.model_path, key=KEY, allow_download=allow))
        self.tokenizer = load_tokenizer(self.path, key=KEY, allow_download=allow)
        check_prompting(j, self.tokenizer)
        self.answers = [j.token, j.against] if j.against is not None else [j.token]
        self.verdict = Verdict(j.verdict, j.scale, dict(j.choices))
        self.limit = judge_length(cfg, self.path)
        self.specials = special_strings(self.tokenizer)
        self.rollout: Rollout | None = None
        self.last: dict[str, float] = {}

    def start(self, group: WorkerGroup) -> None:
        """Serve the judge as ``reward.judge.placement`` says (``group``: the actors')."""
        agents = Agents(single_turn, Toolbox([]), self.tokenizer)
        self.rollout = serve_frozen(self.cfg, group, "judge", self.options, self.path, agents)
        client = self.rollout.client
        if not any(isinstance(r, LocalReplica) for r in client.replicas):
            client.start_background()  # (callable from any thread)

    def close(self) -> None:
        rollout, self.rollout = self.rollout, None
        if rollout is not None:
            rollout.close()

    def __enter__(self) -> LLMJudge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def metrics(self) -> dict[str, float]:
        """``timing/judge`` and ``reward/judge_unparsed`` of the last call."""
        return dict(self.last)

    # ------------------------------------------------------------------ a batch's verdicts

    def __call__(self, samples: Sequence[RowSample]) -> list[Outcome]:
        """Per sample (prompt, response, ground truth and data row, as
        :func:`~treadle.rewards.results.with_rows` pairs them), (its score, None) or (None, why
        it has none)."""
        assert self.rollout is not None, "start the judge first"
        started = time.perf_counter()
        asked = [self.ask(*sample) for sample in samples]
        todo = [a for a in asked if isinstance(a, JudgePrompt)]
        verdicts = iter(self._run(self._verdicts(todo), len(todo)) if todo else [])
        results = [next(verdicts) if isinstance(a, JudgePrompt) else a for a in asked]
        self.last = {"timing/judge": time.perf_counter() - started}
        if self.options.unparsed is not None and results:
            unparsed = sum(isinstance(r, NoVerdict) for r in results)
            self.last["reward/judge_unparsed"] = unparsed / len(results)
        return [self._outcome(r) for r in results]

    def ask(self, prompt: str, response: str, truth: Any, row: Mapping[str, Any]) -> Asked:
        """One sample's judge prompt (and, prob, answers), or why it has none."""
        j = self.options
        try:
            text, values = fill(j.template, prompt, response, truth, row)
            filled = [fill(a, prompt, response, truth, row)[0] for a in self.answers]
        except KeyError as e:
            return (
                f"reward.judge names {{{e.args[0]}}}, which is not a column of this sample's "
                "data row"
            )
        answers = tuple(encode_plain(self.tokenizer, a) for a in filled)
        if j.verdict == "prob" and not all(answers):
            return f"reward.judge's answer {filled!r} is no tokens for the judge's tokenizer"
        if j.chat_template:
            text = render(self.tokenizer, [{"role": "user", "content": text}], generation=True)
        ids = encode_prompt(
            self.tokenizer, text, values, templated=j.chat_template, allow_special=False,
            specials=self.specials,
        )  # fmt: skip
        answer = max(map(len, answers)) if j.verdict == "prob" else j.max_new_tokens
        if len(ids) + answer > self.limit:
            return NoVerdict(
                f"its judge prompt is {len(ids)} tokens; with the answer's {answer} that is over "
                f"reward.judge.max_length={self.limit}"
            )
        return JudgePrompt(ids, answers if j.verdict == "prob" else ())

    def _outcome(self, verdict: float | NoVerdict | str) -> Outcome:
        if isinstance(verdict, str):
            return None, verdict
        if isinstance(verdict, NoVerdict):
            if self.options.unparsed is not None:
                return self.options.unparsed, None
            return None, f"{verdict.problem} (set reward.judge.unparsed to score such samples)"
        return verdict, None

    def _run(self, coro: Any, count: int) -> list[float | NoVerdict]:
        """``coro`` (the verdicts of ``count`` judge prompts) on the judge's client, within
        ``reward.judge.timeout_s``."""
        assert self.rollout is not None
        limit = self.options.timeout_s
        try:
            verdicts: list[float | NoVerdict] = self.rollout.client.run(
                asyncio.wait_for(coro, limit)
            )
        except TimeoutError:
            raise RewardError(
                f"reward.judge: no verdicts within reward.judge.timeout_s={limit:g} s for a "
                f"batch of {count} judge prompts ('{self.options.model_path}', "
                f"{self.options.placement}): raise the limit, or give the judge more replicas"
            ) from None
        return verdicts

    async def _verdicts(self, prompts: list[JudgePrompt]) -> list[float | NoVerdict]:
        """Each judge prompt's verdict: its answer read, or (prob) its answers' log-probs."""
        assert self.rollout is not None
        client = self.rollout.client
        if self.options.verdict == "prob":
            scoring = [
                ScoreRequest(client.new_id("j"), (*p.ids, *answer), len(p.ids), 0)
                for p in prompts
                for answer in p.answers
            ]
            scored = iter([sum(r.log_probs) for r in await client.score_many(scoring)])
            return [prob_score(*(next(scored) for _ in p.answers)) for p in prompts]
        j = self.options
        params = SamplingParams(
            temperature=j.temperature, max_new_tokens=j.max_new_tokens, seed=self.cfg.trainer.seed
        )
        requests = [Request(client.new_id("j"), tuple(p.ids), params) for p in prompts]
        answers = await client.submit_many(requests)
        texts = self.tokenizer.batch_decode(
            [a.token_ids for a in answers], skip_special_tokens=True
        )
        return [self.verdict.read(text) for text in texts]
