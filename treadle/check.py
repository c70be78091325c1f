"""``treadle check``: everything about a run that can be checked without training, in seconds.

``check(cfg, kind)`` runs after the config loaded (types, bounds and cross-field rules are the
schema's, in ``treadle.config``) and before anything starts. ``kind`` is the command that will
run (train, sft, dpo, kto, rm, eval); every command calls it first, ``treadle check`` alone prints
its summary. It checks:

- registered names (estimators, losses, aggregation modes, KL estimators, DPO losses), after
  importing ``algorithm.plugins`` (which register names of their own), and the
  rules between them that need the registries: a group baseline needs ``rollout.n >= 2``, a
  policy loss may allow only some ``loss_agg_mode`` values, an estimator of reward components
  (GDPO) needs ``algorithm.gdpo_reward_keys``, one of the old log-probs needs their pass;
- the model folders (``model.path``, the tokenizer, ``reward.model_path``,
  ``critic.model_path``, ``prime.model_path``, ``prime.ref_path``): config.json is there and
  parses, the tokenizer loads, and the prompt plus the response fits the model's context
  (``max_position_embeddings``). Weights are not loaded;
- every data file the command reads: each row parses and has its columns, through the same
  readers as the run (``treadle.data``), file by file so that each bad file is reported;
- user code (the reward function, agent loop, tools): it imports within
  ``IMPORT_TIMEOUT_S`` seconds (an import that blocks is interrupted with SIGALRM, in the main
  thread) and has a usable signature;
- the output directory: a directory (or creatable), writable, not locked by a live run.

Independent problems are all reported, one line each, in one ConfigError. Anything the user
could have written that makes a check fail in an unexpected way (a tokenizer file that is not
JSON, a template that does not render) is caught and named too: bad input never gives a
traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

from treadle.config import DPO_KNOBS, Config
from treadle.errors import ConfigError, TreadleError

Kind = Literal["train", "sft", "dpo", "kto", "rm", "eval"]
KINDS: tuple[Kind, ...] = ("train", "sft", "dpo", "kto", "rm", "eval")
IMPORT_TIMEOUT_S = 60.0  # importing a reward function or an agent loop may take this long

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

    attempt("algorithm", check_algorithm, cfg, kind)
    tokenizer = attempt("model.path", _check_models, cfg, kind, summary, problems)
    tools = attempt("rollout.tools", _check_user_code, cfg, kind, summary, problems)
    if tokenizer is not None:
        for key, files, reader, required in _data_files(cfg, kind):
            if not files and required:
                problems.append(f"{key} is empty: list at least one JSONL or Parquet file")
            counts = [
                attempt(f"{key}: {file}", reader, cfg, tokenizer, file, key, tools)
                for file in files
            ]
            summary += [
                f"{key}: {f}: {n} rows" for f, n in zip(files, counts, strict=True) if n is not None
            ]
            total = sum(n or 0 for n in counts)
            if key == "data.train_files" and None not in counts and 0 < total < cfg.data.batch_size:
                problems.append(
                    f"{key}: {total} rows, fewer than one batch of data.batch_size="
                    f"{cfg.data.batch_size}: lower data.batch_size or add rows"
                )
    if kind != "eval":
        attempt("trainer.output_dir", _check_output_dir, cfg, summary)
    if problems:
        raise ConfigError("\n".join(problems))
    return summary


# --- registered names ------------------------------------------------------------------------


def check_algorithm(cfg: Config, kind: Kind) -> None:
    """Registered names and the rules between them (ConfigError listing every problem), after
    ``algorithm.plugins`` are imported (they register names)."""
    from treadle.algorithms import (
        ADV_ESTIMATORS,
        KL_ESTIMATORS,
        LOSS_AGG_MODES,
        POLICY_LOSSES,
        PREFERENCE_LOSSES,
    )
    from treadle.plugins import load_plugins

    if cfg.algorithm.plugins:
        with time_limit(IMPORT_TIMEOUT_S, "algorithm.plugins"):
            load_plugins(cfg.algorithm.plugins)

    names = _registered_names(cfg, kind)
    problems = []
    for key, registry, name in names:
        if name not in registry:
            close = difflib.get_close_matches(name, registry.names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(
                f"{key}: unknown name {name!r}; valid: {', '.join(registry.names())}{hint}"
            )
    if kind == "train":
        problems += _algorithm_rules(cfg, ADV_ESTIMATORS, POLICY_LOSSES)
        problems += _loss_rules(cfg, POLICY_LOSSES, KL_ESTIMATORS)
        problems += _algorithm_knobs(cfg, POLICY_LOSSES, LOSS_AGG_MODES)
    if kind == "dpo" and cfg.dpo.loss_type in PREFERENCE_LOSSES:
        problems += _preference_knobs(cfg, PREFERENCE_LOSSES.info(cfg.dpo.loss_type))
    if kind == "kto" and cfg.data.batch_size < 2:
        problems.append(
            f"data.batch_size={cfg.data.batch_size}: KTO estimates its reference point from "
            "the other examples of a batch: set data.batch_size to 2 or more"
        )
    if kind in ("dpo", "kto") and getattr(cfg, kind).eval_task and not cfg.data.val_files:
        problems.append(f"{kind}.eval_task=true needs data.val_files (held-out prompts)")
    if problems:
        raise ConfigError("\n".join(problems))


def _registered_names(cfg: Config, kind: Kind) -> list[tuple[str, Any, str]]:
    """(config key, registry, name) of every name ``kind`` looks up."""
    from treadle.algorithms import (
        ADV_ESTIMATORS,
        KL_ESTIMATORS,
        LOSS_AGG_MODES,
        POLICY_LOSSES,
        PREFERENCE_LOSSES,
        UNPAIRED_LOSSES,
    )

    alg = cfg.algorithm
    if kind == "train":
        return [
            ("algorithm.adv_estimator", ADV_ESTIMATORS, alg.adv_estimator),
            ("algorithm.policy_loss", POLICY_LOSSES, alg.policy_loss),
            ("algorithm.loss_agg_mode", LOSS_AGG_MODES, alg.loss_agg_mode),
            ("algorithm.kl_estimator", KL_ESTIMATORS, alg.kl_estimator),
            ("algorithm.kl_reward_estimator", KL_ESTIMATORS, alg.kl_reward_estimator),
        ]
    if kind == "dpo":
        return [("dpo.loss_type", PREFERENCE_LOSSES, cfg.dpo.loss_type)]
    if kind == "kto":
        return [("kto.loss_type", UNPAIRED_LOSSES, cfg.kto.loss_type)]
    return []


def _unread_knobs(
    cfg: Config, section: str, knobs: Any, reads: Any, selector: str, reads_none: str
) -> list[str]:
    """A line for each of ``knobs`` (settings of ``cfg.<section>`` that only some functions
    read) changed from its default that the function ``<section>.<selector>`` names does not
    read (``reads``): a knob nothing reads would be silently ignored."""
    settings = getattr(cfg, section)
    fields, chosen, problems = type(settings).model_fields, getattr(settings, selector), []
    for knob in sorted(knobs):
        value = getattr(settings, knob)
        if value != fields[knob].default and knob not in reads:
            shown = "null" if value is None else value
            problems.append(
                f"{section}.{knob}={shown} is not read by {section}.{selector}={chosen} (it "
                f"reads {', '.join(sorted(reads)) or reads_none}): remove {section}.{knob}"
            )
    return problems


def _algorithm_knobs(cfg: Config, losses: Any, agg_modes: Any) -> list[str]:
    """The policy loss's and the loss aggregation's knobs (their ``knobs`` registration):
    another one changed from its default is an error, as is a registered knob that is no
    ``algorithm`` setting (a plug-in's)."""
    alg, problems = cfg.algorithm, []
    fields = type(alg).model_fields
    for registry, selector in ((losses, "policy_loss"), (agg_modes, "loss_agg_mode")):
        chosen = getattr(alg, selector)
        if chosen not in registry:
            continue
        reads = registry.knobs(chosen)
        unknown = [k for k in reads if k not in fields]
        if unknown:
            problems.append(
                f"algorithm.{selector}={chosen} is registered with knobs=({', '.join(unknown)}) "
                "that are not algorithm settings: register only keys of the algorithm section"
            )
        knobs = {k for k in registry.all_knobs() if k in fields}
        problems += _unread_knobs(cfg, "algorithm", knobs, reads, selector, "no algorithm knob")
    return problems


def _preference_knobs(cfg: Config, info: dict[str, Any]) -> list[str]:
    """A ``dpo`` knob changed from its default must be one the loss reads (``f_alpha`` goes
    with ``f_divergence``); ``positive`` knobs must be > 0; ``nll`` excludes ``nll_coef``."""
    d = cfg.dpo
    reads = set(info.get("knobs", ()))
    if "f_divergence" in reads:
        reads.add("f_alpha")
    problems = _unread_knobs(cfg, "dpo", DPO_KNOBS, reads, "loss_type", "only dpo.beta")
    for knob in info.get("positive", ()):
        if not getattr(d, knob) > 0:
            problems.append(
                f"dpo.loss_type={d.loss_type} needs dpo.{knob} > 0 (got {getattr(d, knob)})"
            )
    if info.get("nll") and d.nll_coef:
        problems.append(
            f"dpo.loss_type={d.loss_type} already includes the chosen responses' NLL (weight "
            f"{info['nll']}): set dpo.nll_coef=0"
        )
    return problems


def _algorithm_rules(cfg: Config, estimators: Any, losses: Any) -> list[str]:
    alg, problems = cfg.algorithm, []
    groups = alg.adv_estimator in estimators and estimators.info(alg.adv_estimator).get("groups")
    if groups and cfg.rollout.n < 2:
        problems.append(
            f"algorithm.adv_estimator={alg.adv_estimator} takes its baseline from a group "
            f"of samples of one prompt, and rollout.n=1 makes groups of one: set rollout.n "
            "to 2 or more, or use an estimator without groups (reinforce_plus_plus, gae)"
        )
    needs = estimators.needs(alg.adv_estimator) if alg.adv_estimator in estimators else ()
    if "reward_components" in needs and not alg.gdpo_reward_keys:
        problems.append(
            f"algorithm.adv_estimator={alg.adv_estimator} normalizes each component of the "
            "reward on its own: list them in algorithm.gdpo_reward_keys (keys of the dict the "
            "reward function returns, e.g. [format, accuracy])"
        )
    if "reward_components" in needs and cfg.reward.model_path:
        problems.append(
            f"algorithm.adv_estimator={alg.adv_estimator} normalizes the named components of "
            "reward.function's score, but with reward.model_path the reward model's score "
            "trains: drop reward.model_path or use another estimator"
        )
    if {"old_log_probs", "sum_pi_squared"} & set(
        needs
    ) and cfg.actor.recompute_old_log_probs is False:
        problems.append(
            f"algorithm.adv_estimator={alg.adv_estimator} reads the old policy's log-probs "
            "before the update, which actor.recompute_old_log_probs=false skips: set it to null"
        )
    if alg.policy_loss in losses:
        allowed = losses.info(alg.policy_loss).get("agg_modes")
        if allowed and alg.loss_agg_mode not in allowed:
            problems.append(
                f"algorithm.loss_agg_mode={alg.loss_agg_mode} cannot be used with "
                f"algorithm.policy_loss={alg.policy_loss}: choose one of {', '.join(allowed)}"
            )
    return problems


def _loss_rules(cfg: Config, losses: Any, kl_estimators: Any) -> list[str]:
    """What a policy loss or KL estimator needs from the rest of the config."""
    alg, problems = cfg.algorithm, []
    reward_kl = alg.kl_reward_estimator
    if reward_kl in kl_estimators and kl_estimators.info(reward_kl).get("full_vocab"):
        problems.append(
            f"algorithm.kl_reward_estimator={reward_kl} needs the reference's whole "
            "distribution, which only the actor's update has (the reward is shaped on the "
            "driver from sampled-token log-probs): use it as algorithm.kl_estimator (the KL "
            "loss) and pick a per-token estimator (k1, k3...) for the reward"
        )
    if alg.policy_loss not in losses:
        return problems
    loss = losses.canonical(alg.policy_loss)
    if loss == "dro" and alg.dro_beta is None:
        problems.append(
            "algorithm.policy_loss=dro needs algorithm.dro_beta (> 0), the weight of its "
            "log-ratio penalty; it has no default"
        )
    old = losses.info(loss).get("old")
    if old == "rollout_log_probs" and alg.rollout_correction != "none":
        problems.append(
            f"algorithm.policy_loss={alg.policy_loss} takes the rollout log-probs as the old "
            f"policy and corrects for them itself (algorithm.bypass_*): set "
            f"algorithm.rollout_correction=none (got {alg.rollout_correction})"
        )
    return problems


# --- models ----------------------------------------------------------------------------------


def _check_models(cfg: Config, kind: Kind, summary: list[str], problems: list[str]) -> Any:
    """The tokenizer (loaded: the data checks need it) or None; checks every model folder
    named, adding to ``problems``."""
    from treadle.models import load_tokenizer, resolve_model_path

    m = cfg.model
    path = m.path or _resumed_model(cfg)
    tokenizer = None
    if not path:
        problems.append("model.path is empty: give a local Hugging Face model folder")
    else:
        try:
            folder = resolve_model_path(path, allow_download=m.allow_download)
            summary.append(f"model: {folder}{_context_note(cfg, kind, folder)}")
        except ConfigError as e:
            problems.append(str(e))
    if path or m.tokenizer_path:
        key = "model.tokenizer_path" if m.tokenizer_path else "model.path"
        try:
            tokenizer = load_tokenizer(
                m.tokenizer_path or path, key=key, allow_download=m.allow_download
            )
        except ConfigError as e:
            problems.append(str(e))
        except Exception as e:  # a tokenizer file that is not what transformers expects
            problems.append(
                f"{key}: cannot load a tokenizer from '{m.tokenizer_path or path}': {e}"
            )
    for key, other in (
        ("reward.model_path", cfg.reward.model_path),
        ("critic.model_path", cfg.critic.model_path),
        ("prime.model_path", cfg.prime.model_path),
        ("prime.ref_path", cfg.prime.ref_path),
    ):
        if other is not None and kind == "train":
            try:
                resolve_model_path(other, key=key, allow_download=m.allow_download)
            except ConfigError as e:
                problems.append(str(e))
    return tokenizer


def _resumed_model(cfg: Config) -> str:
    """The model folder of the checkpoint a run resumes from, or ""."""
    from treadle import checkpoint as ckpt

    latest = ckpt.latest_checkpoint(cfg.trainer.output_dir) if cfg.trainer.resume else None
    return str(latest / "model") if latest is not None else ""


def _context_note(cfg: Config, kind: Kind, folder: str) -> str:
    """`` (context N tokens)``; ConfigError if prompt + response do not fit in it."""
    config_path = Path(folder) / "config.json"
    if not config_path.is_file():  # a hub id with model.allow_download
        return ""
    try:
        model_config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"model.path: '{config_path}' is not valid JSON: {e}") from None
    if not isinstance(model_config, dict):
        raise ConfigError(f"model.path: '{config_path}' does not hold a JSON object")
    context = model_config.get("max_position_embeddings")
    if not isinstance(context, int) or isinstance(context, bool):
        return ""
    d, r = cfg.data, cfg.rollout
    response = cfg.response_length() if kind == "train" else r.max_new_tokens
    response_key = (
        "rollout.max_new_tokens"
        if kind != "train" or r.agent_loop == "single_turn"
        else "the agent loop's response length (rollout.max_response_length)"
    )
    if d.max_prompt_length + response > context:
        raise ConfigError(
            f"data.max_prompt_length={d.max_prompt_length} + {response_key}={response} = "
            f"{d.max_prompt_length + response} tokens is longer than the model's context, "
            f"max_position_embeddings={context} in {config_path}: lower them"
        )
    return f" (context {context} tokens)"


