"""Every cross-field rule of a run's config, in one place.

Three readers, one set of rules:

- config validation (``Config``, at load): ``config_problems`` and ``old_log_probs_problem``,
  the rules between sections that need nothing but the config;
- ``treadle check`` and the trainers' start (``check_algorithm``): registered names (after
  ``algorithm.plugins`` are imported) and the rules that need the registries' facts: a group
  baseline needs ``rollout.n >= 2``, a loss may allow only some ``loss_agg_mode`` values, a knob
  no chosen function reads is an error; for ``train`` also the roles' rules below; for sft,
  dpo, kto and rm, every setting they never read (RL's, another command's section) set away
  from its default (``unread_settings``);
- role selection (``uses_critic``, ``uses_prm``): whether the run has a critic or PRIME's
  PRM, refusing a config that contradicts the estimator (``role_problems``, which
  ``check_algorithm`` runs for ``train``, holds the same rules, so ``treadle check`` says it
  first);
- the value models' folders (``check_value_models``: the critic's and reward model's share the
  actor's vocabulary, the reward model is one), read from their config.json files alone, for
  ``treadle check`` and the trainers' role plan.

Every rule returns (or raises) a message that names the keys to change. The rules know the
algorithm registries and the model folders (the layers below config) and nothing above it.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from treadle import algorithms  # the package: importing it registers every built-in name
from treadle.config.actor import ActorConfig
from treadle.config.data import DataConfig
from treadle.config.distill import DistillConfig
from treadle.config.dpo import DPO_KNOBS
from treadle.config.prime import PrimeConfig
from treadle.config.rollout import RolloutConfig
from treadle.config.run import Sections
from treadle.config.timeout import IMPORT_TIMEOUT_S, time_limit
from treadle.config.trainer import TrainerConfig
from treadle.models.folders import shared_vocabulary
from treadle.runtime.errors import ConfigError
from treadle.runtime.plugins import load_plugins

Kind = Literal["train", "distill", "sft", "dpo", "kto", "rm", "eval", "serve"]
KINDS: tuple[Kind, ...] = ("train", "distill", "sft", "dpo", "kto", "rm", "eval", "serve")

# --- between sections (config validation) ---------------------------------------------------


def old_log_probs_problem(cfg: Sections) -> str | None:
    """``actor.recompute_old_log_probs=false`` where the old log-probs need their own pass."""
    a = cfg.actor
    if a.recompute_old_log_probs is not False:
        return None
    automatic = cfg.model_copy(
        update={"actor": a.model_copy(update={"recompute_old_log_probs": None})}
    )
    if not automatic.needs_old_log_prob_pass():
        return None
    return (
        "actor.recompute_old_log_probs=false needs one optimizer step a batch without "
        "KL in the reward: set it to null (automatic), or actor.ppo_epochs=1, "
        "actor.ppo_mini_batch_size = data.batch_size x rollout.n and "
        "algorithm.kl_reward_coef=0"
    )


def config_problems(cfg: Sections) -> Iterator[str]:
    """Every broken rule between sections, one message each (all are reported, not the first)."""
    samples = cfg.data.batch_size * cfg.rollout.n
    ws = cfg.actor.world_size
    if cfg.trainer.backend == "local" and ws != 1:
        yield (
            f"trainer.backend=local runs one rank in-process; set actor.world_size=1 "
            f"(got {ws}) or use trainer.backend=ray"
        )
    if cfg.data.batch_size % ws:
        yield (
            f"data.batch_size={cfg.data.batch_size} must be divisible by "
            f"actor.world_size={ws} so every rank gets the same number of prompts"
        )
    if cfg.algorithm.filter_groups and cfg.rollout.n < 2:
        yield (
            "algorithm.filter_groups=true needs groups: set rollout.n to 2 or more "
            "(a group of one sample always has equal rewards)"
        )
    if cfg.reward.overlong_buffer_len >= cfg.rollout.max_new_tokens:
        yield (
            f"reward.overlong_buffer_len={cfg.reward.overlong_buffer_len} must be smaller "
            f"than rollout.max_new_tokens={cfg.rollout.max_new_tokens}"
        )
    for section, what, mini_key in (
        ("critic", "critic", "ppo_mini_batch_size"),
        ("prime", "PRM", "mini_batch_size"),
    ):
        role = getattr(cfg, section)
        yield from _check_side_role(
            section,
            what,
            role.world_size,
            role.placement,
            mini_key,
            getattr(role, mini_key),
            cfg.actor,
            samples,
            cfg.trainer.backend,
        )
    yield from _check_parallel(cfg)
    yield from _check_rollout(cfg.rollout, cfg.actor, cfg.trainer)
    yield from _check_agents(cfg.rollout, cfg.data)
    yield from _check_mode(cfg)
    yield from _check_retention(cfg)
    yield from _check_schedules(cfg)
    yield from _check_unread(cfg)
    if cfg.eval.n > 1 and cfg.eval.temperature == 0:
        yield (
            f"eval.n={cfg.eval.n} with eval.temperature=0 draws {cfg.eval.n} equal greedy "
            "samples: set eval.temperature (e.g. 1.0) for pass@k and maj@k, or eval.n=1"
        )


def _check_unread(cfg: Sections) -> Iterator[str]:
    """Settings another one makes void: they would be silently ignored."""
    alg, t = cfg.algorithm, cfg.trainer
    if alg.kl_target is not None and alg.kl_reward_coef == 0:
        yield (
            f"algorithm.kl_target={alg.kl_target} steers algorithm.kl_reward_coef, which is 0 "
            "(the KL penalty is off, and a coefficient of 0 stays 0): set "
            "algorithm.kl_reward_coef > 0 (its initial value), or drop algorithm.kl_target"
        )
    if t.eval_every and not cfg.data.set_names:
        yield (
            f"trainer.eval_every={t.eval_every} evaluates the validation sets, but the run has "
            "no validation set: set data.val_files or data.val_sets, or trainer.eval_every=0"
        )
    if alg.mask_truncated and cfg.rollout.ignore_eos:
        yield (
            "algorithm.mask_truncated=true drops responses cut at rollout.max_new_tokens from "
            "the loss, and rollout.ignore_eos=true cuts every response there, so nothing would "
            "train: set one of them to false"
        )


def _check_schedules(cfg: Sections) -> Iterator[str]:
    """A floor (``min_lr_ratio``) for an lr that never decays is a setting nothing reads."""
    for section in ("actor", "critic"):
        opt = getattr(cfg, section)
        if opt.min_lr_ratio and opt.lr_schedule == "constant":
            yield (
                f"{section}.min_lr_ratio={opt.min_lr_ratio} is the floor of a decaying lr, but "
                f"{section}.lr_schedule=constant never decays: set {section}.lr_schedule=cosine "
                f"(or linear), or drop {section}.min_lr_ratio"
            )


def _check_retention(cfg: Sections) -> Iterator[str]:
    """trainer.keep_best ranks checkpoints by their step's evaluation: there must be one at
    every save step, of a set the run has; trainer.final_model=best needs it."""
    t = cfg.trainer
    if t.final_model == "best" and t.keep_best is None:
        yield (
            "trainer.final_model=best exports the best checkpoint by trainer.keep_best: set "
            "trainer.keep_best (e.g. eval/val/accuracy) or trainer.final_model=last"
        )
    if t.keep_best is None:
        return
    sets = cfg.data.set_names
    parts = t.keep_best.split("/")
    if not sets:
        yield (
            f"trainer.keep_best={t.keep_best} ranks checkpoints by their evaluation, but the "
            "run has no validation set: set data.val_files or data.val_sets, or drop "
            "trainer.keep_best"
        )
    elif len(parts) > 2 and parts[1] not in sets:
        yield (
            f"trainer.keep_best={t.keep_best} names the set {parts[1]!r}, which the run does "
            f"not evaluate; its sets: {', '.join(sets)} (eval/<set>/<metric>)"
        )
    if t.save_every and (not t.eval_every or t.save_every % t.eval_every):
        yield (
            f"trainer.keep_best ranks each checkpoint by its step's evaluation, but "
            f"trainer.save_every={t.save_every} saves at steps trainer.eval_every="
            f"{t.eval_every} does not evaluate: set trainer.eval_every to "
            f"{t.save_every} (or a divisor of it)"
        )


def _check_mode(cfg: Sections) -> Iterator[str]:
    mode = cfg.trainer.mode
    if mode == "sync":
        return
    if cfg.rollout.placement != "split":
        yield (
            f"trainer.mode={mode} overlaps generation and training, which needs replicas of "
            "their own: set rollout.placement=split (and trainer.backend=ray), or "
            "trainer.mode=sync"
        )
    a = cfg.async_
    if mode == "async" and a.sync_every > a.max_staleness + 1:
        yield (
            f"async.sync_every={a.sync_every} lets the replicas fall more than "
            f"async.max_staleness={a.max_staleness} versions behind, so no sample could be "
            "trained: set sync_every to at most max_staleness + 1"
        )
    if mode == "async" and a.buffer_groups is not None and a.buffer_groups < cfg.data.batch_size:
        yield (
            f"async.buffer_groups={a.buffer_groups} cannot hold one batch of "
            f"data.batch_size={cfg.data.batch_size} groups: raise it or leave it unset"
        )


MULTI_TURN = ("max_turns", "max_tool_response_tokens", "tool_timeout_s", "max_response_length")


def _check_agents(rollout: RolloutConfig, data: DataConfig) -> Iterator[str]:
    if rollout.agent_loop == "single_turn" and rollout.tools:
        yield (
            "rollout.tools are called by an agent loop: set rollout.agent_loop=tools (or a "
            "loop of your own), or remove rollout.tools"
        )
    if rollout.agent_loop == "single_turn":  # one response, rollout.max_new_tokens long
        changed = _changed_settings("rollout", rollout, MULTI_TURN)
        if changed:
            yield (
                f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} read by agent "
                "loops of several turns (rollout.agent_loop=tools, env or one of your own), not "
                "by single_turn: set rollout.agent_loop, or remove "
                f"{'it' if len(changed) == 1 else 'them'}"
            )
    if rollout.agent_loop == "tools" and not rollout.tools:
        yield (
            "rollout.agent_loop=tools needs rollout.tools: list the tools as "
            "['module:function', ...] or ['path/to/file.py:function', ...]"
        )
    if rollout.agent_loop == "env" and not rollout.env:
        yield (
            "rollout.agent_loop=env needs rollout.env: the environment factory as "
            "'module:make_env' or 'path/to/file.py:make_env' (called with the data row)"
        )
    if rollout.env and rollout.agent_loop != "env":
        yield (
            f"rollout.env is played by the env agent loop: set rollout.agent_loop=env "
            f"(it is {rollout.agent_loop!r}), or remove rollout.env"
        )
    if rollout.agent_loop == "env" and not data.apply_chat_template:
        yield (
            "rollout.agent_loop=env renders observations with the chat template: set "
            "data.apply_chat_template=true"
        )
    if rollout.tools and not data.apply_chat_template:
        yield (
            "rollout.tools are shown to the model through the chat template: set "
            "data.apply_chat_template=true"
        )


def _check_rollout(
    rollout: RolloutConfig, actor: ActorConfig, trainer: TrainerConfig
) -> Iterator[str]:
    tp = rollout.tensor_parallel_size
    if tp > 1 and rollout.engine != "vllm":
        yield (
            f"rollout.tensor_parallel_size={tp} splits a vLLM replica; rollout.engine="
            f"{rollout.engine} runs whole: set rollout.engine=vllm or the size to 1"
        )
    elif tp > 1 and rollout.placement == "colocated":
        yield (
            f"rollout.tensor_parallel_size={tp} needs rollout.placement=split (a colocated "
            "replica lives in one actor rank's process, on its one device); on CPU set it to 1"
        )
    if rollout.placement == "colocated":
        if rollout.replicas is not None and rollout.replicas != actor.world_size:
            yield (
                f"rollout.replicas={rollout.replicas} must equal actor.world_size="
                f"{actor.world_size} when rollout.placement=colocated (one replica in each "
                "actor rank's process); set rollout.placement=split or drop rollout.replicas"
            )
        if rollout.num_cpus is not None or rollout.ray_resources:
            yield (
                "rollout.num_cpus and rollout.ray_resources shape the rollout pool of "
                "rollout.placement=split; colocated replicas use the actor's bundles: drop "
                "them or set rollout.placement=split"
            )
        return
    if trainer.backend == "local":
        yield (
            "trainer.backend=local runs one rank in-process; set rollout.placement=colocated "
            "or use trainer.backend=ray"
        )
    cpus = trainer.num_cpus
    if cpus is not None and rollout.num_cpus is not None and rollout.num_cpus >= cpus:
        yield (
            f"rollout.num_cpus={rollout.num_cpus} leaves nothing of trainer.num_cpus={cpus} "
            "for the actor: give the rollout pool fewer CPUs or the run more"
        )


def _check_parallel(cfg: Sections) -> Iterator[str]:
    """Tensor and sequence parallel layouts of the actor and the critic: the world size
    divisible by a group, one kind at a time, packed rows for sequence parallel, no LoRA.
    (The model's heads and widths are checked when the engine is built:
    :func:`treadle.engines.parallel.check_model`.)"""
    a = cfg.actor
    critic_ws = cfg.critic.world_size or a.world_size
    for section, ws, tp, sp in (
        ("actor", a.world_size, a.tensor_parallel_size, a.sequence_parallel_size),
        (
            "critic",
            critic_ws,
            cfg.critic.tensor_parallel_size,
            cfg.critic.sequence_parallel_size,
        ),
    ):
        if tp == sp == 1:
            continue
        if tp > 1 and sp > 1:
            yield (
                f"{section}.tensor_parallel_size={tp} and {section}.sequence_parallel_size={sp}: "
                "treadle splits a layer's weights or its sequence, not both; set one to 1"
            )
        world_key = f"{section}.world_size" if section == "actor" else "critic.world_size"
        if ws % (tp * sp):
            key = "tensor_parallel_size" if tp > 1 else "sequence_parallel_size"
            yield (
                f"{world_key}={ws} must be divisible by {section}.{key}={tp * sp} "
                "(the data-parallel ranks are world_size / its value)"
            )
        if sp > 1 and not a.remove_padding:
            yield (
                f"{section}.sequence_parallel_size={sp} splits packed rows: set "
                "actor.remove_padding=true"
            )
    if a.lora.rank and a.tensor_parallel_size * a.sequence_parallel_size > 1:
        yield (
            "actor.lora.rank > 0 with actor.tensor_parallel_size or "
            "actor.sequence_parallel_size > 1 is not supported: set them to 1, or lora.rank=0"
        )


def parallel_model_problems(
    section: str, tp: int, sp: int, model_config: dict[str, Any]
) -> Iterator[str]:
    """The model's shape (its ``config.json``) allows ``section``'s layout: tensor parallel
    divides the attention heads, the key/value heads and the MLP width, sequence parallel
    the heads and key/value heads. Read by ``treadle check`` and by the engine at start-up."""
    heads = model_config.get("num_attention_heads")
    shape = {
        "num_attention_heads": heads,
        "num_key_value_heads": model_config.get("num_key_value_heads") or heads,
        "intermediate_size": model_config.get("intermediate_size"),
    }
    for size, key, names in (
        (tp, "tensor_parallel_size", tuple(shape)),
        (sp, "sequence_parallel_size", ("num_attention_heads", "num_key_value_heads")),
    ):
        for name in names if size > 1 else ():
            value = shape[name]
            if isinstance(value, int) and value % size:
                yield (
                    f"{section}.{key}={size} must divide the model's {name}={value}: "
                    "choose a divisor of it"
                )


def model_problems(cfg: Sections, model_config: dict[str, Any]) -> Iterator[str]:
    """:func:`parallel_model_problems` of the actor and the critic (one model shape)."""
    a, c = cfg.actor, cfg.critic
    yield from parallel_model_problems(
        "actor", a.tensor_parallel_size, a.sequence_parallel_size, model_config
    )
    yield from parallel_model_problems(
        "critic", c.tensor_parallel_size, c.sequence_parallel_size, model_config
    )


def _check_side_role(
    section: str,
    what: str,
    world_size: int | None,
    placement: str,
    mini_key: str,
    mini_batch_size: int | None,
    actor: ActorConfig,
    samples: int,
    backend: str,
) -> Iterator[str]:
    """The placement and batch rules of a role beside the actor (the critic, PRIME's PRM)."""
    ws = world_size or actor.world_size
    if placement == "colocated" and ws != actor.world_size:
        yield (
            f"{section}.world_size={ws} must equal actor.world_size={actor.world_size} when "
            f"{section}.placement=colocated (it shares the actor's bundles); set "
            f"{section}.placement=split or drop {section}.world_size"
        )
    if backend == "local" and placement == "split":
        yield (
            f"trainer.backend=local runs one rank in-process; set {section}.placement=colocated "
            "or use trainer.backend=ray"
        )
    mini = mini_batch_size or actor.ppo_mini_batch_size
    same_as_actor = mini_batch_size is None and ws == actor.world_size
    if not same_as_actor and (samples % mini or mini % ws):  # else the actor's rule says it
        yield (
            f"{section}.{mini_key}={mini} must divide data.batch_size x rollout.n = "
            f"{samples} and be divisible by the {what}'s world size {ws}"
        )


# --- registered names (treadle check, the trainers' start) ------------------------------------


def check_algorithm(cfg: Sections, kind: Kind) -> None:
    """Registered names and the rules between them (ConfigError listing every problem), after
    ``algorithm.plugins`` are imported (they register names)."""
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
    if kind in ("train", "distill"):
        problems += _rl_kind_problems(cfg, kind)
    if kind in NOT_RL:
        problems += _other_kind_problems(cfg, kind)
    problems += vision_language_problems(cfg, kind)
    if problems:
        raise ConfigError("\n".join(problems))


def _other_kind_problems(cfg: Sections, kind: Kind) -> list[str]:
    """The rules of sft, dpo, kto and rm: the preference loss's knobs, the data they read, and
    no setting they never read (:func:`unread_settings`)."""
    problems = []
    if kind == "dpo" and cfg.dpo.loss_type in algorithms.PREFERENCE_LOSSES:
        problems += _preference_knobs(cfg, algorithms.PREFERENCE_LOSSES.info(cfg.dpo.loss_type))
    if kind == "kto" and cfg.data.batch_size < 2:
        problems.append(
            f"data.batch_size={cfg.data.batch_size}: KTO estimates its reference point from "
            "the other examples of a batch: set data.batch_size to 2 or more"
        )
    if kind in ("dpo", "kto", "rm") and cfg.data.source != "files":
        problems.append(
            f"data.source={cfg.data.source} gives prompts (train, sft, eval), not the "
            f"preference pairs or examples {kind} reads: set data.source=files"
        )
    elif kind in ("dpo", "kto") and getattr(cfg, kind).eval_task and not cfg.data.val_files:
        problems.append(f"{kind}.eval_task=true needs data.val_files (held-out prompts)")
    return problems + list(unread_settings(cfg, kind))


def _vision_config(path: str) -> bool:
    """Whether the model folder at ``path`` (or a checkpoint's ``model/``) has a config.json
    with a ``vision_config``; False for what is no such folder (the model checks report it)."""
    for file in (Path(path) / "config.json", Path(path) / "model" / "config.json"):
        try:
            return "vision_config" in json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError):
            continue
    return False


