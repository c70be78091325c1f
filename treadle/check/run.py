"""``treadle check``: everything about a run that can be checked without training, in seconds.

``check(cfg, kind)`` runs after the config loaded (types, bounds and cross-field rules are the
schema's, in ``treadle.config``) and before anything starts. ``kind`` is the command that will
run (train, sft, dpo, kto, rm, eval, serve); every command calls it first, ``treadle check``
alone prints its summary. It checks:

- registered names and every rule that needs the registries, the roles' included
  (``treadle.config.rules.check_algorithm``: the one home of the cross-field rules);
- the model folders (``model.path``, the tokenizer, ``reward.model_path``,
  ``critic.model_path``, ``prime.model_path``, ``prime.ref_path``): config.json is there and
  parses, the tokenizer loads, and the prompt plus the response fits the model's context
  (``max_position_embeddings``), and the actor's and critic's tensor- and sequence-parallel
  sizes divide its heads and widths. Weights are not loaded;
- every data file the command reads: each row parses and has its columns, through the same
  readers as the run (``treadle.data``), file by file so that each bad file is reported, and
  every prompt's ground truth is one its built-in reward takes (arithmetic: an integer; the
  reward's own rule, ``treadle.rewards.functions.ground_truth_rule``); with
  ``data.source=reasoning_gym`` its rows are drawn, which checks the dataset names and configs;
- user code (the reward function, agent loop, tools): it imports within
  ``IMPORT_TIMEOUT_S`` seconds (an import that blocks is interrupted with SIGALRM, in the main
  thread) and has a usable signature;
- the endpoint's parsers (``rollout.tool_parser``, ``rollout.reasoning_parser``): names vLLM
  registers (a name other than the defaults imports vLLM);
- the output directory: a directory (or creatable), writable, not locked by a live run.

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

import fcntl
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from treadle.config import Config
from treadle.config.rules import KINDS, Kind, check_algorithm, model_problems
from treadle.config.timeout import IMPORT_TIMEOUT_S, time_limit
from treadle.runtime import cache
from treadle.runtime.errors import ConfigError, TreadleError
from treadle.runtime.plugins import probe_import

RL_KINDS: tuple[Kind, ...] = ("train", "distill")  # the commands that run the RL dataflow

__all__ = [
    "IMPORT_TIMEOUT_S",
    "KINDS",
    "Kind",
    "check",
    "check_algorithm",
    "lock_holder",
    "time_limit",
]

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
    problems += _machine_problems(cfg, kind)
    attempt("rollout.tool_parser", _check_parsers, cfg, summary)
    tokenizer = attempt("model.path", _check_models, cfg, kind, summary, problems)
    tools = attempt("rollout.tools", _check_user_code, cfg, kind, summary, problems)
    if tokenizer is not None:
        check_data = _check_gym if cfg.data.source == "reasoning_gym" else _check_files
        check_data(cfg, kind, tokenizer, tools, attempt, summary, problems)
    if evaluates(cfg, kind):
        _check_val_sets(cfg, tokenizer, tools, attempt, summary)
    attempt("rollout.endpoint", _check_endpoint, cfg, kind)
    if kind not in ("eval", "serve"):
        attempt("trainer.output_dir", _check_output_dir, cfg, kind, summary)
    if problems:
        raise ConfigError("\n".join(problems))
    return summary


# --- the machine -----------------------------------------------------------------------------

BATCH_BYTES_PER_TOKEN = 64  # a step's batch on the driver: ids, masks, log-probs, advantages...


def _machine_problems(cfg: Config, kind: Kind) -> list[str]:
    """Sizes beyond this machine (a run that starts its own Ray cluster or runs locally):
    memory for a step's batch and the vLLM KV caches, a CPU for each actor rank."""
    t, r = cfg.trainer, cfg.rollout
    if t.backend == "ray" and (t.ray_address or os.environ.get("RAY_ADDRESS", "local")) != "local":
        return []  # a joined cluster: its nodes' sizes are Ray's to say
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpus = os.cpu_count() or 1
    problems = []
    if kind in RL_KINDS:
        samples = cfg.data.batch_size * r.n
        tokens = cfg.data.max_prompt_length + cfg.response_length()
        need = samples * tokens * BATCH_BYTES_PER_TOKEN / 2**30
        if need > gib:
            problems.append(
                f"rollout.n={r.n}: a step's batch of data.batch_size x rollout.n = {samples} "
                f"samples of up to {tokens} tokens takes about {need:,.0f} GiB, more than this "
                f"machine's {gib:.0f} GiB of memory: lower rollout.n or data.batch_size"
            )
    replicas = r.replicas or (cfg.actor.world_size if r.placement == "colocated" else 1)
    if (
        r.engine == "vllm"
        and kind in (*RL_KINDS, "eval", "serve")
        and r.kv_cache_gib * replicas > gib
    ):
        problems.append(
            f"rollout.kv_cache_gib={r.kv_cache_gib:g} for each of {replicas} vLLM replicas is "
            f"more than this machine's {gib:.0f} GiB of memory: lower rollout.kv_cache_gib"
        )
    ranks = cfg.actor.world_size
    if t.backend == "ray" and ranks > (t.num_cpus or cpus):
        have = f"trainer.num_cpus={t.num_cpus:g}" if t.num_cpus else f"{cpus} CPUs of this machine"
        problems.append(
            f"actor.world_size={ranks} ranks need a CPU each, more than the {have}: lower "
            "actor.world_size, or join a Ray cluster with more (trainer.ray_address)"
        )
    return problems


