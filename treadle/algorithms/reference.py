"""``docs/algorithms.md``: every registered algorithm in one table per kind, from the registries.

A row is read from the code, so the reference cannot go stale: the name; the paper and the
formula, both from the first paragraph of the function's docstring, which every built-in
function writes as ``Name (Authors, arXiv NNNN.NNNNN): formula``; the config key that selects
it; and what it needs beyond a batch of prompts and a reward, from its registration facts
(``needs``, ``groups``, ``agg_modes``, ``knobs``, ``data``, ``reference``). A name registered
for a function that has another name too is listed as an alias. ``python -m treadle.cli.docs``
writes the file.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from treadle import algorithms  # the package: importing it registers every built-in function
from treadle.algorithms.registry import Registry

COMMAND = "python -m treadle.cli.docs"

HEADER = f"""# Algorithm reference

<!-- Generated from the registries in treadle/algorithms by `{COMMAND}`: do not edit. -->

Every advantage estimator, policy loss, loss aggregation, KL estimator, preference loss and
distillation loss treadle has, one table per kind. A config selects one by its registered name
(`algorithm.adv_estimator=rloo`); an unknown name is an error listing the valid ones. Each
function is a pure function over tensors in `treadle/algorithms/`; its docstring says where it
deliberately differs from verl or TRL. Your own go into the same registries from a module named
in `algorithm.plugins` (see the README).

Every name in verl 0.9.1's estimator, policy-loss, aggregation and KL registries, every loss
type of TRL 1.16's `DPOTrainer` (its `sft` is `dpo.nll_coef` here, beside any loss) and
`KTOTrainer`, ORPO and SimPO have a counterpart here; `tests/` compares each against the
reference implementation on random inputs.
"""


@dataclass(frozen=True)
class Kind:
    title: str
    registry: Registry[Any]
    selected_by: str
    intro: str
    needs: Callable[[dict[str, Any]], str]


def _rl_needs(info: dict[str, Any]) -> str:
    parts = []
    if info.get("groups"):
        parts.append("`rollout.n` >= 2 samples per prompt (the group is the baseline)")
    for need in info.get("needs", ()):
        parts.append(NEEDS.get(need, f"`{need}`"))
    if info.get("old"):  # a policy loss whose old policy is another one
        parts.append(NEEDS[info["old"]] + ", as the old policy")
    if info.get("full_vocab"):
        parts.append(NEEDS["ref_logits"] + "; in the loss only, not in the reward")
    if info.get("agg_modes"):
        parts.append("`loss_agg_mode` one of " + ", ".join(f"`{m}`" for m in info["agg_modes"]))
    if info.get("knobs"):
        parts.append("reads " + ", ".join(f"`algorithm.{k}`" for k in info["knobs"]))
    return "; ".join(parts)


def _estimator_needs(info: dict[str, Any]) -> str:
    """An estimator's settings are not all config keys: its ``knobs`` are left out."""
    return _rl_needs({k: v for k, v in info.items() if k != "knobs"})


def _preference_needs(info: dict[str, Any], data: str = "pairs", section: str = "dpo") -> str:
    parts = [DATA[data]]
    if info.get("reference") is False:
        parts.append("no reference model")
    if info.get("nll"):
        parts.append(f"adds the chosen responses' NLL (weight {info['nll']})")
    if info.get("knobs"):
        parts.append("reads " + ", ".join(f"`{section}.{k}`" for k in info["knobs"]))
    if info.get("positive"):
        parts.append(" and ".join(f"`{section}.{k}`" for k in info["positive"]) + " > 0")
    if info.get("batchwise"):
        parts.append("compares the examples of a batch with each other (sorted)")
    return "; ".join(parts)


def _unpaired_needs(info: dict[str, Any]) -> str:
    return _preference_needs(info, "unpaired", "kto")


def _distill_needs(info: dict[str, Any]) -> str:
    parts = [NEEDS[need] for need in info.get("needs", ())]
    if info.get("nll"):
        parts.append("trained as SFT (next-token NLL, token-mean)")
    if info.get("knobs"):
        parts.append("reads " + ", ".join(f"`distill.{k}`" for k in info["knobs"]))
    return "; ".join(parts)


# what a registration's `needs` asks of the dataflow, in a reader's words
NEEDS = {
    "values": "a critic (`critic.enable=true`): per-token values",
    "baseline_rewards": "one greedy response per prompt, scored (an extra generation)",
    "old_log_probs": "the actor's log-probs before the update (an extra forward)",
    "sum_pi_squared": "the actor's Σ_v π(v)² per token (from the same forward)",
    "rollout_log_probs": "the rollout engine's log-probs of the sampled tokens",
    "reward_components": "a reward function returning a dict of named scores",
    "implicit_rewards": "an implicit process reward model (`prime.*`), trained every step",
    "ref_logits": "the reference's whole distribution in the update (a forward per micro-batch)",
    "teacher_log_probs": "the teacher's log-probs of the student's sampled tokens",
    "teacher_topk": "the teacher's top-k ids and log-probs at each position",
    "teacher_samples": "the teacher's own samples (the teacher generates)",
}
DATA = {
    "pairs": "pairs: `{prompt, chosen, rejected}`",
    "unpaired": "unpaired: `{prompt, completion, label}` (label: true for good)",
}