def vision_language_problems(cfg: Sections, kind: Kind) -> list[str]:
    """What a vision-language ``model.path`` (its config.json has a ``vision_config``) does not
    go with: pictures reach the actor, its reference and either rollout engine (transformers,
    vLLM); value models, LoRA and the pair/example readers take none."""
    if not _vision_config(cfg.model.path):
        return []
    vlm = "model.path is a vision-language model"
    problems = []
    if cfg.actor.lora.rank:
        problems.append(f"actor.lora.rank={cfg.actor.lora.rank}: {vlm}; train it fully (0)")
    for key in ("tensor_parallel_size", "sequence_parallel_size"):
        if getattr(cfg.actor, key) > 1:
            problems.append(
                f"actor.{key}={getattr(cfg.actor, key)}: {vlm}; its layers are trained data "
                "parallel only (FSDP2): set it to 1"
            )
    if kind == "train" and uses_critic(cfg):
        problems.append(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}: {vlm}; "
            "its critic would not see the pictures: use grpo, rloo, reinforce_pp ..."
        )
    if kind in ("dpo", "kto", "rm", "distill"):
        problems.append(f"treadle {kind}: {vlm}; images go with train, sft and eval only")
    return problems


# --- settings the command never reads (check_algorithm for sft, dpo, kto, rm) ----------------