# --- models ----------------------------------------------------------------------------------


def _check_models(cfg: Config, kind: Kind, summary: list[str], problems: list[str]) -> Any:
    """The tokenizer (a ``Tokenizer``: the data checks need it) or None; checks every model
    folder named, adding to ``problems``."""
    from treadle.models.folders import resolve_model_path

    m = cfg.model
    path = m.path or _resumed_model(cfg)
    tokenizer = folder = None
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
            found = Tokenizer(m.tokenizer_path or path, key, m.allow_download, path)
            found.size()  # (loads it, unless this folder's tokenizer loaded before)
            tokenizer = found
        except ConfigError as e:
            problems.append(str(e))
        except Exception as e:  # a tokenizer file that is not what transformers expects
            problems.append(
                f"{key}: cannot load a tokenizer from '{m.tokenizer_path or path}': {e}"
            )
    if kind == "distill" and cfg.teacher.model_path and path:
        _check_teacher(cfg, path, summary, problems)
    if folder is not None:
        try:
            _check_folder(str(folder), "model.path", tokenizer)
            _check_lora_targets(cfg, kind, str(folder))
        except ConfigError as e:
            problems.append(str(e))
    if kind in RL_KINDS:
        _check_side_models(cfg, problems)
    return tokenizer


def _check_side_models(cfg: Config, problems: list[str]) -> None:
    """The folders of the reward model, the critic and PRIME's models (RL)."""
    from treadle.config.rules import check_value_models, uses_critic
    from treadle.models.folders import resolve_model_path

    found = True
    for key, other in (
        ("reward.model_path", cfg.reward.model_path),
        ("critic.model_path", cfg.critic.model_path),
        ("prime.model_path", cfg.prime.model_path),
        ("prime.ref_path", cfg.prime.ref_path),
    ):
        if other is not None:
            try:
                folder = resolve_model_path(other, key=key, allow_download=cfg.model.allow_download)
                _check_folder(str(folder), key, None)
            except ConfigError as e:
                problems.append(str(e))
                found = False
    if found and cfg.model.path and (cfg.critic.model_path or cfg.reward.model_path):
        try:
            check_value_models(cfg, critic=uses_critic(cfg))  # (the trainer's own check)
        except ConfigError as e:
            problems.append(str(e))


def _check_folder(folder: str, key: str, tokenizer: Any) -> None:
    """What transformers would refuse (or get wrong) at load, without loading weights:
    ``model_type`` unknown, a vocabulary smaller than the tokenizer's, weights whose
    safetensors header does not read."""
    from treadle.models.folders import check_config_file, vocab_size

    path = Path(folder)
    if not (path / "config.json").is_file():  # a hub id with model.allow_download
        return
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except ValueError:  # not UTF-8, not JSON: _context_note says so
        return
    if not isinstance(config, dict):
        return
    model_type = config.get("model_type")
    if model_type is not None and not _known_model_type(model_type):
        raise ConfigError(
            f"{key}: '{path / 'config.json'}' has model_type {model_type!r}, which this "
            "transformers does not know: fix model_type, or upgrade transformers"
        )
    check_config_file(path, key)
    vocab = vocab_size(config)
    if tokenizer is not None and vocab is not None and vocab < tokenizer.size():
        raise ConfigError(
            f"{key}: '{path / 'config.json'}' has vocab_size={vocab}, fewer than the "
            f"tokenizer's {tokenizer.size()} tokens (ids past the embedding would crash): use "
            "the model's own tokenizer or resize its embeddings"
        )
    for file in sorted(path.glob("*.safetensors")):
        _matrices(file, key)


