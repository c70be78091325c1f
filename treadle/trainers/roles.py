"""The roles of a run: the actors' group, and a table of the roles beside it that start-up
loops over: the critic, the reward model and PRIME's implicit PRM (its per-step side is
:mod:`treadle.trainers.prime`); and an LLM judge (``reward.judge``,
:mod:`treadle.rollout.judge`), made when the roles are planned (its folder, tokenizer and
settings checked) and served after them, on the actors' group or in a pool of its own.

The side roles are value models (``*ForTokenClassification``, one label, see
:mod:`treadle.engines.value`) in worker groups of their own. A row of :data:`SIDE_ROLES` says
when a run has the role, its ranks, whether it has a pool of its own, where its weights
start and where it resumes from; :func:`plan_roles` decides and checks them before Ray or a
model starts, and :func:`start_roles` starts them, in the table's order.

Choices:

- **Whether there is a critic** follows from the advantage estimator's registration: an
  estimator registered with ``needs=("values",)`` (``gae``) gets one, any other does not.
  ``critic.enable`` may say so explicitly (verl's knob); a contradiction with the estimator is
  a ConfigError saying what to change, as is ``critic.warmup_steps`` without a critic. PRIME's
  PRM likewise follows from ``needs=("implicit_rewards",)``.
- **Placement** (:class:`~treadle.controller.Placement`). By default every side role is
  colocated on the actor's bundles: rank r of each group sits on bundle r and each group
  reserves an equal share of the bundle's CPUs (GPUs), while each process may use all the
  bundle's threads, since the driver calls the groups in turn. ``critic.placement=split``
  (``prime.placement=split``) gives the role a pool of its own; the CPUs are then divided over
  all actor and split ranks. The reward model always shares the actor's bundles, with the
  actor's world size.
- **Local mode**: every group is built in the driver's process; the later ones join the
  actor's one-rank process group instead of making their own (see ``Worker``).
- **A trained role starts** from its ``model_path`` (default ``model.path``: a causal LM gets
  a new value head at zero) or, on resume, from ``<checkpoint>/<name>/model``, then its
  optimizer and RNG are restored from ``<checkpoint>/<name>/``. The reward model is frozen:
  not in checkpoints.
- **The reward model scores the actor's token ids** (same tokenizer assumed), so its
  vocabulary size must equal the actor's, and it must be a value model: a causal LM folder
  there would give a zero head and a reward of 0 for everything, silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from treadle.config import Config
from treadle.config.rules import check_value_models, uses_critic
from treadle.controller import Actors, Placement, Worker, WorkerGroup, start_group
from treadle.rollout.fleet import rollout_cpus
from treadle.rollout.judge import LLMJudge, judge_cpus, make_judge
from treadle.rollout.teacher import teacher_cpus
from treadle.runtime.errors import ConfigError
from treadle.trainers.prime import uses_prm
from treadle.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker
from treadle.workers.prm import ImplicitPRMWorker


def build_actors(
    cfg: Config,
    actor_path: str,
    with_ref: bool,
    placement: Placement | None = None,
    optimizer_steps: int = 0,
    wait: bool = True,
) -> Actors:
    """The actor+rollout+reference group, starting from the weights at ``actor_path``, placed
    as ``placement`` says (default: alone on all the run's CPUs); ``optimizer_steps``: the
    run's, where a decaying ``actor.lr_schedule`` ends (0: a group that does not train);
    ``wait=False``: not waited for (:meth:`~treadle.controller.Actors.ready`)."""
    kwargs = {"actor_path": actor_path, "with_ref": with_ref, "optimizer_steps": optimizer_steps}
    placement = placement or Placement.plan(cfg)
    return start_group(cfg, placement, ActorRolloutRefWorker, kwargs, wait)


class RoleSection(Protocol):
    """A trained side role's config section (``critic``, ``prime``)."""

    model_path: str | None
    placement: Literal["colocated", "split"]
    world_size: int | None


@dataclass(frozen=True)
class SideRole:
    """A row of the table: a role beside the actor with a worker group of its own."""

    name: str  # the driver's key for its group, and its folder in a checkpoint
    worker: type[Worker]
    used: Callable[[Config], bool]  # whether a run has it; ConfigError on a contradiction
    # its config section (ranks, placement, start weights); None: the frozen reward model's
    # (the actor's ranks, on the actor's bundles, not in checkpoints)
    section: Callable[[Config], RoleSection] | None = None
    weights: str = ""  # the worker's keyword for the folder its weights start from
    missing: str = ""  # what a checkpoint without it is told

    @property
    def saved(self) -> bool:
        """Whether checkpoints hold it (in ``<checkpoint>/<name>/``)."""
        return self.section is not None

    def world_size(self, cfg: Config) -> int:
        section = self.section(cfg) if self.section else None
        return (section.world_size if section else None) or cfg.actor.world_size

    def split(self, cfg: Config) -> bool:
        """Whether it has a pool of its own (else the actors' bundles)."""
        return self.section is not None and self.section(cfg).placement == "split"

    def start_path(self, cfg: Config, resumed_from: Path | None) -> str:
        """The folder its weights load from: its ``model_path`` (default ``model.path``) or,
        on resume, the checkpoint's ``<name>/model``."""
        assert self.section is not None
        if resumed_from is None:
            return self.section(cfg).model_path or cfg.model.path
        saved = resumed_from / self.name / "model"
        if not (saved / "config.json").is_file():
            raise ConfigError(f"checkpoint {resumed_from} {self.missing}")
        return str(saved)


SIDE_ROLES: tuple[SideRole, ...] = (
    SideRole(
        "critic",
        CriticWorker,
        uses_critic,
        section=lambda cfg: cfg.critic,
        weights="critic_path",
        missing="has no critic (no critic/model): it was written by a run without one; start "
        "a new trainer.output_dir, with model.path pointing at it",
    ),
    SideRole("reward_model", RewardModelWorker, lambda cfg: bool(cfg.reward.model_path)),
    SideRole(
        "prm",
        ImplicitPRMWorker,
        uses_prm,  # before the reward model's check: PRIME refuses one outright
        section=lambda cfg: cfg.prime,
        weights="prm_path",
        missing="has no PRIME PRM (no prm/model): it was written by a run without "
        "algorithm.adv_estimator=prime; start a new trainer.output_dir",
    ),
)


@dataclass(frozen=True)
class Planned:
    """A side role a run has: its ranks, and whether it has a pool of its own."""

    role: SideRole
    world_size: int
    split: bool


@dataclass(frozen=True)
class Layout:
    """The side roles a run has, in start order, and how the actor's pool is cut for them."""

    roles: tuple[Planned, ...] = ()
    judge: LLMJudge | None = None  # reward.judge: made when planned, served by start_roles

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.role.name for p in self.roles)

    @property
    def colocated(self) -> int:
        """Groups sharing the actor's bundles (the actor's included)."""
        return 1 + sum(not p.split for p in self.roles)

    def placement(self, cfg: Config) -> Placement:
        """The run's placement: the training side's CPUs (all but a split rollout pool's, a
        split teacher's and a split judge's) over the actor's ranks and every split role's."""
        split_ranks = sum(p.world_size for p in self.roles if p.split)
        reserved = rollout_cpus(cfg) + teacher_cpus(cfg) + judge_cpus(cfg)
        return Placement.plan(cfg, self.colocated, split_ranks, reserved)