NOT_RL: tuple[Kind, ...] = ("sft", "dpo", "kto", "rm")  # one optimizer step a batch, no RL
RL = "treadle train/distill"
EVALUATIONS = (
    "treadle train/distill/eval, and by sft with a validation set and dpo/kto with eval_task"
)


def evaluates_sets(cfg: Sections, kind: Kind) -> bool:
    """Whether ``kind`` (sft, dpo, kto or rm) generates on the validation sets and scores
    them: sft when it has one, dpo and kto with ``<kind>.eval_task``, rm never (it scores
    held-out pairs)."""
    if kind in ("dpo", "kto"):
        return bool(getattr(cfg, kind).eval_task)
    return kind == "sft" and bool(cfg.data.set_names)


def _readers(cfg: Sections, kind: Kind) -> list[tuple[str, tuple[str, ...] | None, str, bool]]:
    """(section, its keys (None: all of them), the commands that read them, whether ``kind``
    reads them with this config), for the settings some of sft, dpo, kto and rm never read.
    Every other setting is read by all of them (the data, model, actor and trainer sections,
    the rollout engine's settings: sft, dpo and kto generate for evaluations; the tokens a
    response may have, rollout.max_new_tokens, limit the length of every command's data; how
    a reward is called, reward.num_workers and timeout_s, is left to a config shared by
    several commands)."""
    evaluates = evaluates_sets(cfg, kind)
    # An agent talking to the endpoint samples as rollout's sampling says, in evaluations too
    endpoint = evaluates and cfg.rollout.agent_loop != "single_turn"
    return [
        ("algorithm", None, RL, False),
        ("critic", None, "treadle train (an estimator with a critic)", False),
        ("prime", None, "treadle train (algorithm.adv_estimator=prime)", False),
        ("teacher", None, "treadle distill", False),
        ("distill", None, "treadle distill", False),
        ("async", None, RL, False),
        ("dpo", None, "treadle dpo", kind == "dpo"),
        ("kto", None, "treadle kto", kind == "kto"),
        ("rollout", ("n", "ignore_eos"), f"{RL} (an evaluation samples as eval.* says)", False),
        ("rollout", ("temperature", "top_p", "top_k"), f"{RL} (an evaluation: eval.*)", endpoint),
        ("reward", ("model_path", "micro_batch_size", "overlong_buffer_len"), RL, False),
        ("reward", ("overlong_penalty",), RL, False),
        ("reward", ("function",), EVALUATIONS, evaluates),
        ("eval", None, EVALUATIONS, evaluates),
    ]