def _matrices(file: Path, key: str) -> list[str]:
    """The modules of the safetensors file ``file`` (of the folder ``key`` names) with a
    two-dimensional ``weight`` (linear layers, embeddings), read from its header (the tensors
    are not read), remembered for the file; ConfigError for a header that does not read."""
    weights = cache.fingerprint(file)
    kept = ["safetensors matrices", weights, *cache.versions("safetensors")]
    found = cache.lookup("safetensors", kept)
    if isinstance(found, list):
        return [str(name) for name in found]
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="numpy") as header:  # (the header only)
            names = sorted(
                name.removesuffix(".weight")
                for name in header.keys()  # noqa: SIM118 (a safe_open, not a dict)
                if name.endswith(".weight") and len(header.get_slice(name).get_shape()) == 2
            )
    except Exception as e:  # a header that is not JSON, a file cut short
        raise ConfigError(
            f"{key}: '{file}' is not a safetensors file (or is corrupt: {e}): download "
            "or save the model again"
        ) from None
    cache.store("safetensors", kept, names, [weights])
    return names


EMBEDDINGS = ("embed_tokens", "wte", "wpe", "word_embeddings", "position_embeddings")


def _check_lora_targets(cfg: Config, kind: Kind, folder: str) -> None:
    """``actor.lora.target_modules`` (a list) names layers of ``model.path``'s weights, by the
    last part of their names as peft matches them, read from the safetensors headers: a name
    no weight matrix has (a typo) is refused before anything starts, as
    ``treadle.models.loading.apply_lora`` refuses it when the run builds the adapters (which also
    tells an embedding from a linear layer)."""
    targets = cfg.actor.lora.target_modules
    files = sorted(Path(folder).glob("*.safetensors"))
    if kind in ("eval", "serve") or not cfg.actor.lora.rank or isinstance(targets, str):
        return
    if not files:
        return
    last = {name.rsplit(".", 1)[-1] for file in files for name in _matrices(file, "model.path")}
    known = last | {"lm_head"}  # (a head tied to the embeddings is not in the weights)
    unknown = [t for t in targets if t not in known]
    if unknown:
        linear = ", ".join(sorted(known - set(EMBEDDINGS)))
        raise ConfigError(
            f"actor.lora.target_modules: {', '.join(map(repr, unknown))} is not a linear "
            f"layer of the model (its linear layers: {linear}; or 'all-linear')"
        )


def _known_model_type(model_type: str) -> bool:
    """Whether this transformers knows ``model_type``: one of its own from
    :mod:`treadle.models.hf_facts` (asking it imports torch), else (one registered in this
    process) asked."""
    from treadle.models.hf_facts import known_model_type

    if known_model_type(model_type):
        return True
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


LIBRARIES = ("transformers", "tokenizers", "datasets", "jinja2", "pyarrow", "reasoning-gym")


class Tokenizer:
    """The tokenizer of ``model.tokenizer_path`` or ``model.path``, loaded on first need.

    ``prints`` are the fingerprints of the files of its folder and of the model's (``model``,
    weights aside) with the libraries' versions, the key of every answer that reads it; None
    (a hub id, a model folder that does not resolve, an image processor) keeps nothing.
    """

    def __init__(self, path: str, key: str, allow_download: bool, model: str) -> None:
        from treadle.models.folders import PROCESSOR_FILES, WEIGHTS, resolve_model_path

        self.path, self.key, self.allow_download = path, key, allow_download
        self._tokenizer: Any = None
        folder = resolve_model_path(path, key=key, need="tokenizer", allow_download=allow_download)
        self.prints: list[Any] | None = None
        try:
            folders = sorted({folder, resolve_model_path(model, allow_download=allow_download)})
        except ConfigError:  # (the model's own check says why)
            return
        if all(Path(f).is_dir() for f in folders) and not any(
            (Path(f) / name).exists() for f in folders for name in PROCESSOR_FILES
        ):
            files = [fp for f in folders for fp in cache.folder_fingerprint(f, WEIGHTS)]
            self.prints = [files, *cache.versions(*LIBRARIES)]

    def load(self) -> Any:
        """The tokenizer itself (transformers')."""
        if self._tokenizer is None:
            from treadle.models.folders import load_tokenizer

            self._tokenizer = load_tokenizer(
                self.path, key=self.key, allow_download=self.allow_download
            )
        return self._tokenizer

    def size(self) -> int:
        """``len(tokenizer)``, remembered for its files."""
        key = ["tokenizer", self.prints]
        size = cache.lookup("tokenizer", key) if self.prints is not None else None
        if isinstance(size, int):
            return size
        size = len(self.load())
        if self.prints is not None:
            cache.store("tokenizer", key, size, self.prints[0])
        return size


