"""Name -> function registries for the algorithm zoo.

A config names an algorithm by string (``algorithm.adv_estimator: grpo``); the driver looks the
function up here. Adding a variant is one decorated function in the module that owns its kind,
taking that kind's inputs record and its own settings (:mod:`treadle.algorithms.inputs`):

    @register_adv_estimator("my_estimator")
    def my_estimator(inputs: EstimatorInputs, settings: NoSettings): ...

A registration may carry facts about the function that the driver needs to build the dataflow,
e.g. ``@register_adv_estimator("gae", needs=("values",))``: the driver starts a critic because
the estimator says it reads values, not because its name is ``gae``. ``groups=True`` marks an
estimator whose baseline is its group (``rollout.n`` samples of one prompt);
``agg_modes=(...)`` lists the loss aggregations a policy loss can be used with (any, if
absent); ``advantage_scaled=True`` says that each row's policy loss is its advantages times
something finite that depends on no other row, so a row whose advantages are all zero has
exactly zero gradient and the actor's update may leave it out (``actor.skip_zero_advantage``).
``settings=`` is the function's settings class, a frozen dataclass: its fields are the
knobs the function reads (``knobs(name)``, the config settings of the same names, which the
caller passes it, no others; a registry's ``shared`` fields, DPO's ``beta``, every function
reads and are not counted). An aggregation mode lists its knobs as ``knobs=(...)``.
Distillation losses say what the teacher supplies as ``needs`` and ``nll=1.0`` when the loss
is the SFT objective's NLL (``seq_kd``).
Preference losses say ``reference=False`` (no reference model is built), ``nll=`` (the chosen
NLL they include), ``batchwise=True``; unpaired losses ``kl=True`` (KTO's reference point).
``treadle check`` reads these facts. Each is a keyword of ``register``: a misspelt one is a
``TypeError``, as is a name a settings class or an inputs record does not have.

``REGISTRY.alias("vanilla", "ppo")`` makes a second name for a registered function (verl's
names beside treadle's): it resolves everywhere the name does, facts included.

An unknown name fails with the sorted list of valid names and the closest match, so a typo in a
config says how to fix itself. The ``Protocol`` classes below are the signatures each kind must
follow; mypy checks every registered function against them.

The built-in functions register when their modules (``BUILTIN_MODULES``, which import torch)
are imported, and that happens on first need: asking a registry for a function (``get``,
``settings``) or registering one imports them all. Its names and facts alone (``names``, ``in``,
``info``, ``knobs``, ...: what ``treadle check`` and config validation ask) are read from
``builtin_facts.json`` beside this module, the record of the built-ins' registrations (``make
facts`` writes it again; a test holds it to the live registries), so a check does not import
torch; once the modules are imported the live registries answer.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from torch import Tensor

    from treadle.algorithms import inputs as records

F = TypeVar("F", bound=Callable[..., Any])

# the modules whose imports register the built-in functions
BUILTIN_MODULES = ("advantages", "distill", "kl", "losses", "preference", "prime")
_loaded = False  # BUILTIN_MODULES imported (or being imported)


# the registration facts left at these values are not recorded (``info`` lacks them)
_UNSET_FACTS: dict[str, Any] = {
    "knobs": (),
    "needs": (),
    "groups": False,
    "agg_modes": (),
    "old": None,
    "full_vocab": False,
    "reference": True,
    "nll": 0.0,
    "positive": (),
    "batchwise": False,
    "kl": False,
    "advantage_scaled": False,
}


class Registry(Generic[F]):
    """A mapping from names to functions of one kind, filled by a ``register`` decorator."""

    def __init__(self, kind: str, shared: tuple[str, ...] = (), *, builtin: bool = False) -> None:
        self.kind = kind
        self.shared = shared  # settings every function of the kind reads (not knobs)
        self.builtin = builtin  # filled by BUILTIN_MODULES: facts from their record until loaded
        self._fns: dict[str, F] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._settings: dict[str, type[Any]] = {}
        self._aliases: dict[str, str] = {}

    def register(
        self,
        name: str,
        *,
        settings: type | None = None,
        knobs: tuple[str, ...] = (),
        needs: tuple[str, ...] = (),
        groups: bool = False,
        agg_modes: tuple[str, ...] = (),
        old: str | None = None,
        full_vocab: bool = False,
        reference: bool = True,
        nll: float = 0.0,
        positive: tuple[str, ...] = (),
        batchwise: bool = False,
        kl: bool = False,
        advantage_scaled: bool = False,
    ) -> Callable[[F], F]:
        """Decorator: register the function under ``name``; a name can be registered once.

        The keywords are facts the driver may ask with :meth:`info` (``needs=("values",)``),
        described in the module; those left at their defaults are not recorded.
        """
        load_builtins()  # a built-in name registered again is refused, as it always was
        if settings is not None:
            if knobs:
                raise ValueError(f"{self.kind} {name!r}: its settings' fields are its knobs")
            fields = dataclasses.fields(settings)
            knobs = tuple(f.name for f in fields if f.name not in self.shared)
        facts: dict[str, Any] = {
            "knobs": knobs,
            "needs": needs,
            "groups": groups,
            "agg_modes": agg_modes,
            "old": old,
            "full_vocab": full_vocab,
            "reference": reference,
            "nll": nll,
            "positive": positive,
            "batchwise": batchwise,
            "kl": kl,
            "advantage_scaled": advantage_scaled,
        }
        info = {k: v for k, v in facts.items() if v != _UNSET_FACTS[k]}

        def decorator(fn: F) -> F:
            from treadle.algorithms.inputs import NoSettings

            if name in self._fns or name in self._aliases:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._fns[name] = fn
            self._info[name] = dict(info)
            self._settings[name] = NoSettings if settings is None else settings
            return fn

        return decorator

    def alias(self, alias: str, name: str) -> None:
        """Make ``alias`` another name of the function registered as ``name``."""
        load_builtins()
        if alias in self._fns or alias in self._aliases:
            raise ValueError(f"{self.kind} {alias!r} is already registered")
        self.get(name)
        self._aliases[alias] = self._aliases.get(name, name)

    def canonical(self, name: str) -> str:
        """The name a function was registered under (``name`` itself unless an alias)."""
        info, aliases = self._facts()
        if name not in info and name not in aliases:
            self.get(name)  # the error naming the valid names
        return aliases.get(name, name)

    def aliases(self) -> dict[str, str]:
        """``{alias: registered name}``."""
        return dict(self._facts()[1])

    def info(self, name: str) -> dict[str, Any]:
        """The facts registered with ``name`` (empty if none); unknown names fail as in get."""
        return dict(self._facts()[0][self.canonical(name)])

    def needs(self, name: str) -> tuple[str, ...]:
        """Inputs beyond the defaults that ``name`` reads (its ``needs`` registration fact)."""
        return tuple(self.info(name).get("needs", ()))

    def knobs(self, name: str) -> tuple[str, ...]:
        """The settings ``name`` reads (its ``knobs`` registration fact): the caller passes a
        function exactly these, and ``treadle check`` refuses the others changed from their
        defaults."""
        return tuple(self.info(name).get("knobs", ()))

    def settings(self, name: str) -> type[Any]:
        """``name``'s settings class (a frozen dataclass; ``NoSettings`` if it registered none):
        ``POLICY_LOSSES.settings("ppo")(clip_ratio_c=3.0)``; a name it does not take is a
        ``TypeError``."""
        load_builtins()
        return self._settings[self.canonical(name)]

    def settings_from(self, name: str, source: object) -> Any:
        """``name``'s settings with its knobs and the ``shared`` fields read from the
        attributes of the same names of ``source`` (a config section), and no others."""
        keys = (*self.shared, *self.knobs(name))
        return self.settings(name)(**{key: getattr(source, key) for key in keys})

    def all_knobs(self) -> set[str]:
        """Every setting some registered function reads."""
        return {k for info in self._facts()[0].values() for k in info.get("knobs", ())}

    def get(self, name: str) -> F:
        """The function registered under ``name``; ``ValueError`` listing valid names if none."""
        if self.builtin:
            load_builtins()
        if name in self._fns:
            return self._fns[name]
        if name in self._aliases:
            return self._fns[self._aliases[name]]
        message = f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}"
        close = difflib.get_close_matches(name, self.names(), n=1)
        if close:
            message += f" (did you mean {close[0]!r}?)"
        raise ValueError(message)

    def names(self) -> list[str]:
        """Registered names and aliases, sorted."""
        info, aliases = self._facts()
        return sorted([*info, *aliases])

    def __contains__(self, name: object) -> bool:
        info, aliases = self._facts()
        return name in info or name in aliases

    def _facts(self) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """``(facts by registered name, aliases)``: the live ones, or (built-ins not imported
        yet) the record of their registrations."""
        if _loaded or not self.builtin:
            return self._info, self._aliases
        record = _builtin_record()[self.kind]
        return record["info"], record["aliases"]

    def _record(self) -> dict[str, Any]:
        """The registrations as JSON (:func:`_builtin_record`)."""
        return {"info": self._info, "aliases": self._aliases}


def load_builtins() -> None:
    """Import the modules that register the built-in functions (once)."""
    global _loaded
    if not _loaded:
        _loaded = True  # (their registrations call this again)
        for module in BUILTIN_MODULES:
            importlib.import_module(f"treadle.algorithms.{module}")


FACTS_FILE = Path(__file__).with_name("builtin_facts.json")
_RECORD: dict[str, dict[str, Any]] = {}


def _builtin_record() -> dict[str, dict[str, Any]]:
    """``{kind: {"info": ..., "aliases": ...}}`` of every built-in registry as the built-in
    modules register them, read from :data:`FACTS_FILE`."""
    if not _RECORD:
        _RECORD.update(_with_tuples(json.loads(FACTS_FILE.read_text(encoding="utf-8"))))
    return _RECORD


def live_record() -> dict[str, dict[str, Any]]:
    """The built-in registries' record as their modules register them (imports them)."""
    load_builtins()
    return {r.kind: r._record() for r in REGISTRIES}