def unread_settings(cfg: Sections, kind: Kind) -> Iterator[str]:
    """Settings changed from their defaults that ``kind`` (sft, dpo, kto or rm) never reads
    (:func:`_readers`): they would be silently ignored. One line for each group of them."""
    for section, keys, readers, read in _readers(cfg, kind):
        if read:
            continue
        settings = getattr(cfg, "async_" if section == "async" else section)
        names = [k for k in keys or type(settings).model_fields if k != "plugins"]
        changed = _changed_settings(section, settings, names)
        if not changed:
            continue
        it = "it" if len(changed) == 1 else "them"
        verb = "is" if len(changed) == 1 else "are"
        why = _no_evaluation(kind, it) if readers == EVALUATIONS else f"not by treadle {kind}"
        end = "" if readers == EVALUATIONS else f": remove {it}"
        yield f"{', '.join(changed)} {verb} read by {readers}, {why}{end}"


def _no_evaluation(kind: Kind, it: str) -> str:
    """Why ``kind`` does not evaluate with this config, and what to do."""
    if kind == "rm":
        return f"not by treadle rm (it scores held-out pairs, generating nothing): remove {it}"
    if kind == "sft":
        return (
            f"not by this treadle sft, which has no validation set: remove {it}, or set "
            "data.val_files"
        )
    return f"not by treadle {kind} without {kind}.eval_task=true: remove {it}, or set that"