def _check_teacher(cfg: Config, student: str, summary: list[str], problems: list[str]) -> None:
    """The teacher's folder is there and its vocabulary is the student's (``model.path``)."""
    from treadle.models.folders import resolve_model_path, shared_vocabulary

    t, download = cfg.teacher, cfg.model.allow_download
    try:
        assert t.model_path is not None
        teacher = resolve_model_path(
            t.model_path, key="teacher.model_path", allow_download=download
        )
        shared_vocabulary(student, [("teacher.model_path", teacher)], download)
        _check_teacher_is_another(cfg, teacher, student)
        summary.append(f"teacher: {teacher} ({t.engine}, {t.placement})")
    except ConfigError as e:
        problems.append(str(e))


def _check_teacher_is_another(cfg: Config, teacher: str, student: str) -> None:
    """A teacher that is the student's own start teaches nothing where the loss is the gap to
    it alone (reverse_kl without the task reward, gkd): every advantage, every divergence 0;
    seq_kd still trains on the teacher's samples (self-distillation)."""
    d = cfg.distill
    if d.loss == "seq_kd" or (d.loss == "reverse_kl" and d.task_reward):
        return
    if Path(teacher).resolve() != Path(student).resolve():
        return
    fix = ", or set distill.task_reward=true" if d.loss == "reverse_kl" else ""
    raise ConfigError(
        f"teacher.model_path is model.path ('{student}'): with distill.loss={d.loss} the "
        f"student learns the gap to its own start, which is 0: nothing is learned; give "
        f"another teacher{fix}"
    )


def _resumed_model(cfg: Config) -> str:
    """The model folder of the checkpoint a run resumes from, or ""."""
    from treadle.models import checkpoint as ckpt

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
    shape_problem = next(model_problems(cfg, model_config), None)
    if shape_problem is not None:
        raise ConfigError(shape_problem)
    context = model_config.get("max_position_embeddings")
    if not isinstance(context, int) or isinstance(context, bool):
        return ""
    d, r = cfg.data, cfg.rollout
    response = cfg.response_length() if kind in RL_KINDS else r.max_new_tokens
    response_key = (
        "rollout.max_new_tokens"
        if kind != "train" or r.agent_loop == "single_turn"
        else "the agent loop's response length (rollout.max_response_length)"
    )
    if kind in RL_KINDS and r.agent_loop == "single_turn" and response > r.max_new_tokens:
        response_key = "eval.max_new_tokens"  # the longer of the two, the one to lower
    if d.max_prompt_length + response > context:
        raise ConfigError(
            f"data.max_prompt_length={d.max_prompt_length} + {response_key}={response} = "
            f"{d.max_prompt_length + response} tokens is longer than the model's context, "
            f"max_position_embeddings={context} in {config_path}: lower them"
        )
    return f" (context {context} tokens)"


# --- user code -------------------------------------------------------------------------------


def _check_user_code(cfg: Config, kind: Kind, summary: list[str], problems: list[str]) -> Any:
    """Loads the reward function, the tools and (RL) the agent loop, adding to ``problems``;
    the tools' schemas (None without tools)."""
    uses_reward = (
        kind in (*RL_KINDS, "eval")
        or (kind == "sft" and cfg.data.val_files)
        or (kind == "dpo" and cfg.dpo.eval_task)
        or (kind == "kto" and cfg.kto.eval_task)
    )
    if uses_reward:
        spec = cfg.reward.function
        try:
            if not spec.startswith("python:"):  # (a function given in this process)
                probe_import(spec, "reward.function", IMPORT_TIMEOUT_S)  # a hang, an os._exit
            with time_limit(IMPORT_TIMEOUT_S, "reward.function"):
                _load_reward(spec, "reward.function")
            summary.append(f"reward.function: {spec}")
        except TreadleError as e:
            problems.append(str(e))
    schemas = None
    if kind in (*RL_KINDS, "eval"):
        from treadle.agents.registry import BUILTIN_LOOPS, load_agent_loop

        loads: list[tuple[str, Callable[[], Any]]] = []
        if cfg.rollout.tools:  # (their schemas are shown in prompts)
            loads.append(("rollout.tools", lambda: _toolbox(cfg.rollout.tools).schemas))
        if kind in RL_KINDS and cfg.rollout.agent_loop not in BUILTIN_LOOPS:  # (not treadle's)
            loads.append(
                (
                    "rollout.agent_loop",
                    lambda: load_agent_loop(cfg.rollout.agent_loop, cfg.rollout.env),
                )
            )
        for key, load in loads:
            try:
                with time_limit(IMPORT_TIMEOUT_S, key):
                    value = load()
                schemas = value if key == "rollout.tools" and cfg.rollout.tools else schemas
            except TreadleError as e:
                problems.append(str(e))
    return schemas


def _toolbox(specs: list[str]) -> Any:
    from treadle.agents.tools import Toolbox

    return Toolbox.load(specs)


