"""The RL driver's roles besides the actor: the critic and the reward model (and PRIME's
implicit PRM, planned here, built in :mod:`treadle.trainers.prime`).

Both are value models (``*ForTokenClassification``, one label, see :mod:`treadle.engines.value`)
in worker groups of their own (:class:`~treadle.workers.CriticWorker`,
:class:`~treadle.workers.RewardModelWorker`). This module decides which of them a run has,
checks them at start-up (before Ray or a model starts) and starts their groups.

Choices:

- **Whether there is a critic** follows from the advantage estimator's registration: an
  estimator registered with ``needs=("values",)`` (``gae``) gets one, any other does not.
  ``critic.enable`` may say so explicitly (verl's knob); a contradiction with the estimator is
  a ConfigError saying what to change, as is ``critic.warmup_steps`` without a critic.
- **Placement.** By default the critic and the reward model are colocated on the actor's
  bundles: rank r of each group sits on bundle r and each group reserves an equal share of
  the bundle's CPUs (GPUs), while each process may use all the bundle's threads, since the
  driver calls the groups in turn. ``critic.placement=split`` gives the critic a pool of its
  own; the CPUs are then divided over all actor and critic ranks. The reward model always
  shares the actor's bundles, with the actor's world size.
- **Local mode**: every group is built in the driver's process; the later ones join the
  actor's one-rank process group instead of making their own (see ``Worker``).
- **The critic starts** from ``critic.model_path`` (default ``model.path``: a causal LM gets a
  new value head at zero) or, on resume, from ``<checkpoint>/critic/model``, then its
  optimizer and RNG are restored from ``<checkpoint>/critic/``.
- **The reward model scores the actor's token ids** (same tokenizer assumed), so its
  vocabulary size must equal the actor's, and it must be a value model: a causal LM folder
  there would give a zero head and a reward of 0 for everything, silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.config import Config
from treadle.config.rules import uses_critic
from treadle.controller import WorkerGroup
from treadle.errors import ConfigError
from treadle.models import resolve_model_path
from treadle.rollout.fleet import rollout_cpus
from treadle.trainers.common import Actors, add_group, total_cpus
from treadle.trainers.prime import ImplicitPRM, start_prm, uses_prm
from treadle.workers import CriticWorker, RewardModelWorker


def _model_config(path: str, key: str, allow_download: bool) -> dict[str, Any]:
    """The folder's config.json; empty for a hub id (checked when transformers fetches it)."""
    file = Path(resolve_model_path(path, key=key, allow_download=allow_download)) / "config.json"
    config: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
    return config


def _vocab_size(config: dict[str, Any]) -> int | None:
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return int(size) if size is not None else None


def check_value_models(cfg: Config, critic: bool) -> None:
    """The critic's and reward model's folders exist and share the actor's vocabulary."""
    paths = []
    if critic and cfg.critic.model_path:
        paths.append(("critic.model_path", cfg.critic.model_path))
    if cfg.reward.model_path:
        paths.append(("reward.model_path", cfg.reward.model_path))
    if not paths:
        return
    actor = (
        _model_config(cfg.model.path, "model.path", cfg.model.allow_download)
        if cfg.model.path
        else {}
    )
    actor_vocab = _vocab_size(actor)
    for key, path in paths:
        config = _model_config(path, key, cfg.model.allow_download)
        vocab = _vocab_size(config)
        if vocab and actor_vocab and vocab != actor_vocab:
            raise ConfigError(
                f"{key}: '{path}' has a vocabulary of {vocab} tokens, the actor "
                f"(model.path) {actor_vocab}; it scores the actor's token ids, so it must use "
                "the actor's tokenizer"
            )
        arch = config.get("architectures") or []
        if (
            config
            and key == "reward.model_path"
            and not any(a.endswith("ForTokenClassification") for a in arch)
        ):
            raise ConfigError(
                f"reward.model_path: '{path}' is not a reward model (architectures: "
                f"{', '.join(arch) or 'none'}); train one with `treadle rm` (a "
                "*ForTokenClassification folder with one label)"
            )


@dataclass(frozen=True)
class Layout:
    """Which roles a run has and how the actor's pool is cut for them."""

    critic: bool
    reward_model: bool
    critic_world_size: int
    critic_split: bool
    prm: bool = False  # PRIME's implicit PRM (treadle.trainers.prime)
    prm_world_size: int = 1
    prm_split: bool = False

    @property
    def colocated(self) -> int:
        """Groups sharing the actor's bundles (the actor's included)."""
        return (
            1
            + (self.critic and not self.critic_split)
            + self.reward_model
            + (self.prm and not self.prm_split)
        )

    def cpus_per_rank(self, cfg: Config) -> float | None:
        """A bundle's CPUs: the training side's CPUs (all but a split rollout pool's) over the
        actor's ranks, and the critic's (PRM's) when it has a pool of its own; None: all over
        the actor's ranks."""
        rollout = rollout_cpus(cfg)
        if not self.critic_split and not self.prm_split and not rollout:
            return None
        ranks = cfg.actor.world_size + (self.critic_world_size if self.critic_split else 0)
        ranks += self.prm_world_size if self.prm_split else 0
        return (total_cpus(cfg) - rollout) / ranks


def plan_roles(cfg: Config) -> Layout:
    """Decide and check the roles; raises ConfigError before anything starts."""
    critic = uses_critic(cfg)
    prm = uses_prm(cfg)  # before the reward model's check: PRIME refuses one outright
    check_value_models(cfg, critic)
    return Layout(
        critic=critic,
        reward_model=bool(cfg.reward.model_path),
        critic_world_size=cfg.critic.world_size or cfg.actor.world_size,
        critic_split=critic and cfg.critic.placement == "split",
        prm=prm,
        prm_world_size=cfg.prime.world_size or cfg.actor.world_size,
        prm_split=prm and cfg.prime.placement == "split",
    )


def critic_start(cfg: Config, resumed_from: Path | None) -> str:
    """The folder the critic's weights load from."""
    if resumed_from is None:
        return cfg.critic.model_path or cfg.model.path
    saved = resumed_from / "critic" / "model"
    if not (saved / "config.json").is_file():
        raise ConfigError(
            f"checkpoint {resumed_from} has no critic (no critic/model): it was written by a "
            "run without one; start a new trainer.output_dir, with model.path pointing at it"
        )
    return str(saved)


def start_roles(
    cfg: Config, actors: Actors, layout: Layout, resumed_from: Path | None
) -> tuple[WorkerGroup | None, WorkerGroup | None, ImplicitPRM | None]:
    """(critic group, reward-model group, PRIME's PRM), each None when the run has no such
    role; a split role gets a pool of its own, a colocated one the actors' bundles.

    The groups are registered with ``actors`` and close with them, also when this fails.
    """
    critic = rm = None
    split_cpus = layout.cpus_per_rank(cfg)
    if layout.critic:
        critic = add_group(
            actors,
            cfg,
            CriticWorker,
            {"config": cfg, "critic_path": critic_start(cfg, resumed_from)},
            world_size=layout.critic_world_size,
            own_cpus_per_rank=split_cpus if layout.critic_split else None,
        )
        if resumed_from is not None:
            critic.load_checkpoint(str(resumed_from / "critic"))
    if layout.reward_model:
        rm = add_group(
            actors, cfg, RewardModelWorker, {"config": cfg}, world_size=cfg.actor.world_size
        )
    split = split_cpus if layout.prm_split else None
    return critic, rm, start_prm(cfg, actors, layout.prm, split, resumed_from)
