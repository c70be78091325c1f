"""Name -> function registries for the algorithm zoo.

A config names an algorithm by string (``algorithm.adv_estimator: grpo``); the driver looks the
function up here. Adding a variant is one decorated function in the module that owns its kind:

    @register_adv_estimator("my_estimator")
    def my_estimator(token_level_rewards, response_mask, *, group_ids, **_): ...

A registration may carry facts about the function that the driver needs to build the dataflow,
e.g. ``@register_adv_estimator("gae", needs=("values",))``: the driver starts a critic because
the estimator says it reads values, not because its name is ``gae``. ``groups=True`` marks an
estimator whose baseline is its group (``rollout.n`` samples of one prompt);
``agg_modes=(...)`` lists the loss aggregations a policy loss can be used with (any, if
absent); ``knobs=(...)`` the ``algorithm`` settings a policy loss (or aggregation) reads, which
the actor passes it, no others. Preference losses say ``reference=False`` (no reference model
is built), ``knobs=(...)`` (the ``dpo`` settings they read), ``nll=`` (the chosen NLL they
include), ``batchwise=True``; unpaired losses ``kl=True`` (KTO's reference point). ``treadle
check`` reads these facts.

``REGISTRY.alias("vanilla", "ppo")`` makes a second name for a registered function (verl's
names beside treadle's): it resolves everywhere the name does, facts included.

An unknown name fails with the sorted list of valid names and the closest match, so a typo in a
config says how to fix itself. The ``Protocol`` classes below are the signatures each kind must
follow; mypy checks every registered function against them.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from torch import Tensor

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """A mapping from names to functions of one kind, filled by a ``register`` decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, **info: Any) -> Callable[[F], F]:
        """Decorator: register the function under ``name``; a name can be registered once.

        ``info`` are facts the driver may ask with :meth:`info` (``needs=("values",)``).
        """

        def decorator(fn: F) -> F:
            if name in self._fns or name in self._aliases:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._fns[name] = fn
            self._info[name] = dict(info)
            return fn

        return decorator

    def alias(self, alias: str, name: str) -> None:
        """Make ``alias`` another name of the function registered as ``name``."""
        if alias in self._fns or alias in self._aliases:
            raise ValueError(f"{self.kind} {alias!r} is already registered")
        self.get(name)
        self._aliases[alias] = self._aliases.get(name, name)

    def canonical(self, name: str) -> str:
        """The name a function was registered under (``name`` itself unless an alias)."""
        self.get(name)
        return self._aliases.get(name, name)

    def aliases(self) -> dict[str, str]:
        """``{alias: registered name}``."""
        return dict(self._aliases)

    def info(self, name: str) -> dict[str, Any]:
        """The facts registered with ``name`` (empty if none); unknown names fail as in get."""
        return dict(self._info[self.canonical(name)])

    def needs(self, name: str) -> tuple[str, ...]:
        """Inputs beyond the defaults that ``name`` reads (its ``needs`` registration fact)."""
        return tuple(self.info(name).get("needs", ()))

    def knobs(self, name: str) -> tuple[str, ...]:
        """The settings ``name`` reads (its ``knobs`` registration fact): the caller passes a
        function exactly these, and ``treadle check`` refuses the others changed from their
        defaults."""
        return tuple(self.info(name).get("knobs", ()))

    def all_knobs(self) -> set[str]:
        """Every setting some registered function reads."""
        return {k for info in self._info.values() for k in info.get("knobs", ())}

    def get(self, name: str) -> F:
        """The function registered under ``name``; ``ValueError`` listing valid names if none."""
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
        return sorted([*self._fns, *self._aliases])

    def __contains__(self, name: object) -> bool:
        return name in self._fns or name in self._aliases


class AdvantageEstimator(Protocol):
    """``(token_level_rewards[B,T], response_mask[B,T], *, group_ids, ...) -> (adv, returns)``."""

    def __call__(
        self,
        token_level_rewards: Tensor,
        response_mask: Tensor,
        *,
        group_ids: Sequence[Hashable],
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]: ...


class PolicyLoss(Protocol):
    """``(log_probs, old_log_probs, advantages, response_mask, ...) -> (loss, metrics)``."""

    def __call__(
        self,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        **kwargs: Any,
    ) -> tuple[Tensor, dict[str, float]]: ...


class KLEstimator(Protocol):
    """``(log_probs[B,T], ref_log_probs[B,T]) -> per-token KL estimate [B,T]``."""

    def __call__(self, log_probs: Tensor, ref_log_probs: Tensor) -> Tensor: ...


class LossAggMode(Protocol):
    """``(loss_mat[B,T], mask[B,T], *, num_tokens, num_seqs, norm_constant, dp_size) -> scalar``.

    ``num_tokens`` / ``num_seqs`` are the mini-batch's totals divided by ``dp_size`` (the
    data-parallel ranks, whose gradients are averaged): a mode that needs the plain sum
    (``token-sum``) multiplies by ``dp_size``.
    """

    def __call__(
        self,
        loss_mat: Tensor,
        mask: Tensor,
        *,
        num_tokens: float | Tensor | None,
        num_seqs: float | Tensor | None,
        norm_constant: float | None,
        dp_size: int = 1,
    ) -> Tensor: ...


class PreferenceLoss(Protocol):
    """``(policy_chosen, policy_rejected, ref_chosen, ref_rejected [B], *, beta, ...) -> [B]``.

    Sequence log-probs (summed over response tokens) of each pair in, one loss per pair out;
    the reference's are ``None`` for a loss registered ``reference=False``. Keywords: ``beta``,
    ``chosen_lengths``/``rejected_lengths`` (response tokens ``[B]``) and every ``dpo`` knob
    (``label_smoothing``, ``discopop_tau``, ...): a loss takes the ones it reads and ignores
    the rest (``**_``).
    """

    def __call__(
        self,
        policy_chosen_logps: Tensor,
        policy_rejected_logps: Tensor,
        ref_chosen_logps: Tensor | None,
        ref_rejected_logps: Tensor | None,
        *,
        beta: float,
        **knobs: Any,
    ) -> Tensor: ...


class UnpairedLoss(Protocol):
    """``(policy_logps, ref_logps, labels [B], kl, *, beta, ...) -> [B]`` (KTO and kin).

    One sequence log-prob per example, its label (1: desirable) and the batch's reference
    point ``kl`` (a scalar; 0 for a loss registered without ``kl=True``), one loss out.
    """

    def __call__(
        self,
        policy_logps: Tensor,
        ref_logps: Tensor,
        labels: Tensor,
        kl: Tensor | float,
        *,
        beta: float,
        **knobs: Any,
    ) -> Tensor: ...


ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
LOSS_AGG_MODES: Registry[LossAggMode] = Registry("loss aggregation mode")
PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss")
UNPAIRED_LOSSES: Registry[UnpairedLoss] = Registry("unpaired preference loss")

register_adv_estimator = ADV_ESTIMATORS.register
register_policy_loss = POLICY_LOSSES.register
register_kl_estimator = KL_ESTIMATORS.register
register_loss_agg_mode = LOSS_AGG_MODES.register
register_preference_loss = PREFERENCE_LOSSES.register
register_unpaired_loss = UNPAIRED_LOSSES.register