def _check_parsers(cfg: Config, summary: list[str]) -> None:
    """The endpoint's parsers are vLLM's registered names (the defaults: without importing
    vLLM, which takes seconds)."""
    from treadle.serving.parsers import check_parser_names

    r = cfg.rollout
    check_parser_names(r.tool_parser, r.reasoning_parser)
    if r.tool_parser != "hermes" or r.reasoning_parser is not None:
        summary.append(f"rollout.tool_parser: {r.tool_parser}, reasoning: {r.reasoning_parser}")


# --- data ------------------------------------------------------------------------------------

Reader = Callable[[Config, Any, str, str, Any], int]
Attempt = Callable[..., Any]  # check's attempt(what, fn, *args): fn's value, or None (noted)


def _check_gym(
    cfg: Config, kind: Kind, tokenizer: Any, tools: Any, attempt: Attempt,
    summary: list[str], problems: list[str],
) -> None:  # fmt: skip
    """reasoning-gym's rows of each split ``kind`` reads: drawing them checks the dataset
    names and configs (each problem names its key)."""
    if kind not in GYM_KINDS:
        return  # check_algorithm says the source does not fit the command
    for split, reader in _gym_splits(cfg, kind):
        key = "data.val_files" if split == "val" else "data.train_files"  # the split's key
        count = attempt(
            f"data.reasoning_gym ({split})", _rows, reader, cfg, tokenizer, "", key, tools
        )
        if count is None:
            break  # both splits come from one spec: its problem is said once
        summary.append(f"data.reasoning_gym ({split}): {count} rows")
        if split == "train" and kind in RL_KINDS and count < cfg.data.batch_size:
            problems.append(
                f"data.reasoning_gym.size: {count} rows, fewer than one batch of "
                f"data.batch_size={cfg.data.batch_size}: lower data.batch_size or raise it"
            )


def _check_files(
    cfg: Config, kind: Kind, tokenizer: Any, tools: Any, attempt: Attempt,
    summary: list[str], problems: list[str],
) -> None:  # fmt: skip
    """Every data file ``kind`` reads, file by file."""
    for key, files, reader, required in _data_files(cfg, kind):
        if not files and required:
            problems.append(f"{key} is empty: list at least one JSONL or Parquet file")
        counts = [
            attempt(f"{key}: {file}", _rows, reader, cfg, tokenizer, file, key, tools)
            for file in files
        ]
        summary += [
            f"{key}: {f}: {n} rows" for f, n in zip(files, counts, strict=True) if n is not None
        ]
        total = sum(n or 0 for n in counts)
        if key == "data.val_files" and None not in counts:
            summary += _fewer_rows("data.val_size", cfg.data.val_size, total)
        if key == "data.train_files" and None not in counts and 0 < total < cfg.data.batch_size:
            problems.append(
                f"{key}: {total} rows, fewer than one batch of data.batch_size="
                f"{cfg.data.batch_size}: lower data.batch_size or add rows"
            )


def _data_files(cfg: Config, kind: Kind) -> list[tuple[str, list[str], Reader, bool]]:
    """(config key, files, reader, whether at least one file is needed) for ``kind``."""
    d = cfg.data
    train, val = ("data.train_files", d.train_files), ("data.val_files", d.val_files)
    if kind == "serve":
        return []
    if kind in RL_KINDS:
        responses = kind == "distill" and cfg.distill.loss == "gkd" and cfg.distill.lmbda < 1
        prompts: list[tuple[str, list[str], Reader, bool]] = [
            (*train, _prompt_rows, True),
            (*val, _prompt_rows, False),
        ]
        # gkd trains on the dataset's responses too
        return [*prompts, (*train, _sft_rows, True)] if responses else prompts
    if kind == "eval":  # (data.val_sets instead will do)
        return [(*val, _prompt_rows, not d.val_sets)]
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


GYM_KINDS = (*RL_KINDS, "sft", "eval")  # the commands that read data.source=reasoning_gym


def evaluates(cfg: Config, kind: Kind) -> bool:
    """Whether ``kind`` generates on the validation sets (and scores them)."""
    return (
        kind in (*RL_KINDS, "sft", "eval")
        or (kind == "dpo" and cfg.dpo.eval_task)
        or (kind == "kto" and cfg.kto.eval_task)
    )


def _check_val_sets(
    cfg: Config, tokenizer: Any, tools: Any, attempt: Attempt, summary: list[str]
) -> None:
    """Every ``data.val_sets`` entry: its reward loads, its rows read (each problem names the
    set's key)."""

    for name, spec in cfg.data.val_sets.items():
        key = f"data.val_sets.{name}"
        if spec.reward is not None:
            with time_limit(IMPORT_TIMEOUT_S, f"{key}.reward"):
                if attempt(f"{key}.reward", _load_reward, spec.reward, f"{key}.reward"):
                    summary.append(f"{key}.reward: {spec.reward}")
        if tokenizer is not None:
            ds = attempt(key, _val_set_rows, cfg, name, tokenizer, tools)
            if ds is not None:
                summary.append(f"{key}: {len(ds)} rows")
                summary += _fewer_rows(f"{key}.size", spec.size, len(ds))