def _changed_settings(section: str, settings: Any, keys: Sequence[str]) -> list[str]:
    """``section.key=value`` of each of ``keys`` that ``settings`` sets away from its default."""
    default = type(settings).model_validate({})
    return [
        f"{section}.{k}={_shown(getattr(settings, k))}"
        for k in keys
        if getattr(settings, k) != getattr(default, k)
    ]


def _shown(value: Any) -> str:
    """A setting's value as the YAML gives it (null, true) or as Python writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if hasattr(value, "model_dump"):
        return str(value.model_dump(mode="json"))
    return str(value)


def _mini_batches(cfg: Sections) -> Iterator[str]:
    """PPO's mini-batches cut an RL batch (sft, dpo, kto and rm take one optimizer step a
    batch and read neither rollout.n nor this: the rule once refused their batch sizes)."""
    samples = cfg.data.batch_size * cfg.rollout.n
    mini, ws = cfg.actor.ppo_mini_batch_size, cfg.actor.world_size
    if samples % mini:
        yield (
            f"actor.ppo_mini_batch_size={mini} must divide data.batch_size x rollout.n = {samples}"
        )
    if mini % ws:
        yield f"actor.ppo_mini_batch_size={mini} must be divisible by actor.world_size={ws}"


def _rl_kind_problems(cfg: Sections, kind: Kind) -> list[str]:
    """The rules of ``train`` and ``distill``: the policy loss's (distill: reverse_kl's), the
    roles', and a teacher only where it is read."""
    problems = list(_mini_batches(cfg))
    if kind == "train" or cfg.distill.loss == "reverse_kl":
        estimator = kind == "train" or cfg.distill.task_reward
        problems += [*_estimator_rules(cfg, estimator), *_loss_rules(cfg)]
        problems += _algorithm_knobs(cfg, algorithms.POLICY_LOSSES, algorithms.LOSS_AGG_MODES)
    problems += role_problems(cfg)
    if kind == "distill":
        problems += _distill_problems(cfg)
    elif cfg.teacher.model_path or cfg.distill != DistillConfig.model_validate({}):
        problems.append(
            "the config sets a teacher or the 'distill' section, which are for `treadle "
            "distill`; `treadle train` runs RL: run `treadle distill`, or remove them"
        )
    return problems


