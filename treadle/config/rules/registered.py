"""Registered names and the rules that need the registries' facts: ``check_algorithm``.

``treadle check`` and the trainers' start call it after the config loaded; it imports
``algorithm.plugins`` first (under the import time limit: they register names), then looks up
every name the command reads (an unknown one is named with the closest valid one) and holds the
config to what the chosen functions need: a group baseline needs ``rollout.n >= 2``, a loss may
allow only some ``loss_agg_mode`` values, a knob no chosen function reads is an error. For
``train`` and ``distill`` it adds the roles' rules (:mod:`treadle.config.rules.roles`), for sft,
dpo, kto and rm the settings they never read (:mod:`treadle.config.rules.commands`), and for a
vision-language model what does not go with it. Every problem is listed in one ConfigError.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from treadle import algorithms  # the package: importing it registers every built-in name
from treadle.config.distill import DistillConfig
from treadle.config.dpo import DPO_KNOBS
from treadle.config.rules.commands import NOT_RL, RL_KINDS, Kind, unread_settings
from treadle.config.rules.roles import distill_problems, role_problems, uses_critic
from treadle.config.run import Sections
from treadle.config.timeout import IMPORT_TIMEOUT_S, time_limit
from treadle.runtime.errors import ConfigError
from treadle.runtime.plugins import load_plugins


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
    if kind in RL_KINDS:
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
    vLLM; not the hf engine's paged cache); value models, LoRA and the pair/example readers
    take none."""
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
    if cfg.rollout.cache_implementation == "paged":
        problems.append(
            f"rollout.cache_implementation=paged: {vlm}; transformers' continuous batching "
            "takes no pictures: use dynamic or static"
        )
    return problems


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
        problems += distill_problems(cfg)
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
