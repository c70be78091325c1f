"""``treadle check``: everything about a run that can be checked without training, in seconds.

``check(cfg, kind)`` runs after the config loaded (types, bounds and cross-field rules are the
schema's, in ``treadle.config``) and before anything starts. ``kind`` is the command that will
run (train, sft, dpo, kto, rm, eval, serve); every command calls it first, ``treadle check``
alone prints its summary. This module is the order of the checks; each is its module's:

- registered names and every rule that needs the registries, the roles' included
  (``treadle.config.rules.check_algorithm``: the one home of the cross-field rules);
- the machine (:mod:`treadle.check.machine`): memory for a step's batch and the KV caches, a
  CPU for each rank, the endpoint's port;
- the model folders (:mod:`treadle.check.models`: ``model.path``, the tokenizer,
  ``reward.model_path``, ``critic.model_path``, ``prime.model_path``, ``prime.ref_path``):
  config.json is there and parses, the tokenizer loads, and the prompt plus the response fits
  the model's context (``max_position_embeddings``), and the actor's and critic's tensor- and
  sequence-parallel sizes divide its heads and widths. Weights are not loaded;
- every data file the command reads (:mod:`treadle.check.data`): each row parses and has its
  columns, through the same readers as the run (``treadle.data``), file by file so that each
  bad file is reported, and every prompt's ground truth is one its built-in reward takes
  (arithmetic: an integer; the reward's own rule, ``treadle.rewards.functions.ground_truth_rule``);
  with ``data.source=reasoning_gym`` its rows are drawn, which checks the dataset names and
  configs;
- user code (:mod:`treadle.check.user_code`: the reward function, agent loop, tools): it imports
  within ``IMPORT_TIMEOUT_S`` seconds (an import that blocks is interrupted with SIGALRM, in the
  main thread) and has a usable signature;
- the endpoint's parsers (``rollout.tool_parser``, ``rollout.reasoning_parser``): names vLLM
  registers (a name other than the defaults imports vLLM);
- the output directory (:mod:`treadle.check.output`): a directory (or creatable), writable, not
  locked by a live run.

What passed is remembered by file fingerprint (:mod:`treadle.runtime.cache`): the tokenizer's size,
each data file's rows, that a safetensors header reads, keyed by the fingerprints of the files
read (the data file, the tokenizer's and model's folders), the config settings the readers see,
the library versions and treadle's own source; a second check of unchanged files reads no rows
and imports no transformers. A problem is never remembered: it is found again. No check
imports torch: what transformers knows (a tokenizer's class, the model types) and the
algorithms' facts come from files written beside the code (:mod:`treadle.models.hf_facts`,
:mod:`treadle.algorithms.registry`).

Independent problems are all reported, one line each, in one ConfigError. Anything the user
could have written that makes a check fail in an unexpected way (a tokenizer file that is not
JSON, a template that does not render) is caught and named too: bad input never gives a
traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from treadle.check.data import check_files, check_gym, check_val_sets, evaluates
from treadle.check.machine import check_endpoint, machine_problems, precision_warning
from treadle.check.models import check_models
from treadle.check.output import check_output_dir
from treadle.check.user_code import check_parsers, check_rules, check_user_code
from treadle.config import Config
from treadle.config.rules import Kind
from treadle.runtime.errors import ConfigError, TreadleError

T = TypeVar("T")


def check(cfg: Config, kind: Kind) -> list[str]:
    """Check what ``kind`` will read and write; the summary lines, or ConfigError listing
    every problem found (one per line)."""
    problems: list[str] = []
    summary: list[str] = []

    def attempt(what: str, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return fn(*args)
        except TreadleError as e:
            problems.extend(str(e).splitlines())
        except Exception as e:  # user input that broke a library in a way we did not foresee
            problems.append(f"{what}: {type(e).__name__}: {e}")
        return None

    attempt("algorithm", check_rules, cfg, kind)
    problems += machine_problems(cfg, kind)
    slow = precision_warning(cfg, kind)
    if slow:
        logging.getLogger("treadle.check").warning("warning: %s", slow)
    attempt("rollout.tool_parser", check_parsers, cfg, summary)
    tokenizer = attempt("model.path", check_models, cfg, kind, summary, problems)
    tools = attempt("rollout.tools", check_user_code, cfg, kind, summary, problems)
    if tokenizer is not None:
        check_data = check_gym if cfg.data.source == "reasoning_gym" else check_files
        check_data(cfg, kind, tokenizer, tools, attempt, summary, problems)
    if evaluates(cfg, kind):
        check_val_sets(cfg, tokenizer, tools, attempt, summary)
    attempt("rollout.endpoint", check_endpoint, cfg, kind)
    if kind not in ("eval", "serve"):
        attempt("trainer.output_dir", check_output_dir, cfg, kind, summary)
    if problems:
        raise ConfigError("\n".join(problems))
    return summary