def write_builtin_facts() -> None:
    """Write :data:`FACTS_FILE` from the live registries (``make facts``)."""
    text = json.dumps(live_record(), indent=1, sort_keys=True)
    FACTS_FILE.write_text(text + "\n", encoding="utf-8")


def _with_tuples(record: dict[str, Any]) -> dict[str, Any]:
    """The facts read back from JSON with their tuples (JSON lists) as tuples again."""
    return {
        kind: {
            "info": {
                name: {k: tuple(v) if isinstance(v, list) else v for k, v in facts.items()}
                for name, facts in r["info"].items()
            },
            "aliases": r["aliases"],
        }
        for kind, r in record.items()
    }


class AdvantageEstimator(Protocol):
    """``(EstimatorInputs, settings) -> (advantages[B,T], returns[B,T])``."""

    def __call__(
        self, inputs: records.EstimatorInputs, settings: Any, /
    ) -> tuple[Tensor, Tensor]: ...


class PolicyLoss(Protocol):
    """``(PolicyLossInputs, settings) -> (loss, metrics)``."""

    def __call__(
        self, inputs: records.PolicyLossInputs, settings: Any, /
    ) -> tuple[Tensor, dict[str, float]]: ...


class KLEstimator(Protocol):
    """``(log_probs[B,T], ref_log_probs[B,T]) -> per-token KL estimate [B,T]``."""

    def __call__(self, log_probs: Tensor, ref_log_probs: Tensor) -> Tensor: ...