def _registered_names(cfg: Sections, kind: Kind) -> list[tuple[str, Any, str]]:
    """(config key, registry, name) of every name ``kind`` looks up."""
    alg = cfg.algorithm
    if kind == "distill":
        names = [("distill.loss", algorithms.DISTILL_LOSSES, cfg.distill.loss)]
        return names + (_registered_names(cfg, "train") if cfg.distill.loss == "reverse_kl" else [])
    if kind == "train":
        return [
            ("algorithm.adv_estimator", algorithms.ADV_ESTIMATORS, alg.adv_estimator),
            ("algorithm.policy_loss", algorithms.POLICY_LOSSES, alg.policy_loss),
            ("algorithm.loss_agg_mode", algorithms.LOSS_AGG_MODES, alg.loss_agg_mode),
            ("algorithm.kl_estimator", algorithms.KL_ESTIMATORS, alg.kl_estimator),
            ("algorithm.kl_reward_estimator", algorithms.KL_ESTIMATORS, alg.kl_reward_estimator),
        ]
    if kind == "dpo":
        return [("dpo.loss_type", algorithms.PREFERENCE_LOSSES, cfg.dpo.loss_type)]
    if kind == "kto":
        return [("kto.loss_type", algorithms.UNPAIRED_LOSSES, cfg.kto.loss_type)]
    return []


def _unread_knobs(
    cfg: Sections, section: str, knobs: Any, reads: Any, selector: str, reads_none: str
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


def _algorithm_knobs(cfg: Sections, losses: Any, agg_modes: Any) -> list[str]:
    """The policy loss's and the loss aggregation's knobs (the loss's settings' fields, the
    mode's ``knobs`` registration): another one changed from its default is an error, as is
    a knob that is no ``algorithm`` setting (a plug-in's)."""
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
                f"algorithm.{selector}={chosen} reads knobs ({', '.join(unknown)}) that are not "
                "algorithm settings: name its settings' fields after keys of the algorithm section"
            )
        knobs = {k for k in registry.all_knobs() if k in fields}
        problems += _unread_knobs(cfg, "algorithm", knobs, reads, selector, "no algorithm knob")
    return problems


def _preference_knobs(cfg: Sections, info: dict[str, Any]) -> list[str]:
    """A ``dpo`` knob changed from its default must be one the loss reads (a field of its
    settings); ``positive`` knobs must be > 0; ``nll`` excludes ``nll_coef``."""
    d = cfg.dpo
    reads = set(info.get("knobs", ()))
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


def _estimator_rules(cfg: Sections, runs: bool = True) -> Iterator[str]:
    """What the advantage estimator (and the loss's aggregation) need from the config;
    ``runs``: whether the estimator runs (``treadle distill`` without ``distill.task_reward``
    has the teacher's advantages only)."""
    alg, estimators, losses = cfg.algorithm, algorithms.ADV_ESTIMATORS, algorithms.POLICY_LOSSES
    known = runs and alg.adv_estimator in estimators
    groups = known and estimators.info(alg.adv_estimator).get("groups")
    if groups and cfg.rollout.n < 2:
        yield (
            f"algorithm.adv_estimator={alg.adv_estimator} takes its baseline from a group "
            f"of samples of one prompt, and rollout.n=1 makes groups of one: set rollout.n "
            "to 2 or more, or use an estimator without groups (reinforce_plus_plus, gae)"
        )
    if groups and cfg.rollout.n >= 2 and cfg.rollout.top_k == 1:
        yield (
            f"rollout.top_k=1 is greedy: the rollout.n={cfg.rollout.n} samples of a prompt "
            f"are all the same, so algorithm.adv_estimator={alg.adv_estimator}'s group "
            "baseline makes every advantage 0 and nothing is learned: raise rollout.top_k or "
            "set it to -1 (off)"
        )
    needs = estimators.needs(alg.adv_estimator) if known else ()
    if "reward_components" in needs and not alg.gdpo_reward_keys:
        yield (
            f"algorithm.adv_estimator={alg.adv_estimator} normalizes each component of the "
            "reward on its own: list them in algorithm.gdpo_reward_keys (keys of the dict the "
            "reward function returns, e.g. [format, accuracy])"
        )
    if "reward_components" in needs and cfg.reward.model_path:
        yield (
            f"algorithm.adv_estimator={alg.adv_estimator} normalizes the named components of "
            "reward.function's score, but with reward.model_path the reward model's score "
            "trains: drop reward.model_path or use another estimator"
        )
    old_policy = {"old_log_probs", "sum_pi_squared"} & set(needs)
    if old_policy and cfg.actor.recompute_old_log_probs is False:
        yield (
            f"algorithm.adv_estimator={alg.adv_estimator} reads the old policy's log-probs "
            "before the update, which actor.recompute_old_log_probs=false skips: set it to null"
        )
    if alg.policy_loss in losses:
        allowed = losses.info(alg.policy_loss).get("agg_modes")
        if allowed and alg.loss_agg_mode not in allowed:
            yield (
                f"algorithm.loss_agg_mode={alg.loss_agg_mode} cannot be used with "
                f"algorithm.policy_loss={alg.policy_loss}: choose one of {', '.join(allowed)}"
            )