# --- user code -------------------------------------------------------------------------------


class _ImportTimeout(BaseException):
    """Raised by SIGALRM in code that blocks; a BaseException so user code's `except
    Exception` (and treadle's own import wrappers) let it through."""


@contextlib.contextmanager
def time_limit(seconds: float, key: str) -> Iterator[None]:
    """Interrupt the block after ``seconds`` with ConfigError naming ``key`` (main thread only:
    elsewhere, or where there is no SIGALRM, the block runs without a limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise _ImportTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    start = time.monotonic()
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _ImportTimeout:
        raise ConfigError(
            f"{key}: importing it took longer than {seconds:g} s: does it block or loop at "
            "import time?"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:  # someone else's timer (a test timeout): give back what is left of it
            left = max(outer - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, interval)


def _check_user_code(cfg: Config, kind: Kind, summary: list[str], problems: list[str]) -> Any:
    """Loads the reward function, the tools and (RL) the agent loop, adding to ``problems``;
    the tools' schemas (None without tools)."""
    uses_reward = (
        kind in ("train", "eval")
        or (kind == "sft" and cfg.data.val_files)
        or (kind == "dpo" and cfg.dpo.eval_task)
        or (kind == "kto" and cfg.kto.eval_task)
    )
    if uses_reward:
        from treadle.rewards import load_reward_fn

        spec = cfg.reward.function
        try:
            with time_limit(IMPORT_TIMEOUT_S, "reward.function"):
                load_reward_fn(spec)
            summary.append(f"reward.function: {spec}")
        except TreadleError as e:
            problems.append(str(e))
    schemas = None
    if kind in ("train", "eval"):
        from treadle.agents.loops import load_agent_loop
        from treadle.agents.tools import Toolbox

        loads: list[tuple[str, Callable[[], Any]]] = [
            ("rollout.tools", lambda: Toolbox.load(cfg.rollout.tools).schemas)  # shown in prompts
        ]
        if kind == "train":
            loads.append(("rollout.agent_loop", lambda: load_agent_loop(cfg.rollout.agent_loop)))
        for key, load in loads:
            try:
                with time_limit(IMPORT_TIMEOUT_S, key):
                    value = load()
                schemas = value if key == "rollout.tools" and cfg.rollout.tools else schemas
            except TreadleError as e:
                problems.append(str(e))
    return schemas


