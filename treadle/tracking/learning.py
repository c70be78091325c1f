"""The run report's "Is it learning?" panel: the signals that say whether an RL run can learn,
plotted together, and what they show said in words.

The signals (docs/diagnostics.md): the share of groups whose rewards were all equal and of
response tokens with a non-zero advantage, the reward's spread within groups, entropy, the KL
(to the reference when one is loaded, to the old policy always), the gradient norm, the size of
an optimizer step relative to the weights, and held-out accuracy with its standard error.

Each rule is one small function of the run's series that returns a sentence, or None when it
has nothing to say; its threshold is a named constant below, and docs/diagnostics.md states
each one (a test keeps them equal). Averages are over the steps that logged the series; a value
the tracker wrote as NaN or inf is left out of them.
"""

from __future__ import annotations

import html
import math
import statistics
from collections.abc import Callable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from treadle.tracking.sinks import accuracy_keys

Series = dict[str, tuple[list[float], list[float]]]  # name -> (steps, values)

# Above this share of groups with equal rewards (mean over the steps), say so.
EQUAL_GROUPS = 0.5
# Below this share of response tokens with a non-zero advantage (mean over the steps), say so.
SIGNAL_TOKENS = 0.1
# Entropy (nats per token) below this at the last step, or below this share of the first step's.
ENTROPY_FLOOR = 0.05
ENTROPY_FALL = 0.2
# The median optimizer step's ||Δθ|| / ||θ|| below / above these (steps with a signal only).
UPDATE_TINY = 1e-6
UPDATE_LARGE = 1e-2
# A held-out change within this many standard errors is noise; beyond the second, clear.
HELD_OUT_NOISE = 1.0
HELD_OUT_CLEAR = 2.0

EQUAL, SPREAD, SIGNAL = "reward/frac_zero_std", "reward/group_std", "advantages/nonzero_frac"
ENTROPY, GRAD_NORM, UPDATE = "actor/entropy", "actor/grad_norm", "actor/update_ratio"
REFERENCE_KL = ("actor/kl", "actor/reward_kl")  # to the reference: in the loss, in the reward
STDERR = "/stderr"

# (subplot title, its series, log axis); held-out accuracy comes last, one line per set
PLOTS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("Equal-reward groups, non-zero-advantage tokens", (EQUAL, SIGNAL), False),
    ("Reward spread within groups (std)", (SPREAD,), False),
    ("Entropy (nats per token)", (ENTROPY,), False),
    ("KL", (*REFERENCE_KL, "actor/ppo_kl"), False),
    ("Gradient norm", (GRAD_NORM,), False),
    ("Update size / weights", (UPDATE,), True),
)


def _steps(values: list[float]) -> str:
    return f"{len(values)} step{'s' if len(values) != 1 else ''}"


def _finite(series: Series, name: str) -> list[float]:
    return [v for v in series.get(name, ([], []))[1] if math.isfinite(v)]


def _same_reward(series: Series) -> float | None:
    """The reward every sample got, if all got the same one in every step (mean = max)."""
    means = dict(zip(*series.get("reward/mean", ([], [])), strict=True))
    tops = dict(zip(*series.get("reward/max", ([], [])), strict=True))
    if not means or means != tops or len(set(means.values())) != 1:
        return None
    return next(iter(means.values()))


# --- the rules ---------------------------------------------------------------------------------


def equal_groups(series: Series) -> str | None:
    values = _finite(series, EQUAL)
    if not values or statistics.fmean(values) < EQUAL_GROUPS:
        return None
    fix = (
        "dynamic sampling could not fill the batch with varied groups: raise "
        "algorithm.max_gen_rounds, rollout.n or rollout.temperature."
        if "rollout/kept_group_frac" in series  # (logged with algorithm.filter_groups only)
        else "raise rollout.n or rollout.temperature, or use dynamic sampling "
        "(algorithm.filter_groups=true)."
    )
    text = (
        f"{statistics.fmean(values):.0%} of groups had equal rewards (mean over "
        f"{_steps(values)}): their advantages are 0, nothing to learn from them; {fix}"
    )
    same = _same_reward(series)
    if same is not None:
        text += (
            f" Every sample got the same reward ({same:g}) in every step: check the reward "
            "function on a few responses; if no answer is ever right, warm-start with SFT or "
            "give partial credit."
        )
    return text