def _loss_rules(cfg: Sections) -> Iterator[str]:
    """What a policy loss or KL estimator needs from the rest of the config."""
    alg, losses, kl_estimators = cfg.algorithm, algorithms.POLICY_LOSSES, algorithms.KL_ESTIMATORS
    reward_kl = alg.kl_reward_estimator
    if reward_kl in kl_estimators and kl_estimators.info(reward_kl).get("full_vocab"):
        yield (
            f"algorithm.kl_reward_estimator={reward_kl} needs the reference's whole "
            "distribution, which only the actor's update has (the reward is shaped on the "
            "driver from sampled-token log-probs): use it as algorithm.kl_estimator (the KL "
            "loss) and pick a per-token estimator (k1, k3...) for the reward"
        )
    if alg.policy_loss not in losses:
        return
    loss = losses.canonical(alg.policy_loss)
    if loss == "dro" and alg.dro_beta is None:
        yield (
            "algorithm.policy_loss=dro needs algorithm.dro_beta (> 0), the weight of its "
            "log-ratio penalty; it has no default"
        )
    old = losses.info(loss).get("old")
    if old == "rollout_log_probs" and alg.rollout_correction != "none":
        yield (
            f"algorithm.policy_loss={alg.policy_loss} takes the rollout log-probs as the old "
            f"policy and corrects for them itself (algorithm.bypass_*): set "
            f"algorithm.rollout_correction=none (got {alg.rollout_correction})"
        )


# --- roles (role selection; check_algorithm for train) ----------------------------------------


def role_problems(cfg: Sections) -> list[str]:
    """What an RL run's roles refuse: the critic's and PRIME's PRM's rules, a section of
    another command, an estimator that needs the sync mode."""
    if cfg.algorithm.adv_estimator not in algorithms.ADV_ESTIMATORS:
        return []  # the unknown name is reported as such
    return [*_critic_problems(cfg), *_prm_problems(cfg), *_rl_problems(cfg)]


def uses_critic(cfg: Sections) -> bool:
    """Whether the run has a critic: the estimator reads values; ConfigError on a contradiction."""
    _raise_first(_critic_problems(cfg))
    return "values" in _needs(cfg.algorithm.adv_estimator)


def uses_prm(cfg: Sections) -> bool:
    """Whether the run has PRIME's PRM (its estimator reads implicit rewards); ConfigError
    when the config cannot work with it. (The models' vocabularies are the trainer's check.)"""
    _raise_first(_prm_problems(cfg))
    return "implicit_rewards" in _needs(cfg.algorithm.adv_estimator)


def _needs(estimator: str) -> tuple[str, ...]:
    """What the advantage estimator reads besides rewards (``values``, ``implicit_rewards``...)."""
    return tuple(algorithms.ADV_ESTIMATORS.needs(estimator))


def _raise_first(problems: Iterator[str]) -> None:
    for problem in problems:
        raise ConfigError(problem)


def _critic_problems(cfg: Sections) -> Iterator[str]:
    alg, enable = cfg.algorithm, cfg.critic.enable
    needs = "values" in _needs(alg.adv_estimator)
    if needs and enable is False:
        plain = [n for n in algorithms.ADV_ESTIMATORS.names() if "values" not in _needs(n)]
        yield (
            f"algorithm.adv_estimator={alg.adv_estimator} needs a critic's values, but "
            "critic.enable=false: drop critic.enable (a critic starts whenever the estimator "
            f"needs values) or use an estimator without a critic: {', '.join(plain)}"
        )
    if enable and not needs:
        yield (
            f"critic.enable=true, but algorithm.adv_estimator={alg.adv_estimator} does not use "
            "values, so the critic would train for nothing: set algorithm.adv_estimator=gae or "
            "drop critic.enable"
        )
    if cfg.critic.warmup_steps and not needs:
        yield (
            f"critic.warmup_steps={cfg.critic.warmup_steps} holds the actor back while a critic "
            f"warms up, but algorithm.adv_estimator={alg.adv_estimator} has no critic: set "
            "critic.warmup_steps=0"
        )
    if needs or enable:
        return
    default = type(cfg.critic).model_validate({})
    for key, value in cfg.critic:
        if key not in ("enable", "warmup_steps") and value != getattr(default, key):
            yield (
                f"critic.{key}={value} configures the critic, but algorithm.adv_estimator="
                f"{alg.adv_estimator} has no critic (it reads no values): remove critic.{key}, "
                "or set algorithm.adv_estimator=gae"
            )


