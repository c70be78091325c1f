"""docs/algorithms.md lists every registered algorithm, is current, and treadle has a
counterpart for every name of verl 0.9.1's registries and TRL 1.16's DPO loss types."""

from __future__ import annotations

import inspect
import re

from reference import trl_module, verl_core_algos

from treadle.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
)
from treadle.algorithms.reference import KINDS, builtin_names, render, summary
from treadle.cli.docs import DOCS_DIR


def test_docs_algorithms_md_is_current():
    assert (DOCS_DIR / "algorithms.md").read_text() == render(), (
        "docs/algorithms.md is out of date with treadle/algorithms: run "
        "`python -m treadle.cli.docs` and commit the result"
    )


def _rows(text: str, title: str) -> dict[str, str]:
    section = text.split(f"\n## {title} ", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    return {r.split("`", 2)[1]: r for r in rows}


def test_every_registered_name_is_one_row_with_its_paper_and_formula():
    text = render()
    for kind in KINDS:
        rows = _rows(text, kind.title)
        assert sorted(rows) == builtin_names(kind.registry), kind.title
        for name, row in rows.items():
            if "| alias of `" in row:
                continue
            paper, formula = summary(kind.registry.get(name))
            assert formula and formula in row.replace("\\|", "|"), (kind.title, name)
            # an arXiv id, a URL, a year (Kullback & Leibler, 1951) or verl (its own methods)
            assert re.search(r"arxiv\.org/abs/\d{4}\.\d{4,5}|<https?://|\b\d{4}\)|verl", paper), (
                f"{kind.title} {name!r}: no paper (arXiv id, URL, year or verl) in its "
                f"docstring's first paragraph: {paper!r}"
            )
            assert "`" in formula, f"{kind.title} {name!r}: no formula: {formula!r}"


def test_summary_splits_the_paper_from_the_formula():
    def grpo_like():
        """GRPO (DeepSeekMath, arXiv 2402.03300): ``A_i = (s_i - mean) / std``.

        More text."""

    assert summary(grpo_like) == (
        "GRPO (DeepSeekMath, [arXiv 2402.03300](https://arxiv.org/abs/2402.03300))",
        "`A_i = (s_i - mean) / std`.",
    )


def test_every_verl_registry_name_has_a_treadle_counterpart():
    verl = verl_core_algos()
    assert set(verl.ADV_ESTIMATOR_REGISTRY) <= set(ADV_ESTIMATORS.names())
    assert set(verl.POLICY_LOSS_REGISTRY) <= set(POLICY_LOSSES.names())
    # verl's aggregation modes and KL estimators are branches of agg_loss and kl_penalty
    agg = set(re.findall(r'"([a-z-]+)"', inspect.getsource(verl.agg_loss)))
    agg = {m for m in agg if m.startswith(("token-", "seq-"))}
    assert agg >= {"token-mean", "token-sum", "seq-mean-token-mean"}
    assert agg <= set(LOSS_AGG_MODES.names())
    kl = set(re.findall(r'"([a-z0-9_]+)"', inspect.getsource(verl.kl_penalty_forward)))
    assert kl >= {"k1", "k3", "low_var_kl", "full"}
    plus = {f"{k}+" for k in kl}  # straight-through variants: value of k, gradient of k2
    assert kl | {"k1+", "k3+"} <= set(KL_ESTIMATORS.names()), plus - set(KL_ESTIMATORS.names())


def test_every_trl_dpo_loss_type_has_a_treadle_counterpart():
    dpo = trl_module("trl.trainer.dpo_trainer")
    types = set(re.findall(r'loss_type == "([a-z_]+)"', inspect.getsource(dpo)))
    assert types >= {"sigmoid", "hinge", "ipo", "robust", "bco_pair", "apo_zero"}
    # TRL's "sft" is the chosen responses' NLL alone: here it is dpo.nll_coef beside any loss
    assert types - {"sft"} <= set(PREFERENCE_LOSSES.names())