def few_signal_tokens(series: Series) -> str | None:
    values = _finite(series, SIGNAL)
    if not values or statistics.fmean(values) >= SIGNAL_TOKENS:
        return None
    return (
        f"{statistics.fmean(values):.0%} of response tokens had a non-zero advantage (mean over "
        f"{_steps(values)}, below {SIGNAL_TOKENS:.0%}): the update learns from few tokens."
    )


def collapsing_entropy(series: Series) -> str | None:
    values = _finite(series, ENTROPY)
    if not values:
        return None
    first, last = values[0], values[-1]
    if last < ENTROPY_FLOOR:
        why = f"fell to {last:.3g} nats per token (below {ENTROPY_FLOOR:g})"
    elif len(values) > 1 and last < ENTROPY_FALL * first:
        why = (
            f"fell from {first:.3g} to {last:.3g} nats per token (below {ENTROPY_FALL:.0%} of "
            "its start)"
        )
    else:
        return None
    return (
        f"Entropy {why}: the policy is collapsing onto a few answers. Raise "
        "rollout.temperature or algorithm.entropy_coef, or lower actor.lr."
    )


def _update_sizes(series: Series) -> list[float]:
    """``actor/update_ratio`` at the steps whose batch had a non-zero advantage (an update with
    nothing to learn from is 0 whatever the learning rate) and whose step was taken."""
    signal = dict(zip(*series.get(SIGNAL, ([], [])), strict=True))
    steps, values = series.get(UPDATE, ([], []))
    return [
        v
        for s, v in zip(steps, values, strict=True)
        if signal.get(s, 1.0) > 0 and v > 0 and math.isfinite(v)
    ]


def tiny_updates(series: Series) -> str | None:
    values = _update_sizes(series)
    if not values or statistics.median(values) >= UPDATE_TINY:
        return None
    return (
        f"Updates moved the weights by {statistics.median(values):.2g} of their norm per "
        f"optimizer step (median over {_steps(values)}, below {UPDATE_TINY:g}): raise actor.lr."
    )


def large_updates(series: Series) -> str | None:
    values = _update_sizes(series)
    if not values or statistics.median(values) <= UPDATE_LARGE:
        return None
    return (
        f"Updates moved the weights by {statistics.median(values):.2g} of their norm per "
        f"optimizer step (median over {_steps(values)}, above {UPDATE_LARGE:g}): training "
        "may turn unstable; lower actor.lr."
    )


def non_finite_gradients(series: Series) -> str | None:
    values = series.get(GRAD_NORM, ([], []))[1]
    bad = sum(not math.isfinite(v) for v in values)
    if not bad:
        return None
    return (
        f"{bad} of {len(values)} steps had a non-finite gradient norm: their optimizer steps "
        "were skipped. Lower actor.lr, and check the rewards for NaN."
    )


def no_reference(series: Series) -> str | None:
    if ENTROPY not in series or any(name in series for name in REFERENCE_KL):
        return None
    return (
        "No reference model is loaded (algorithm.kl_coef and algorithm.kl_reward_coef are 0), "
        "so the KL to the start is not measured; actor/ppo_kl is the KL to the policy that "
        "generated each batch."
    )