def _fewer_rows(key: str, size: int | None, rows: int) -> list[str]:
    """A note when ``key`` asks for more held-out rows than there are (all are evaluated)."""
    if size is None or size <= rows:
        return []
    return [f"{key}={size}: the set has {rows} rows, so all {rows} are evaluated"]


def _val_set_rows(cfg: Config, name: str, tokenizer: Tokenizer, tools: Any) -> Any:
    """The set's prompts, every ground truth one its reward takes."""
    from treadle.trainers.datasets import val_set_prompts

    ds = val_set_prompts(cfg, name, tokenizer.load(), tools)
    key, own = f"data.val_sets.{name}", cfg.data.val_sets[name].reward
    reward = (own, f"{key}.reward") if own else (cfg.reward.function, "reward.function")
    _check_ground_truths(cfg, ds, key, reward, cfg.data.val_sets[name].source == "files")
    return ds


def _gym_splits(cfg: Config, kind: Kind) -> list[tuple[str, Reader]]:
    """(split, reader) of the reasoning-gym rows ``kind`` reads: drawing them checks the
    dataset names and configs (each problem names its key)."""
    held_out: list[tuple[str, Reader]] = [("val", _prompt_rows)] if cfg.data.has_val else []
    if kind == "eval":
        return held_out or [("val", _no_held_out)]
    return [("train", _sft_rows if kind == "sft" else _prompt_rows), *held_out]


def _rows(
    reader: Reader, cfg: Config, tokenizer: Tokenizer, file: str, key: str, tools: Any
) -> int:
    """``reader``'s row count of ``file``, remembered for the file, the tokenizer's files and
    the settings a reader sees (the ``data`` section, ``rollout.max_new_tokens``, the tools:
    ``treadle.trainers.datasets.text_options``); what it logged (rows filtered) is said again."""
    path = Path(file)
    if tokenizer.prints is None or cfg.data.source != "files" or not path.is_file():
        return reader(cfg, tokenizer.load(), file, key, tools)
    data = cache.fingerprint(path)
    # (the reward whose rule the prompts' ground truths are held to)
    settings = [cfg.data.model_dump(mode="json"), cfg.rollout.max_new_tokens, tools]
    scored = _scoring_reward(cfg, cfg.reward.function)
    settings += [scored, _reward_columns(scored)]  # (the columns: its signature)
    cache_key = [reader.__name__, key, file, data, settings, tokenizer.prints]
    hit = cache.lookup("rows", cache_key)
    if isinstance(hit, dict):
        for line in hit["logged"]:
            logging.getLogger("treadle.data").warning("%s", line)
        return int(hit["rows"])
    with _logged("treadle.data") as logged:
        rows = reader(cfg, tokenizer.load(), file, key, tools)
    files = [data, *tokenizer.prints[0]]
    cache.store("rows", cache_key, {"rows": rows, "logged": logged}, files)
    return rows


@contextmanager
def _logged(name: str) -> Iterator[list[str]]:
    """The messages logged to ``name`` (and below) while inside, still logged as usual."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger(name).addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger(name).removeHandler(handler)


def _no_held_out(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    raise ConfigError("data.reasoning_gym.val_size=0: eval needs held-out rows")


def _prompt_rows(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    """The prompts of ``file``, every ground truth one ``reward.function`` takes (every
    command that reads prompts scores them with it)."""
    from treadle.trainers.datasets import config_prompts

    ds = config_prompts(cfg, [file], key, tokenizer, tools)
    files = cfg.data.source == "files"
    _check_ground_truths(cfg, ds, key, (cfg.reward.function, "reward.function"), files)
    return len(ds)


def _scoring_reward(cfg: Config, spec: str) -> str | None:
    """``spec`` when it scores every sample: an agent loop of the user's may give the
    trajectory's reward itself (a game's, an environment's), so the reward function may never
    see the ground truth; treadle's own loops (single_turn, tools) never do."""
    from treadle.agents.registry import BUILTIN_LOOPS

    return spec if cfg.rollout.agent_loop in BUILTIN_LOOPS else None


