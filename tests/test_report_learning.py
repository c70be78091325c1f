"""The report's "Is it learning?" panel: its sentences from a metrics.jsonl written here with
known numbers, each rule on both sides of its threshold, and the thresholds the docs state."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from treadle.cli import main
from treadle.tracking import learning
from treadle.tracking.learning import findings, learning_figure
from treadle.tracking.report import numeric_series

DOCS = Path(__file__).resolve().parent.parent / "docs" / "diagnostics.md"


def run(**columns: list) -> list[dict]:
    """One record per step (1, 2, ...) from columns of values; None: not logged that step."""
    steps = len(next(iter(columns.values())))
    records = [{"step": s + 1} for s in range(steps)]
    for name, values in columns.items():
        for record, value in zip(records, values, strict=True):
            if value is not None:
                record[name] = value
    return records


def said(**columns: list) -> list[str]:
    return findings(numeric_series(run(**columns)))


STUCK = run(
    **{
        "reward/mean": [0.2, 0.3, 0.2, 0.25],
        "reward/max": [1.0] * 4,
        "reward/frac_zero_std": [0.75, 0.625, 0.75, 0.75],
        "reward/group_std": [0.1, 0.2, 0.1, 0.1],
        "advantages/nonzero_frac": [0.05, 0.05, 0.1, 0.1],
        "actor/entropy": [2.0, 1.0, 0.5, 0.3],
        "actor/ppo_kl": [0.0] * 4,
        "actor/grad_norm": [1.0, "inf", 2.0, 3.0],
        "actor/update_ratio": [4e-7, 6e-7, 5e-7, "nan"],
        "eval/val/accuracy": [None, 0.30, None, 0.33],
        "eval/val/accuracy/stderr": [None, 0.032, None, 0.033],
    }
)
STUCK_SAYS = [
    "72% of groups had equal rewards (mean over 4 steps): their advantages are 0, nothing to "
    "learn from them; raise rollout.n or rollout.temperature, or use dynamic sampling "
    "(algorithm.filter_groups=true).",
    "8% of response tokens had a non-zero advantage (mean over 4 steps, below 10%): the update "
    "learns from few tokens.",
    "Entropy fell from 2 to 0.3 nats per token (below 20% of its start): the policy is "
    "collapsing onto a few answers. Raise rollout.temperature or algorithm.entropy_coef, or "
    "lower actor.lr.",
    "Updates moved the weights by 5e-07 of their norm per optimizer step (median over 3 steps, "
    "below 1e-06): raise actor.lr.",
    "1 of 4 steps had a non-finite gradient norm: their optimizer steps were skipped. Lower "
    "actor.lr, and check the rewards for NaN.",
    "No reference model is loaded (algorithm.kl_coef and algorithm.kl_reward_coef are 0), so "
    "the KL to the start is not measured; actor/ppo_kl is the KL to the policy that generated "
    "each batch.",
    "The held-out accuracy on val moved by +3.0 points (30.0% at step 2, 33.0% at step 4), "
    "less than its standard error (3.3 points): no measurable change. More questions "
    "(data.val_size) resolve smaller changes.",
]


def test_the_report_says_what_the_metrics_show(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in STUCK))
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    panel = page[page.index("<h2>Is it learning?</h2>") : page.index("<h2>Metrics</h2>")]
    items = re.findall(r"<li>(.*?)</li>", panel)
    assert items == [html.escape(text) for text in STUCK_SAYS]
    assert panel.count('class="plotly-graph-div"') == 1


def test_the_panel_plots_the_signals_with_error_bars_and_a_log_update_axis():
    fig = learning_figure(numeric_series(STUCK))
    assert fig is not None
    titles = [a.text for a in fig.layout.annotations]
    assert titles == [
        "Equal-reward groups, non-zero-advantage tokens",
        "Reward spread within groups (std)",
        "Entropy (nats per token)",
        "KL",
        "Gradient norm",
        "Update size / weights",
        "Held-out accuracy ± standard error",
    ]
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["eval/val/accuracy"].error_y.array) == [0.032, 0.033]
    assert by_name["actor/update_ratio"].yaxis == "y6" and fig.layout.yaxis6.type == "log"
    # an SFT run has none of the panel's series: no panel
    assert (
        learning_figure(numeric_series(run(**{"sft/loss": [1.0], "sft/grad_norm": [1.0]}))) is None
    )


def test_a_healthy_run_fires_no_rule():
    healthy = {
        "reward/frac_zero_std": [0.5, 0.25],  # mean 0.375: below EQUAL_GROUPS
        "advantages/nonzero_frac": [0.1, 0.8],  # mean 0.45
        "actor/entropy": [1.0, 0.25],  # 25% of the start, above 0.05
        "actor/kl": [0.01, 0.02],
        "actor/update_ratio": [1e-6, 1e-2],  # the median, 5e-3, inside the band
    }
    assert said(**healthy) == []
    page = learning.learning_section(numeric_series(run(**healthy)))
    assert "<li>None of the rules (docs/diagnostics.md) found a problem.</li>" in page


def test_each_rule_on_both_sides_of_its_threshold():
    assert said(**{"reward/frac_zero_std": [0.5], "actor/kl": [0.0]})[0].startswith("50% of")
    assert said(**{"reward/frac_zero_std": [0.49], "actor/kl": [0.0]}) == []
    assert said(**{"advantages/nonzero_frac": [0.099]})[0].startswith("10% of response")
    assert said(**{"advantages/nonzero_frac": [0.1]}) == []
    assert said(**{"actor/entropy": [0.049], "actor/kl": [0.0]})[0].startswith("Entropy fell to")
    assert said(**{"actor/entropy": [0.25, 0.049], "actor/kl": [0.0, 0.0]})[0].startswith(
        "Entropy fell to 0.049"
    )
    assert said(**{"actor/entropy": [1.0, 0.2], "actor/kl": [0.0, 0.0]}) == []
    assert said(**{"actor/update_ratio": [0.011]})[0].endswith("lower actor.lr.")
    assert said(**{"actor/update_ratio": [0.01, 1e-6]}) == []


def test_no_signal_is_not_a_learning_rate_problem():
    """An update over a batch without a non-zero advantage is 0 whatever actor.lr is: those
    steps are left out of the update rule; every sample's same reward is said."""
    got = said(
        **{
            "reward/mean": [0.0, 0.0],
            "reward/max": [0.0, 0.0],
            "reward/frac_zero_std": [1.0, 1.0],
            "advantages/nonzero_frac": [0.0, 0.0],
            "actor/update_ratio": [0.0, 0.0],
            "actor/kl": [0.0, 0.0],
            "rollout/kept_group_frac": [0.0, 0.0],  # dynamic sampling on
        }
    )
    assert got == [
        "100% of groups had equal rewards (mean over 2 steps): their advantages are 0, nothing "
        "to learn from them; dynamic sampling could not fill the batch with varied groups: "
        "raise algorithm.max_gen_rounds, rollout.n or rollout.temperature. Every sample got the "
        "same reward (0) in every step: check the reward function on a few responses; if no "
        "answer is ever right, warm-start with SFT or give partial credit.",
        "0% of response tokens had a non-zero advantage (mean over 2 steps, below 10%): the "
        "update learns from few tokens.",
    ]


@pytest.mark.parametrize(
    ("last", "stderr", "verdict"),
    [
        (0.40, 0.03, "more than 2 times its standard error (3.0 points)."),
        (0.25, 0.03, "between 1 and 2 times its standard error (3.0 points): not yet conclusive."),
    ],
)
def test_held_out_change_against_its_standard_error(last, stderr, verdict):
    got = said(
        **{
            "eval/val/accuracy": [0.30, last],
            "eval/val/accuracy/stderr": [0.02, stderr],  # the larger of the two counts
        }
    )
    assert len(got) == 1 and got[0].endswith(verdict), got


def test_the_docs_state_every_threshold():
    text = DOCS.read_text()
    names = [n for n in dir(learning) if n.isupper() and isinstance(getattr(learning, n), float)]
    assert len(names) == 8
    for name in names:
        assert f"`{name}` = {getattr(learning, name):g}" in text, name
