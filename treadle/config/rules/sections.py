"""The rules between sections that need nothing but the config: config validation.

``Config`` runs :func:`old_log_probs_problem` and :func:`config_problems` when it is built
(``treadle.config.schema``), before Ray or a model is touched; every broken rule is reported,
one message each, not the first alone. Here: batch sizes against the actor's ranks, settings
another one makes void, the prompt sampler, lr schedules, checkpoint retention, the trainer's
mode, the agent loops' settings; the placement and parallel layouts are
:mod:`treadle.config.rules.placement`'s.
"""

from __future__ import annotations

from collections.abc import Iterator

from treadle.config.data import DataConfig
from treadle.config.rollout import RolloutConfig
from treadle.config.rules.commands import PASS_RATE, changed_settings
from treadle.config.rules.placement import (
    check_frozen,
    check_parallel,
    check_rollout,
    check_side_role,
)
from treadle.config.run import Sections


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
        yield from check_side_role(
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
    yield from check_parallel(cfg)
    yield from check_rollout(cfg.rollout, cfg.actor, cfg.trainer)
    if cfg.reward.judge.model_path is not None:
        yield from check_frozen("reward.judge", cfg.reward.judge, cfg)
    yield from _check_agents(cfg.rollout, cfg.data)
    yield from _check_mode(cfg)
    yield from _check_retention(cfg)
    yield from _check_schedules(cfg)
    yield from _check_unread(cfg)
    yield from _check_sampler(cfg)
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


def _check_sampler(cfg: Sections) -> Iterator[str]:
    """The curriculum (``data.sampler=pass_rate``) draws by the pass rates of the groups each
    synchronous step made: it needs a random draw and that mode; its knobs mean nothing
    without it."""
    d = cfg.data
    if d.sampler == "uniform":
        changed = changed_settings("data", d, [f"pass_rate_{k}" for k in PASS_RATE])
        if changed:
            yield (
                f"{', '.join(changed)}: set data.sampler=pass_rate, whose knobs they are, or "
                "remove them"
            )
        return
    if not d.shuffle:
        yield (
            "data.sampler=pass_rate draws prompts at random by their pass rates, and "
            "data.shuffle=false asks for the file's order: set data.shuffle=true, or "
            "data.sampler=uniform"
        )
    if cfg.trainer.mode != "sync":
        yield (
            f"data.sampler=pass_rate learns from the groups a step generates, and "
            f"trainer.mode={cfg.trainer.mode} draws prompts ahead of them: set "
            "trainer.mode=sync, or data.sampler=uniform"
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
        changed = changed_settings("rollout", rollout, MULTI_TURN)
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