def _check_ground_truths(
    cfg: Config, ds: Any, key: str, reward: tuple[str, str], files: bool
) -> None:
    """Every row's ground truth is one the built-in reward ``reward`` (its spec and config key)
    takes, by its own rule (``treadle.rewards.functions.ground_truth_rule``): a bad one would
    stop the run at whichever step draws it. The first bad row is named (``files``: rows of files,
    whose column data.answer_key names)."""
    from treadle.rewards import ground_truth_rule

    spec, spec_key = reward
    scored = _scoring_reward(cfg, spec)
    if scored is not None:
        _check_reward_columns(cfg, ds, key, scored, spec_key)
    rule = ground_truth_rule(scored) if scored is not None else None
    if rule is None:
        return
    bad = [(row, problem) for row in ds.rows if (problem := rule(row["ground_truth"]))]
    if not bad:
        return
    (row, problem), others = bad[0], len(bad) - 1
    label, _, number = row["uid"].rpartition(":")
    where = f"{label} row {number}" if files else f"row {row['uid']}"
    truth = row["ground_truth"]
    shown = repr(truth if len(truth) <= 40 else truth[:37] + "...")
    notes = [f"{others} more row{'s' if others > 1 else ''} too"] if others else []
    if re.fullmatch(r"-?\d+\.0", truth):  # (the file's own number: it is not rewritten)
        notes.append(
            "a float column, as pandas writes integers with a missing value to Parquet: "
            "store the answers as integers or text"
        )
    if files:
        notes.append(f"data.answer_key={cfg.data.answer_key}: is it the right column?")
    said = f" ({'; '.join(notes)})" if notes else ""
    raise ConfigError(
        f"{key}: {where}: answer {shown} {problem}, which {spec_key}={spec} needs{said}"
    )


_LOADED_REWARDS: dict[str, Any] = {}  # spec -> its RewardFn, once it loaded in this process


def _load_reward(spec: str, key: str) -> Any:
    """``load_reward_fn``, the function kept for :func:`_reward_columns` (which must not import
    a module whose import failed or hung: it is loaded here under a time limit)."""
    from treadle.rewards import load_reward_fn

    _LOADED_REWARDS.pop(spec, None)  # (a check's failed load keeps no earlier one)
    fn = _LOADED_REWARDS[spec] = load_reward_fn(spec, key)
    return fn


def _reward_columns(spec: str | None) -> list[str] | None:
    """The row columns the batched reward ``spec`` (``fn(completions, **columns)``,
    reasoning_gym's) is called with and needs (its parameters without a default); None for a
    per-sample reward or one that did not load (said where it is loaded)."""
    import inspect

    fn = _LOADED_REWARDS.get(spec) if spec is not None else None
    if fn is None or not fn.batched:
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        name
        for name, p in inspect.signature(fn._fn).parameters.items()
        if p.kind in kinds and p.default is inspect.Parameter.empty
        and name not in ("prompts", "completions")
    ]  # fmt: skip


def _check_reward_columns(cfg: Config, ds: Any, key: str, spec: str, spec_key: str) -> None:
    """A batched reward gets the rows' columns: one it needs that a row lacks stopped the run
    at step 1 with the function's TypeError. The first such row is named."""
    needed = _reward_columns(spec) or []
    for row in ds.rows:
        missing = [name for name in needed if name not in row["row"]]
        if not missing:
            continue
        label, _, number = row["uid"].rpartition(":")
        where = f"{label} row {number}" if cfg.data.source == "files" else f"row {row['uid']}"
        names = " and ".join(repr(name) for name in missing)
        plural = "s" if len(missing) > 1 else ""
        hint = (
            "set data.source=reasoning_gym (its rows have them) or use another reward"
            if spec == "reasoning_gym"
            else f"add the column{plural} to the data, or give the parameter{plural} a default"
        )
        raise ConfigError(
            f"{key}: {where} has no column{plural} {names}, which {spec_key}={spec} is called "
            f"with (a batched reward gets the rows' columns): {hint}"
        )


