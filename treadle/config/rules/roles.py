"""Role selection: whether an RL run has a critic or PRIME's PRM, and what its roles refuse.

``uses_critic`` and ``uses_prm`` answer from the advantage estimator's needs (its registry
entry) and raise ConfigError on a config that contradicts it; ``role_problems``, which
``check_algorithm`` runs for ``train``, lists the same rules, so ``treadle check`` says them
first. Also here: the rules of ``treadle distill``'s teacher, and the value models' folders
(``check_value_models``: the critic's and reward model's share the actor's vocabulary, the
reward model is one), read from their config.json files alone, for ``treadle check`` and the
trainers' role plan.
"""

from __future__ import annotations

from collections.abc import Iterator

from treadle import algorithms  # the package: importing it registers every built-in name
from treadle.config.prime import PrimeConfig
from treadle.config.rules.placement import check_frozen
from treadle.config.run import Sections
from treadle.models.folders import shared_vocabulary
from treadle.runtime.errors import ConfigError


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


def distill_problems(cfg: Sections) -> Iterator[str]:
    """The rules of ``treadle distill``: a teacher, where it can run, what each loss reads."""
    t, d = cfg.teacher, cfg.distill
    if not t.model_path:
        yield "treadle distill needs a teacher: set teacher.model_path to a model folder"
    yield from check_frozen("teacher", t, cfg)
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