def plan_roles(cfg: Config) -> Layout:
    """Decide and check the side roles; raises ConfigError before anything starts."""
    used = [role for role in SIDE_ROLES if role.used(cfg)]
    check_value_models(cfg, critic=any(role.name == "critic" for role in used))
    planned = tuple(Planned(r, r.world_size(cfg), r.split(cfg)) for r in used)
    return Layout(planned, make_judge(cfg))


def start_roles(
    cfg: Config, actors: Actors, layout: Layout, resumed_from: Path | None
) -> dict[str, WorkerGroup]:
    """The side roles' groups by name, each restored from ``resumed_from`` when it is in
    checkpoints; a split role gets a pool of its own, a colocated one the actors' bundles.
    Then the judge is served (closed by the scorer that holds it).

    The groups are registered with ``actors`` and close with them, also when this fails.
    """
    groups = {}
    for p in layout.roles:
        role = p.role
        kwargs: dict[str, Any] = {"config": cfg}
        if role.saved:
            kwargs[role.weights] = role.start_path(cfg, resumed_from)
        group = actors.add(role.worker, kwargs, p.world_size, p.split)
        if resumed_from is not None and role.saved:
            group.load_checkpoint(str(resumed_from / role.name))
        groups[role.name] = group
    if layout.judge is not None:
        layout.judge.start(actors.group)
    return groups
