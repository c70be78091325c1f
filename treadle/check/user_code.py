"""User code a run imports: the reward functions (``reward.function``, the validation sets'),
the agent loop (an environment's factory, a black-box agent), the tools, the plug-ins, and the
endpoint's parsers.

Each is imported as the run will import it, within ``IMPORT_TIMEOUT_S`` seconds, through
:func:`import_user_code` alone: its module is tried in a child process first
(``probe_import``: a hang no signal interrupts, such as one in C, or an ``os._exit``), then
imported here, where an import that blocks is interrupted with SIGALRM, in the main thread
(``time_limit``). The limit is read here alone: a test lowers it on this module. A reward
function that loaded is kept (:func:`load_reward`) so that the data checks can read which row
columns a batched one is called with (:func:`reward_columns`) without importing it again. The
parsers are names vLLM registers; the defaults are known without importing vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from treadle.check.judge import check_judge
from treadle.config import Config
from treadle.config.rules import RL_KINDS, Kind, check_algorithm
from treadle.config.timeout import time_limit
from treadle.runtime.errors import TreadleError
from treadle.runtime.plugins import probe_import

T = TypeVar("T")

# The check's limit on one import of user code (in the child, then here): below the run's own
# (treadle.config.timeout, 60 s), so that a check whose user code hangs still answers within a
# minute (one was killed at 60 s, its answer due at 60.5).
IMPORT_TIMEOUT_S = 40.0


def check_user_code(cfg: Config, kind: Kind, summary: list[str], problems: list[str]) -> Any:
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
            import_user_code(spec, "reward.function", lambda: load_reward(spec, "reward.function"))
            summary.append(f"reward.function: {spec}")
        except TreadleError as e:
            problems.append(str(e))
        check_reward_service(cfg, summary, problems)
        check_judge(cfg, kind, summary, problems)  # reward.judge (treadle.check.judge)
    schemas = None
    if kind in (*RL_KINDS, "eval"):
        from treadle.agents.registry import BUILTIN_LOOPS

        r = cfg.rollout
        loads: list[tuple[str, list[str], Callable[[], Any]]] = []
        if r.tools:  # (their schemas are shown in prompts)
            loads.append(("rollout.tools", r.tools, lambda: _toolbox(r.tools).schemas))
        if kind in RL_KINDS and r.agent_loop not in BUILTIN_LOOPS:  # (not treadle's)
            loads.append((*_loop_code(r.agent_loop, r.env), _agent_loop(cfg)))
        for key, specs, load in loads:
            try:
                value = import_user_code(specs, key, load)
                schemas = value if key == "rollout.tools" else schemas
            except TreadleError as e:
                problems.append(str(e))
    return schemas


def check_reward_service(cfg: Config, summary: list[str], problems: list[str]) -> None:
    """``reward.url``, reached once: an empty batch (``{"samples": []}``), one try under
    ``reward.url_timeout_s`` (:meth:`~treadle.rewards.service.RewardService.probe`)."""
    r = cfg.reward
    if r.url is None:
        return
    from treadle.rewards.service import RewardService, ServiceOptions

    try:
        with RewardService(
            ServiceOptions(r.url, timeout_s=r.url_timeout_s, auth_env=r.url_auth_env)
        ) as s:
            s.probe()
        summary.append(f"reward.url: {r.url} answered (weight {r.url_weight:g})")
    except TreadleError as e:
        problems.append(str(e))


def import_user_code(specs: str | list[str], key: str, load: Callable[[], T]) -> T:
    """``load()``, which imports the user code ``specs`` names (``key``'s), within
    ``IMPORT_TIMEOUT_S`` seconds: each module is imported in a child process first (a hang no
    signal interrupts, an ``os._exit``), then ``load`` runs here under SIGALRM. Every import
    of user code the check does goes through here."""
    for spec in [specs] if isinstance(specs, str) else specs:
        if not spec.startswith("python:"):  # (a function given in this process)
            probe_import(spec, key, IMPORT_TIMEOUT_S)
    with time_limit(IMPORT_TIMEOUT_S, key):
        return load()


def check_rules(cfg: Config, kind: Kind) -> None:
    """The registered names and the rules between them (``check_algorithm``), after the
    plug-ins that register names (``algorithm.plugins``) are imported."""
    plugins = [f"{spec}:" for spec in cfg.algorithm.plugins]  # (modules: no function named)
    import_user_code(plugins, "algorithm.plugins", lambda: check_algorithm(cfg, kind))


def _loop_code(spec: str, env: str | None) -> tuple[str, list[str]]:
    """The key and the user code of the agent loop ``spec``: an ``env`` loop's factory
    (``rollout.env``), a black-box agent's function (``openai:module:function``), the loop."""
    if spec == "env":
        return "rollout.env", [env] if env else []
    return "rollout.agent_loop", [spec.removeprefix("openai:")]


def _agent_loop(cfg: Config) -> Callable[[], Any]:
    from treadle.agents.registry import load_agent_loop

    return lambda: load_agent_loop(cfg.rollout.agent_loop, cfg.rollout.env)


def _toolbox(specs: list[str]) -> Any:
    from treadle.agents.tools import Toolbox

    return Toolbox.load(specs)


def check_parsers(cfg: Config, summary: list[str]) -> None:
    """The endpoint's parsers are vLLM's registered names (the defaults: without importing
    vLLM, which takes seconds)."""
    from treadle.serving.parsers import check_parser_names

    r = cfg.rollout
    check_parser_names(r.tool_parser, r.reasoning_parser)
    if r.tool_parser != "hermes" or r.reasoning_parser is not None:
        summary.append(f"rollout.tool_parser: {r.tool_parser}, reasoning: {r.reasoning_parser}")


_LOADED_REWARDS: dict[str, Any] = {}  # spec -> its RewardFn, once it loaded in this process


def load_reward(spec: str, key: str) -> Any:
    """``load_reward_fn``, the function kept for :func:`reward_columns` (which must not import
    a module whose import failed or hung: it is loaded here under a time limit)."""
    from treadle.rewards import load_reward_fn

    _LOADED_REWARDS.pop(spec, None)  # (a check's failed load keeps no earlier one)
    fn = _LOADED_REWARDS[spec] = load_reward_fn(spec, key)
    return fn


def reward_columns(spec: str | None) -> list[str] | None:
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