KINDS = (
    Kind(
        "Advantage estimators",
        algorithms.ADV_ESTIMATORS,
        "algorithm.adv_estimator",
        "Rewards (and a critic's values) in, per-token advantages and returns out. Data: "
        "prompts with a reward function (`data.train_files`, `reward.function`).",
        _estimator_needs,
    ),
    Kind(
        "Policy losses",
        algorithms.POLICY_LOSSES,
        "algorithm.policy_loss",
        "The actor's objective per token, from the new and old log-probs and the advantages; "
        "r = π/π_old.",
        _rl_needs,
    ),
    Kind(
        "Loss aggregation",
        algorithms.LOSS_AGG_MODES,
        "algorithm.loss_agg_mode",
        "How a [batch, tokens] loss matrix becomes one number (m: the response mask).",
        _rl_needs,
    ),
    Kind(
        "KL estimators",
        algorithms.KL_ESTIMATORS,
        "algorithm.kl_estimator",
        "Per-token estimates of KL(π ‖ π_ref): in the loss (`algorithm.kl_estimator`, weight "
        "`algorithm.kl_coef`) or in the reward (`algorithm.kl_reward_estimator`, weight "
        "`algorithm.kl_reward_coef`).",
        _rl_needs,
    ),
    Kind(
        "Preference losses",
        algorithms.PREFERENCE_LOSSES,
        "dpo.loss_type",
        "One loss per example from sequence log-probs of the policy and (most) of a frozen "
        "reference; run by `treadle dpo`. h is the log-ratio margin "
        "[log π(y_w) − log π_ref(y_w)] − [log π(y_l) − log π_ref(y_l)].",
        _preference_needs,
    ),
    Kind(
        "Unpaired preference losses",
        algorithms.UNPAIRED_LOSSES,
        "kto.loss_type",
        "One loss per example labelled good or bad, from its sequence log-probs under the "
        "policy and a frozen reference; run by `treadle kto`.",
        _unpaired_needs,
    ),
    Kind(
        "Distillation losses",
        algorithms.DISTILL_LOSSES,
        "distill.loss",
        "What a student learns from a frozen teacher (`teacher.model_path`); run by "
        "`treadle distill`. π is the student, π_teacher the teacher.",
        _distill_needs,
    ),
)


def render() -> str:
    """The whole reference, as ``docs/algorithms.md`` should hold it."""
    parts = [HEADER]
    for kind in KINDS:
        parts.append(f"## {kind.title} (`{kind.selected_by}`)\n")
        parts.append(kind.intro + "\n")
        parts.append("\n".join(_table(kind)) + "\n")
    return "\n".join(parts)


def _table(kind: Kind) -> Iterator[str]:
    yield "| name | paper | formula | needs |"
    yield "| --- | --- | --- | --- |"
    for name in builtin_names(kind.registry):
        fn, canonical = kind.registry.get(name), kind.registry.canonical(name)
        if canonical != name:
            yield f"| `{name}` | alias of `{canonical}` | | |"
            continue
        paper, formula = summary(fn)
        needs = kind.needs(kind.registry.info(name))
        yield f"| `{name}` | {_cell(paper)} | {_cell(formula)} | {_cell(needs)} |"


def builtin_names(registry: Registry[Any]) -> list[str]:
    """The registry's names of treadle's own functions (not those of a loaded plugin)."""
    return [
        n for n in registry.names() if registry.get(n).__module__.startswith("treadle.algorithms")
    ]


def summary(fn: Callable[..., Any]) -> tuple[str, str]:
    """``(paper, formula)`` from the docstring's first paragraph ``Name (paper): formula``.

    The paper part keeps the name and links an arXiv id; a paragraph without that shape is
    all formula.
    """
    doc = inspect.getdoc(fn) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    match = re.match(r"^([^:(]*\((?:[^()]|\([^()]*\))*\))\s*:\s*(.*)$", first)
    paper, formula = (match.group(1), match.group(2)) if match else ("", first)
    paper = re.sub(r"arXiv (\d{4}\.\d{4,5})", r"[arXiv \1](https://arxiv.org/abs/\1)", paper)
    paper = re.sub(r"(?<!\()(https?://[^\s),;]+)", r"<\1>", paper)
    return paper, _markdown(formula)


def _markdown(text: str) -> str:
    """reStructuredText's ````code```` as Markdown's ```code```."""
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
