"""Rule-based reward functions: built-ins by name and user functions from a file.

A reward function has the signature `fn(prompt: str, response: str, ground_truth: str) -> float`.
`reward.function` names one:

- a built-in, by name (`arithmetic` -> `treadle.tasks.arithmetic.compute_score`);
- a user function, as `path/to/file.py:function`; the file is imported with importlib (it need
  not be on `sys.path` or in a package);
- a Python function passed to `treadle.train(reward=fn)`: `register_reward(fn)` keeps it in
  this process under the spec `python:<module>.<name>`, which is what `config.yaml` shows.

A Python function comes in one of two forms, told apart by its signature: per sample,
`fn(prompt, response, ground_truth) -> float`, or TRL's batched form,
`fn(completions, **columns) -> list[float]` (a parameter named `completions`), called once
per batch with `prompts`, `completions` and every column of the data rows but the prompt
(`answer`, ...) as lists, keyword arguments the function does not take left out. A per-sample
function runs in the `RewardPool` like a file's, sent to its processes with cloudpickle, so
the same time limit and crash isolation hold (a closure that cannot be pickled is a
ConfigError that says to set `reward.num_workers: 0`); a batched one is called in the
trainer's process, as TRL does, without a time limit.

`load_reward_fn` returns a `RewardFn`, which pickles as its spec and loads the function again
on unpickling, so it can be shipped to Ray workers even when the user's file is not importable
there by module name. Problems with the spec are ConfigErrors at start-up.

A reward may also return a dict of named numbers, its components (`{"format": 1.0,
"accuracy": 0.0}`): the sample's score is their sum, and the components are kept
(`Scores.components`) for estimators that read them one by one (GDPO,
`algorithm.gdpo_reward_keys`); `component_matrix` lays them out as a [B, K] tensor. Every
sample of a batch returns a number, or every one a dict.

A function whose signature cannot take `(prompt, response, ground_truth)` is a ConfigError
when it is loaded, before the first rollout.

`score_batch` calls the function on every sample and checks each result: a raised exception
(`SystemExit` included), or a result that is not a finite float32 (None, a string, NaN, 1e39),
or a dict with a component that is not one, becomes one RewardError naming the function,
the sample index, a shortened prompt and response, and the cause (the first failing
sample's, in sample order). Booleans count as numbers.

Rewards that run programs (the built-in `code`) are marked `@sandboxed_reward`: they spend
their time waiting on a sandboxed process, not holding the GIL, and take a `timeout_s`
keyword. `score_batch(..., workers=N, timeout_s=T)` calls such a function from up to N threads
at once (N sandboxes at once) and passes it `timeout_s=T`; every other function is called one
sample after another and never receives `timeout_s`.

A run scores through a `Scorer` (`reward.num_workers`, `reward.timeout_s`): any other function
is called in a `RewardPool` of `num_workers` processes, each call under `timeout_s`, so a reward
that hangs, crashes its process, calls `sys.exit` or `os._exit` cannot stall the run or end it
silently: the sample's process is killed (on a timeout) or found dead, a new one takes its place,
and the RewardError says what happened. A process that ends while scoring (a crash, the OOM
killer) is started again and the sample scored once more; only a second end is the error
(`Scorer.restarts` counts them, logged as `reward/worker_restarts`). `num_workers: 0` calls it
in the trainer's process, without a time limit (the fastest; for functions you trust).

One module per job:

- :mod:`.functions`: built-in rewards by name, user functions from a file or registered from
  Python, their signatures checked;
- :mod:`.results`: what a function returned, checked (a finite number or named components);
- :mod:`.scores`: a batch scored (per sample, or batched as TRL does) by a :class:`Scorer`;
- :mod:`.pool`: the worker processes a reward runs in, each call under ``reward.timeout_s``;
- :mod:`.service`: a reward service over HTTP (``reward.url``), weighed with the function by
  the ``Scorer`` (``reward.function_weight``, ``reward.url_weight``);
- :mod:`.verdicts`: an LLM judge's prompt filled from a sample and its answer read as a score
  (``reward.judge``); its replicas are :mod:`treadle.rollout.judge`'s, which hands the
  ``Scorer`` each sample's verdict (a :class:`~treadle.rewards.scores.Judge`), weighed by
  ``reward.judge.weight``.
"""

from treadle.rewards.functions import (
    ANSWER_READERS,
    BUILTIN_REWARDS,
    GROUND_TRUTH_RULES,
    PYTHON,
    REGISTERED,
    SANDBOXED,
    RewardFn,
    answer_reader,
    ground_truth_rule,
    is_batched,
    load_reward_fn,
    pickled,
    register_reward,
    resolve,
    sandboxed_reward,
)
from treadle.rewards.pool import (
    STARTUP_TIMEOUT_S,
    RewardPool,
)
from treadle.rewards.results import (
    FLOAT32_MAX,
    Outcome,
    RowSample,
    Sample,
    as_result,
    as_score,
    fail,
    outcome,
    shorten,
    with_rows,
)
from treadle.rewards.scores import (
    Judge,
    Scorer,
    Scores,
    component_matrix,
    score_batch,
    score_batched,
)
from treadle.rewards.service import RewardService, ServiceOptions

__all__ = [
    "ANSWER_READERS",
    "BUILTIN_REWARDS",
    "FLOAT32_MAX",
    "GROUND_TRUTH_RULES",
    "PYTHON",
    "REGISTERED",
    "SANDBOXED",
    "STARTUP_TIMEOUT_S",
    "Judge",
    "Outcome",
    "RewardFn",
    "RewardPool",
    "RewardService",
    "RowSample",
    "Sample",
    "Scorer",
    "Scores",
    "ServiceOptions",
    "answer_reader",
    "as_result",
    "as_score",
    "component_matrix",
    "fail",
    "ground_truth_rule",
    "is_batched",
    "load_reward_fn",
    "outcome",
    "pickled",
    "register_reward",
    "resolve",
    "sandboxed_reward",
    "score_batch",
    "score_batched",
    "shorten",
    "with_rows",
]