def held_out_change(series: Series, name: str) -> str | None:
    """``name`` (``eval/<set>/accuracy``) from its first evaluation to its last, against the
    larger of their standard errors (``<name>/stderr``)."""
    points = [(s, v) for s, v in zip(*series[name], strict=True) if math.isfinite(v)]
    errors = dict(zip(*series.get(name + STDERR, ([], [])), strict=True))
    if len(points) < 2 or points[0][0] not in errors or points[-1][0] not in errors:
        return None
    (s0, a), (s1, b) = points[0], points[-1]
    se, change = max(errors[s0], errors[s1]), b - a
    where = f"held-out accuracy on {name.split('/')[1]}"
    moved = f"{100 * change:+.1f} points ({a:.1%} at step {s0:g}, {b:.1%} at step {s1:g})"
    error = f"its standard error ({100 * se:.1f} points)"
    if abs(change) <= HELD_OUT_NOISE * se:
        return (
            f"The {where} moved by {moved}, less than {error}: no measurable change. "
            "More questions (data.val_size) resolve smaller changes."
        )
    if abs(change) >= HELD_OUT_CLEAR * se:
        return f"The {where} moved by {moved}, more than {HELD_OUT_CLEAR:g} times {error}."
    return (
        f"The {where} moved by {moved}, between {HELD_OUT_NOISE:g} and {HELD_OUT_CLEAR:g} "
        f"times {error}: not yet conclusive."
    )


RULES: tuple[Callable[[Series], str | None], ...] = (
    equal_groups,
    few_signal_tokens,
    collapsing_entropy,
    tiny_updates,
    large_updates,
    non_finite_gradients,
    no_reference,
)


def findings(series: Series) -> list[str]:
    """What the rules say about the run, in order."""
    said = [rule(series) for rule in RULES]
    said += [held_out_change(series, name) for name in accuracy_keys(series)]
    return [text for text in said if text]


# --- the panel ---------------------------------------------------------------------------------


def learning_figure(series: Series) -> go.Figure | None:
    """The panel's plots, those the run has series for (None: none, not an RL run)."""
    plots = [(t, [n for n in names if n in series], log) for t, names, log in PLOTS]
    plots = [p for p in plots if p[1]]
    held_out = accuracy_keys(series)
    if held_out:
        plots.append(("Held-out accuracy ± standard error", held_out, False))
    if not plots:
        return None
    cols = min(3, len(plots))
    rows = math.ceil(len(plots) / cols)
    fig = make_subplots(
        rows=rows, cols=cols, subplot_titles=[p[0] for p in plots], vertical_spacing=0.3 / rows
    )
    for i, (_, names, log) in enumerate(plots):
        row, col = i // cols + 1, i % cols + 1
        for name in names:
            fig.add_trace(_trace(series, name), row=row, col=col)
        if log:
            fig.update_yaxes(type="log", row=row, col=col)
    fig.update_annotations(font_size=12)
    fig.update_xaxes(title_text="step")
    fig.update_layout(
        height=80 + 240 * rows,
        margin={"l": 50, "r": 20, "t": 40, "b": 40},
        template="plotly_white",
        legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"},
    )
    return fig


def _trace(series: Series, name: str) -> go.Scatter:
    steps, values = series[name]
    errors = dict(zip(*series.get(name + STDERR, ([], [])), strict=True))
    error_y = None
    if errors:
        error_y = {"type": "data", "array": [errors.get(s, 0.0) for s in steps], "visible": True}
    mode = "lines+markers" if len(steps) <= 30 else "lines"
    return go.Scatter(x=steps, y=values, name=name, mode=mode, error_y=error_y)


def learning_section(series: Series) -> str:
    """The panel's HTML: what the rules say, then the plots; "" for a run with none of its
    series (an SFT or DPO run)."""
    fig = learning_figure(series)
    if fig is None:
        return ""
    said = findings(series) or ["None of the rules (docs/diagnostics.md) found a problem."]
    items = "".join(f"<li>{html.escape(text)}</li>" for text in said)
    div = fig.to_html(
        full_html=False, include_plotlyjs=False, config={"displaylogo": False, "responsive": True}
    )
    return f'<h2>Is it learning?</h2><ul class="findings">{items}</ul>{div}'