class LossAggMode(Protocol):
    """``(loss_mat[B,T], mask[B,T], Aggregation) -> scalar``.

    The aggregation's ``num_tokens`` / ``num_seqs`` are the mini-batch's totals divided by
    ``dp_size`` (the data-parallel ranks, whose gradients are averaged): a mode that needs the
    plain sum (``token-sum``) multiplies by ``dp_size``.
    """

    def __call__(self, loss_mat: Tensor, mask: Tensor, agg: records.Aggregation, /) -> Tensor: ...


class PreferenceLoss(Protocol):
    """``(PairInputs, settings) -> [B]``: one loss per pair; ``settings.beta`` is ``dpo.beta``,
    the other fields the ``dpo`` knobs the loss reads."""

    def __call__(self, inputs: records.PairInputs, settings: Any, /) -> Tensor: ...


class UnpairedLoss(Protocol):
    """``(UnpairedInputs, settings) -> [B]`` (KTO and kin): one loss per example."""

    def __call__(self, inputs: records.UnpairedInputs, settings: Any, /) -> Tensor: ...


# A distillation loss's signature is its own (one per kind of teacher signal: advantages from
# the teacher's log-probs, a divergence over its top-k, the NLL of its samples): see
# treadle.algorithms.distill; the driver calls each with what its registration ``needs``.
DistillLoss = Callable[..., "Tensor"]

ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", builtin=True)
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", builtin=True)
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", builtin=True)
LOSS_AGG_MODES: Registry[LossAggMode] = Registry("loss aggregation mode", builtin=True)
PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry(
    "preference loss", shared=("beta",), builtin=True
)
UNPAIRED_LOSSES: Registry[UnpairedLoss] = Registry(
    "unpaired preference loss", shared=("beta",), builtin=True
)
DISTILL_LOSSES: Registry[DistillLoss] = Registry("distillation loss", builtin=True)
REGISTRIES: tuple[Registry[Any], ...] = (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    PREFERENCE_LOSSES,
    UNPAIRED_LOSSES,
    DISTILL_LOSSES,
)

register_adv_estimator = ADV_ESTIMATORS.register
register_policy_loss = POLICY_LOSSES.register
register_kl_estimator = KL_ESTIMATORS.register
register_loss_agg_mode = LOSS_AGG_MODES.register
register_preference_loss = PREFERENCE_LOSSES.register
register_unpaired_loss = UNPAIRED_LOSSES.register
register_distill_loss = DISTILL_LOSSES.register