# --- data ------------------------------------------------------------------------------------

Reader = Callable[[Config, Any, str, str, Any], int]


def _data_files(cfg: Config, kind: Kind) -> list[tuple[str, list[str], Reader, bool]]:
    """(config key, files, reader, whether at least one file is needed) for ``kind``."""
    d = cfg.data
    train, val = ("data.train_files", d.train_files), ("data.val_files", d.val_files)
    if kind == "train":
        return [(*train, _prompt_rows, True), (*val, _prompt_rows, False)]
    if kind == "eval":
        return [(*val, _prompt_rows, True)]
    if kind == "sft":
        return [(*train, _sft_rows, True), (*val, _prompt_rows, False)]
    out: list[tuple[str, list[str], Reader, bool]] = [
        (*train, _pair_rows, True),
        (*val, _pair_rows, False),
    ]
    if kind == "kto":
        out = [(*train, _unpaired_rows, True), (*val, _unpaired_rows, False)]
    if (kind == "dpo" and cfg.dpo.eval_task) or (kind == "kto" and cfg.kto.eval_task):
        out.append((*val, _prompt_rows, False))
    return out


def _prompt_rows(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    from treadle.data import config_prompts

    return len(config_prompts(cfg, [file], key, tokenizer, tools))


def _sft_rows(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    from treadle.data import config_sft

    return len(config_sft(cfg, [file], key, tokenizer))


def _pair_rows(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    from treadle.data import config_pairs

    return len(config_pairs(cfg, [file], key, tokenizer))


def _unpaired_rows(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    from treadle.data import config_unpaired

    return len(config_unpaired(cfg, [file], key, tokenizer))


# --- output directory ------------------------------------------------------------------------


def _check_output_dir(cfg: Config, summary: list[str]) -> None:
    key = "trainer.output_dir"
    out = Path(cfg.trainer.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}: '{out}' is a file, not a directory")
    if out.is_dir():
        if not os.access(out, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: '{out}' is not writable")
        holder = lock_holder(out / ".lock")
        if holder is not None:
            raise ConfigError(
                f"{key}: '{out}' is in use by another run ({holder}): wait for it to end or "
                "stop it, or set trainer.output_dir to another directory"
            )
        summary.append(f"{key}: {out} (exists)")
        return
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{key}: cannot create '{out}': '{parent}' is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot create '{out}': '{parent}' is not writable")
    summary.append(f"{key}: {out} (new)")


def lock_holder(path: Path) -> str | None:
    """Who holds the run lock ``path`` (``pid N on host``, or "pid unknown"); None if nobody.

    Tries the lock (``flock``, as ``trainers.run_dir.RunLock`` takes it) and lets it go at once.
    """
    try:
        file = path.open("r")
    except FileNotFoundError:
        return None
    with file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return file.read().strip() or "pid unknown"
        fcntl.flock(file.fileno(), fcntl.LOCK_UN)
    return None