def _sft_rows(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    from treadle.trainers.datasets import config_sft

    return len(config_sft(cfg, [file], key, tokenizer))


def _pair_rows(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    from treadle.trainers.datasets import config_pairs

    return len(config_pairs(cfg, [file], key, tokenizer))


def _unpaired_rows(cfg: Config, tokenizer: Any, file: str, key: str, tools: Any) -> int:
    from treadle.trainers.datasets import config_unpaired

    return len(config_unpaired(cfg, [file], key, tokenizer))


# --- the endpoint ----------------------------------------------------------------------------


def _check_endpoint(cfg: Config, kind: Kind) -> None:
    """`treadle serve`'s endpoint, or a black-box agent's, listens on its fixed port: one taken
    (or an address not this machine's) stopped the command once the model had loaded."""
    from treadle.agents.registry import needs_endpoint
    from treadle.config.endpoint import listen_problem

    if kind == "serve" or needs_endpoint(cfg.rollout.agent_loop):
        e = cfg.rollout.endpoint
        problem = listen_problem(e.host, e.port)
        if problem is not None:
            raise ConfigError(problem)


# --- output directory ------------------------------------------------------------------------


def _check_output_dir(cfg: Config, kind: Kind, summary: list[str]) -> None:
    key = "trainer.output_dir"
    out = Path(cfg.trainer.output_dir).expanduser()
    if out.is_symlink() and not out.exists():
        raise ConfigError(
            f"{key}: '{out}' is a symlink to '{os.readlink(out)}', which does not exist: "
            "create its target, or set trainer.output_dir to another directory"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}: '{out}' is a file, not a directory")
    _check_apart_from_models(cfg, out)
    if out.is_dir():
        _check_existing_dir(out, key)
        resumes = _check_resumed_run(cfg, out, kind) if cfg.trainer.resume else ""
        summary.append(f"{key}: {out} (exists{resumes})")
        return
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{key}: cannot create '{out}': '{parent}' is a file")
    if _read_only(parent):
        raise ConfigError(f"{key}: cannot create '{out}': '{parent}' is on a read-only file system")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot create '{out}': '{parent}' is not writable")
    summary.append(f"{key}: {out} (new)")


def _check_apart_from_models(cfg: Config, out: Path) -> None:
    """The run directory is no model folder's, nor holds or is held by one: a run writes its
    checkpoints, logs and final_model/ there (into the model folder, or over the model it
    starts from; and the next run resumes from them)."""
    folders = {
        "model.path": cfg.model.path,
        "model.tokenizer_path": cfg.model.tokenizer_path,
        "critic.model_path": cfg.critic.model_path,
        "reward.model_path": cfg.reward.model_path,
        "prime.model_path": cfg.prime.model_path,
        "teacher.model_path": cfg.teacher.model_path,
    }
    run = out.resolve()
    for key, path in folders.items():
        folder = Path(path).expanduser().resolve() if path else None
        if folder is None or not folder.is_dir():
            continue
        if run == folder:
            where = f"is {key}'s folder '{folder}'"
        elif folder in run.parents:
            where = f"'{run}' is inside {key}'s folder '{folder}'"
        elif run in folder.parents:
            where = f"'{run}' holds {key}'s folder '{folder}'"
        else:
            continue
        raise ConfigError(
            f"trainer.output_dir {where}: the run writes its checkpoints, logs and final_model/ "
            "there, into the model folder or over the model it starts from: set "
            "trainer.output_dir to a directory of its own"
        )


def _check_resumed_run(cfg: Config, out: Path, kind: Kind) -> str:
    """A run resumes from its directory's newest checkpoint: one another command wrote (an SFT
    run's, resumed by `treadle train`), or of another model or data, would be taken as this
    run's. What the summary says of it: the checkpoint and the settings changed since."""
    from treadle.config.recorded import FIXED, changes
    from treadle.models import checkpoint as ckpt

    found = ckpt.newest_state(out)
    if found is None:
        return ""
    state, newest = found
    if state["command"] != kind:
        raise ConfigError(
            f"trainer.output_dir: '{out}' holds a `treadle {state['command']}` run (checkpoints "
            f"up to {newest.name}), which `treadle {kind}` would resume as its own: set "
            "trainer.output_dir to another directory"
        )
    recorded = state.get("settings")
    if not isinstance(recorded, dict):  # written before checkpoints recorded their settings
        return f"; resumes from {newest.name}"
    fixed, other = changes(recorded, cfg)
    if fixed:
        raise ConfigError(
            "\n".join(
                f"{c.key}: the run in '{out}' ({newest.name}) was trained with "
                f"{c.key}={c.shown_before}, this config has {c.shown_after}: {FIXED[c.key]}; "
                f"set {c.key} back, or set trainer.output_dir to another directory"
                for c in fixed
            )
        )
    if not other:
        return f"; resumes from {newest.name}"
    shown = ", ".join(map(str, other[:8])) + (
        f" and {len(other) - 8} more" if len(other) > 8 else ""
    )
    plural = "s" if len(other) > 1 else ""
    return f"; resumes from {newest.name} with {len(other)} setting{plural} changed: {shown}"


def _check_existing_dir(out: Path, key: str) -> None:
    if _read_only(out):
        raise ConfigError(f"{key}: '{out}' is on a read-only file system")
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: '{out}' is not writable")
    holder = lock_holder(out / ".lock")
    if holder is not None:
        raise ConfigError(
            f"{key}: '{out}' is in use by another run ({holder}): wait for it to end or "
            "stop it, or set trainer.output_dir to another directory"
        )


def _read_only(path: Path) -> bool:
    """Whether ``path`` is on a file system mounted read-only (root may write elsewhere)."""
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


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
