"""The commands a config is run by (``Kind``), and the settings each of them never reads.

``treadle train`` and ``treadle distill`` run the RL dataflow (``RL_KINDS``); sft, dpo, kto and
rm take one optimizer step a batch (``NOT_RL``) and read neither RL's sections nor another
command's. A setting one of those four never reads, changed from its default, would be silently
ignored: :func:`unread_settings` names it (``check_algorithm`` runs it for them). Which sections
and keys each command reads is one table, :func:`_readers`. :func:`changed_settings` (the
settings of a section set away from their defaults) is read by the multi-turn rule of config
validation too (``treadle.config.rules.sections``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

from treadle.config.run import Sections

Kind = Literal["train", "distill", "sft", "dpo", "kto", "rm", "eval", "serve"]
KINDS: tuple[Kind, ...] = ("train", "distill", "sft", "dpo", "kto", "rm", "eval", "serve")
RL_KINDS: tuple[Kind, ...] = ("train", "distill")  # the commands that run the RL dataflow
NOT_RL: tuple[Kind, ...] = ("sft", "dpo", "kto", "rm")  # one optimizer step a batch, no RL
RL = "treadle train/distill"
PASS_RATE = ("threshold", "ema", "unseen", "floor", "solved")  # data.pass_rate_*
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
        ("reward", ("overlong_penalty", "judge"), RL, False),
        ("reward", ("function",), EVALUATIONS, evaluates),
        ("eval", None, EVALUATIONS, evaluates),
        ("data", ("sampler", *(f"pass_rate_{k}" for k in PASS_RATE)), RL, False),
    ]


def unread_settings(cfg: Sections, kind: Kind) -> Iterator[str]:
    """Settings changed from their defaults that ``kind`` (sft, dpo, kto or rm) never reads
    (:func:`_readers`): they would be silently ignored. One line for each group of them."""
    for section, keys, readers, read in _readers(cfg, kind):
        if read:
            continue
        settings = getattr(cfg, "async_" if section == "async" else section)
        names = [k for k in keys or type(settings).model_fields if k != "plugins"]
        changed = changed_settings(section, settings, names)
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


def changed_settings(section: str, settings: Any, keys: Sequence[str]) -> list[str]:
    """``section.key=value`` of each of ``keys`` that ``settings`` sets away from its default."""
    default = type(settings).model_validate({})
    out: list[str] = []
    for k in keys:
        value, was = getattr(settings, k), getattr(default, k)
        if value == was:
            continue
        if hasattr(value, "model_fields") and type(was) is type(value):  # a section's own keys
            out.extend(changed_settings(f"{section}.{k}", value, list(type(value).model_fields)))
        else:
            out.append(f"{section}.{k}={_shown(value)}")
    return out


def _shown(value: Any) -> str:
    """A setting's value as the YAML gives it (null, true) or as Python writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if hasattr(value, "model_dump"):
        return str(value.model_dump(mode="json"))
    return str(value)