def _prm_problems(cfg: Sections) -> Iterator[str]:
    alg = cfg.algorithm
    if "implicit_rewards" not in _needs(alg.adv_estimator):
        if cfg.prime != PrimeConfig.model_validate({}):
            yield (
                f"the config sets the 'prime' section, which configures PRIME's implicit PRM, "
                f"but algorithm.adv_estimator={alg.adv_estimator}: set "
                "algorithm.adv_estimator=prime or remove the section"
            )
        return
    if cfg.reward.model_path:
        yield (
            "algorithm.adv_estimator=prime trains its PRM on outcome labels in [0, 1] from "
            "reward.function; a reward model's scores are not such labels: drop "
            "reward.model_path"
        )
    if cfg.reward.overlong_buffer_len:
        yield (
            "algorithm.adv_estimator=prime trains its PRM on outcome labels in [0, 1]; the "
            "over-long penalty would take them below 0: set reward.overlong_buffer_len=0"
        )


def _distill_problems(cfg: Sections) -> Iterator[str]:
    """The rules of ``treadle distill``: a teacher, where it can run, what each loss reads."""
    t, d = cfg.teacher, cfg.distill
    if not t.model_path:
        yield "treadle distill needs a teacher: set teacher.model_path to a model folder"
    if t.engine == "vllm" and t.placement == "colocated":
        yield (
            "teacher.engine=vllm cannot share the actor's processes (one vLLM engine per "
            "process): set teacher.placement=split, or teacher.engine=hf"
        )
    if t.placement == "split" and cfg.trainer.backend == "local":
        yield (
            "trainer.backend=local runs one rank in-process; set teacher.placement=colocated "
            "or use trainer.backend=ray"
        )
    if t.placement == "colocated" and t.replicas not in (None, cfg.actor.world_size):
        yield (
            f"teacher.replicas={t.replicas} must equal actor.world_size={cfg.actor.world_size} "
            "when teacher.placement=colocated (one in each actor rank's process); set "
            "teacher.placement=split or drop teacher.replicas"
        )
    sides = {"values": "a critic", "implicit_rewards": "PRIME's PRM"}
    for need in _needs(cfg.algorithm.adv_estimator):
        if need in sides:
            yield (
                f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs {sides[need]}, "
                "which treadle distill does not train: choose an estimator without one (grpo, "
                "rloo, reinforce_plus_plus, ...)"
            )
    if d.loss == "reverse_kl":
        return
    if cfg.trainer.mode != "sync":
        yield (
            f"distill.loss={d.loss} takes its batch from the teacher or the dataset in the "
            f"step: set trainer.mode=sync (trainer.mode={cfg.trainer.mode} is for reverse_kl)"
        )
    default = type(cfg.algorithm).model_validate({})
    unread = [
        f"algorithm.{key}"
        for key, value in cfg.algorithm
        if key != "plugins" and value != getattr(default, key)
    ]
    if unread:
        yield (
            f"distill.loss={d.loss} trains without the policy loss, so it reads no algorithm "
            f"setting: remove {', '.join(unread)} (or use distill.loss=reverse_kl)"
        )


def _rl_problems(cfg: Sections) -> Iterator[str]:
    alg = cfg.algorithm
    for section, rows in (("dpo", "preference pairs"), ("kto", "unpaired examples")):
        settings = getattr(cfg, section)
        if settings != type(settings).model_validate({}):
            yield (
                f"the config sets the '{section}' section, which is for `treadle {section}` "
                f"({rows}); `treadle train` runs RL: remove the section or run `treadle {section}`"
            )
    if cfg.trainer.mode != "sync" and "baseline_rewards" in _needs(alg.adv_estimator):
        yield (
            f"algorithm.adv_estimator={alg.adv_estimator} needs greedy baselines generated with "
            f"the learner's weights, which trainer.mode={cfg.trainer.mode} does not have; use "
            "trainer.mode=sync"
        )


def check_value_models(cfg: Sections, critic: bool) -> None:
    """The critic's (``critic``: the run has one) and reward model's folders exist and share
    the actor's vocabulary; the reward model is one (a *ForTokenClassification folder)."""
    paths = []
    if critic and cfg.critic.model_path:
        paths.append(("critic.model_path", cfg.critic.model_path))
    if cfg.reward.model_path:
        paths.append(("reward.model_path", cfg.reward.model_path))
    if not paths:
        return
    configs = shared_vocabulary(cfg.model.path, paths, cfg.model.allow_download)
    config = configs.get("reward.model_path")
    arch = (config or {}).get("architectures") or []
    if config and not any(a.endswith("ForTokenClassification") for a in arch):
        raise ConfigError(
            f"reward.model_path: '{cfg.reward.model_path}' is not a reward model (architectures: "
            f"{', '.join(arch) or 'none'}); train one with `treadle rm` (a "
            "*ForTokenClassification folder with one label)"
        )
