"""The model folders a run reads, checked without loading weights: the tokenizer, the model
and LoRA's targets.

``model.path`` (or the model of the checkpoint a run resumes from) and the tokenizer; for RL
``reward.model_path``, ``critic.model_path``, ``prime.model_path`` and ``prime.ref_path`` (the
value models share the actor's vocabulary: ``treadle.config.rules.check_value_models``); for
distill ``teacher.model_path`` (the student's vocabulary, not the student itself where that
teaches nothing). config.json is there and parses, its ``model_type`` is one this transformers
knows, the prompt plus the response fits the model's context (``max_position_embeddings``),
the actor's and critic's tensor- and sequence-parallel sizes divide its heads and widths
(``treadle.config.rules.model_problems``), the vocabulary holds the tokenizer's, every
safetensors header reads, and ``actor.lora.target_modules`` names layers the weights have.

The tokenizer (:class:`Tokenizer`) is loaded on first need; its size, like each safetensors
file's matrices, is remembered by the files' fingerprints (:mod:`treadle.runtime.cache`): a
second check of unchanged folders imports no transformers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from treadle.config import Config
from treadle.config.rules import RL_KINDS, Kind, check_value_models, model_problems, uses_critic
from treadle.runtime import cache
from treadle.runtime.errors import ConfigError


def check_models(cfg: Config, kind: Kind, summary: list[str], problems: list[str]) -> Any:
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
            found = Tokenizer(
                m.tokenizer_path or path, key, m.allow_download, path, cfg.data.chat_template_kwargs
            )
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
_EXPERT = re.compile(r"\.experts\.\d+\.")


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
    # (a mixture of experts' matrices, one an expert in the files, are fused 3-D weights in
    # transformers 5, and its router, the `gate` beside them, a module of its own: neither is
    # a linear layer, and `apply_lora` refuses them)
    matrices = [name for file in files for name in _matrices(file, "model.path")]
    routers = {f"{name.split('.experts.')[0]}.gate" for name in matrices if _EXPERT.search(name)}
    layers = [name for name in matrices if not _EXPERT.search(name) and name not in routers]
    last = {name.rsplit(".", 1)[-1] for name in layers}
    known = last - {"lm_head"}  # (the output head: refused by the config, LoraConfig)
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

    def __init__(
        self,
        path: str,
        key: str,
        allow_download: bool,
        model: str,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        from treadle.models.folders import PROCESSOR_FILES, WEIGHTS, resolve_model_path

        self.path, self.key, self.allow_download = path, key, allow_download
        self.template_kwargs = template_kwargs
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
                self.path,
                key=self.key,
                allow_download=self.allow_download,
                template_kwargs=self.template_kwargs,
            )
        return self._tokenizer

    def size(self) -> int:
        """``len(tokenizer)``, remembered for its files."""
        if self.template_kwargs:
            self.load()  # (which checks that its chat template reads them)
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
