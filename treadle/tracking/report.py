"""``treadle report RUN_DIR``: one HTML page that shows a run, written to ``RUN_DIR/report.html``.

It reads what every run leaves in its output directory: ``metrics.jsonl`` (one object per
step), ``config.yaml`` (the resolved config), when the run logged samples ``samples.jsonl``
(``{"step", "prompt", "response", "reward", "ground_truth", ...}``) and, when ``treadle eval
RUN_DIR`` evaluated its checkpoints, ``eval.jsonl`` (one object per checkpoint's step).

Choices:

- "Is it learning?" comes first (:mod:`treadle.tracking.learning`): an RL run's learning
  signals plotted together, and what the rules of docs/diagnostics.md see in them, in words.
- Plots are plotly figures, and plotly.js is inlined once in the page (about 4.6 MB), so the
  page works from ``file://`` with no network: copy it anywhere, open it offline.
- The named panels come first (distillation, reward, loss, one per validation set, held-out
  accuracy, KL, entropy, response length, clip fraction, time per phase stacked per step,
  throughput, peak device memory), each from whichever of its series the run has; every
  other numeric series is plotted too, one small panel per series, grouped by its prefix
  (``actor/``, ``rollout/``, ``dpo/``, ...), so an SFT, DPO or RM run shows its own.
- A validation set's panel (``Held-out: <set>``) has every metric of the set against the step
  (``eval/<set>/<metric>``, its bootstrap ``/std`` aside, its ``/stderr`` as error bars): the
  in-training evaluation's from
  metrics.jsonl and, dashed, ``treadle eval``'s of the checkpoints from eval.jsonl, named
  ``<metric> (treadle eval)``.
- Model text and config values are untrusted: everything put into the page's HTML is escaped,
  and plotly escapes what goes into its JSON.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any
from urllib.parse import quote

import plotly.graph_objects as go
import yaml
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from treadle.runtime.errors import TreadleError
from treadle.tracking.learning import STDERR, Series, learning_section
from treadle.tracking.profiler import ranges_part
from treadle.tracking.sinks import accuracy_keys

# (title, the metric names it plots as fnmatch patterns); a series goes to the first panel that
# matches it. Time per phase is drawn apart (stacked bars), see ``_timing_figure``.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Distillation", ("distill/*",)),  # treadle distill: the divergence to the teacher
    ("Reward", ("reward/*",)),
    ("Loss", ("*/loss",)),  # SFT, DPO and RM runs; RL's losses are in the actor/critic groups
    ("Held-out accuracy", ("eval/*accuracy*",)),
    ("KL", ("*/kl", "*/reward_kl", "*/kl_*")),
    ("Entropy", ("*/entropy",)),
    ("Response length", ("response/*length*",)),
    ("Clip fraction", ("*/clip_frac", "*/*clipfrac")),
    ("Throughput", ("throughput/*",)),
    # each update's model FLOPs over its time, a device's (treadle.engines.flops)
    ("Training TFLOP/s a device", ("perf/tflops/*",)),
    ("MFU (share of the GPU's bf16 peak)", ("perf/mfu/*",)),
    # a run on a GPU: each phase's peak and the step's, or a Ray worker's update's (tracker)
    ("Peak device memory (GiB)", ("perf/max_memory_*",)),
)
# Timings that are not a phase of a step: the step's total (its unnamed rest is drawn as
# "other") and the one-off start-up time (shown in the summary); evaluation is timed after the
# step, outside ``timing/step``.
STEP_TIME, STARTUP_TIME, AFTER_STEP = "timing/step", "timing/startup", ("timing/eval",)
MEMORY = ("perf/max_memory_allocated_gib", "perf/max_memory_reserved_gib")  # peaks' names begin
EVAL_FILE, CHECKPOINT_EVAL = "eval.jsonl", " (treadle eval)"  # its series: <name> (treadle eval)
MAX_SAMPLES = 200  # the newest ones: a long run logs thousands


def write_report(run_dir: str | Path) -> Path:
    """Write ``run_dir/report.html`` from the run's files and return its path."""
    run = Path(run_dir)
    if not run.is_dir():
        raise TreadleError(f"{run}: no such directory (give a run's trainer.output_dir)")
    metrics_path = run / "metrics.jsonl"
    if not metrics_path.is_file():
        raise TreadleError(
            f"{run}: no metrics.jsonl (not a run directory: give a run's trainer.output_dir, "
            "where treadle train, distill, sft, dpo, kto and rm write one line per step)"
        )
    records = read_jsonl(metrics_path)
    if not records:
        raise TreadleError(f"{metrics_path}: no steps yet (the run has not finished a step)")
    for lineno, record in enumerate(records, 1):
        if not isinstance(record.get("step"), int):
            raise TreadleError(f"{metrics_path} line {lineno}: no integer 'step'")
    series = numeric_series(records)
    series.update(checkpoint_series(run / EVAL_FILE))
    samples_path = run / "samples.jsonl"
    samples = read_jsonl(samples_path) if samples_path.is_file() else []
    page = _page(run, series, _read_config(run / "config.yaml"), samples)
    out = run / "report.html"
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as e:
        raise TreadleError(f"{out}: cannot write: {e}") from e
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one a line; a line that is not one names file and line."""
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TreadleError(f"{path}: cannot read: {e}") from e
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TreadleError(f"{path} line {lineno}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise TreadleError(f"{path} line {lineno}: not a JSON object")
        records.append(record)
    return records


def numeric_series(records: Iterable[dict[str, Any]]) -> Series:
    """Every numeric metric as (steps, values), in file order; NaN and inf (written as strings
    by the tracker) stay, plotly leaves a gap for them."""
    series: Series = {}
    for record in records:
        for name, value in record.items():
            number = _number(value)
            if name == "step" or number is None:
                continue
            steps, values = series.setdefault(name, ([], []))
            steps.append(record["step"])
            values.append(number)
    return series


def checkpoint_series(path: Path) -> Series:
    """The ``eval/...`` series of ``treadle eval``'s file (none if there is none), each named
    ``<metric> (treadle eval)``."""
    if not path.is_file():
        return {}
    records = read_jsonl(path)
    for lineno, record in enumerate(records, 1):
        if not isinstance(record.get("step"), int):
            raise TreadleError(f"{path} line {lineno}: no integer 'step'")
    return {
        name + CHECKPOINT_EVAL: values
        for name, values in numeric_series(records).items()
        if name.startswith("eval/")
    }


def eval_sets(names: Iterable[str]) -> list[str]:
    """The validation sets of ``eval/<set>/<metric>`` names, in order of appearance."""
    found: dict[str, None] = {}
    for name in names:
        parts = name.split("/")
        if parts[0] == "eval" and len(parts) > 2:
            found.setdefault(parts[1], None)
    return list(found)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def _read_config(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        detail = " ".join(str(e).split())  # YAML's messages span lines: one line per problem
        raise TreadleError(f"{path}: cannot read the resolved config: {detail}") from e
    if not isinstance(config, dict):
        raise TreadleError(f"{path}: not a mapping of config sections")
    return config


# --- figures -----------------------------------------------------------------------------------


def figures(series: Series) -> list[tuple[str, go.Figure]]:
    """(title, plotly figure) for every panel the run has data for, named panels first."""
    left = [name for name in series if name not in (STEP_TIME, STARTUP_TIME)]
    out = []
    for title, patterns in PANELS:
        if title == "Held-out accuracy":  # one panel per validation set before
            for name in eval_sets(left):
                metrics = [
                    n
                    for n in left
                    if n.startswith(f"eval/{name}/")
                    and not n.removesuffix(CHECKPOINT_EVAL).endswith(("/std", STDERR))
                ]
                out.append((f"Held-out: {name}", _line_figure(series, metrics)))
                bars = [_stderr(n) for n in metrics]  # drawn as the lines' error bars
                left = [n for n in left if n not in metrics and n not in bars]
        names = [n for n in left if any(fnmatchcase(n, p) for p in patterns)]
        if names:
            out.append((title, _line_figure(series, names)))
            left = [n for n in left if n not in names]
        if title == "Clip fraction":  # time per phase goes before throughput
            phases = [n for n in left if n.startswith("timing/")]
            if phases or STEP_TIME in series:
                out.append(("Time per phase (s)", _timing_figure(series, phases)))
                left = [n for n in left if n not in phases]
    parts = [n for n in left if n.startswith("startup/")]
    if parts:
        out.append(("Start-up (s)", _startup_figure(series, parts)))
        left = [n for n in left if n not in parts]
    groups: dict[str, list[str]] = {}
    for name in left:
        groups.setdefault(name.split("/")[0] if "/" in name else "other", []).append(name)
    out.extend((prefix, _grid_figure(series, names)) for prefix, names in sorted(groups.items()))
    return out


def _stderr(name: str) -> str:
    """The name of ``name``'s standard error (``<metric>/stderr``, before `` (treadle eval)``)."""
    if name.endswith(CHECKPOINT_EVAL):
        return name.removesuffix(CHECKPOINT_EVAL) + STDERR + CHECKPOINT_EVAL
    return name + STDERR


def _line_figure(series: Series, names: list[str]) -> go.Figure:
    fig = go.Figure()
    for name in names:
        steps, values = series[name]
        dash = "dash" if name.endswith(CHECKPOINT_EVAL) else None
        errors = dict(zip(*series.get(_stderr(name), ([], [])), strict=True))
        bars = {"type": "data", "array": [errors.get(s, 0.0) for s in steps]} if errors else None
        fig.add_trace(
            go.Scatter(
                x=steps, y=values, name=name, mode=_mode(steps), line={"dash": dash}, error_y=bars
            )
        )
    fig.update_xaxes(title_text="step")
    return _layout(fig, height=320, showlegend=True)


def _startup_figure(series: Series, parts: list[str]) -> go.Figure:
    """The seconds of each part of start-up (``startup/<part>``: only the first step of each
    process has them), one group of bars per start (the run's, then each resume's)."""
    starts = sorted({step for name in parts for step in series[name][0]})
    fig = go.Figure()
    for start in starts:
        values = [dict(zip(*series[name], strict=True)).get(start) for name in parts]
        labels = [name.removeprefix("startup/") for name in parts]
        fig.add_trace(go.Bar(x=labels, y=values, name=f"before step {start}"))
    return _layout(fig, height=320, showlegend=True)


def _timing_figure(series: Series, phases: list[str]) -> go.Figure:
    """Seconds of each phase stacked per step: the step's phases, "other" (the rest of
    ``timing/step``, in no named phase; "step" when no phase is timed), then evaluation, which
    runs after the step."""
    inside = [n for n in phases if n not in AFTER_STEP]
    fig = go.Figure()
    for name in inside:
        fig.add_trace(go.Bar(x=series[name][0], y=series[name][1], name=_phase(name)))
    if STEP_TIME in series:
        by_step = [dict(zip(*series[n], strict=True)) for n in inside]
        steps, totals = series[STEP_TIME]
        other = [
            max(0.0, total - sum(p.get(step, 0.0) for p in by_step))
            for step, total in zip(steps, totals, strict=True)
        ]
        name = "other" if inside else "step"
        fig.add_trace(go.Bar(x=steps, y=other, name=name, marker_color="#bbbbbb"))
    for name in phases:
        if name in AFTER_STEP:
            fig.add_trace(go.Bar(x=series[name][0], y=series[name][1], name=_phase(name)))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="step")
    return _layout(fig, height=360, showlegend=True)


def _phase(name: str) -> str:
    return name.removeprefix("timing/")


def _grid_figure(series: Series, names: list[str]) -> go.Figure:
    """One small panel per series (their scales differ), three to a row."""
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=names, vertical_spacing=0.3 / rows)
    for i, name in enumerate(names):
        steps, values = series[name]
        fig.add_trace(
            go.Scatter(x=steps, y=values, name=name, mode=_mode(steps)),
            row=i // cols + 1,
            col=i % cols + 1,
        )
    fig.update_annotations(font_size=12)
    return _layout(fig, height=80 + 220 * rows, showlegend=False)


def _layout(fig: go.Figure, height: int, showlegend: bool) -> go.Figure:
    fig.update_layout(
        height=height,
        margin={"l": 50, "r": 20, "t": 40, "b": 40},
        template="plotly_white",
        showlegend=showlegend,
        hovermode="x unified",
        legend={"orientation": "h", "x": 0, "y": 1, "yanchor": "bottom"},
    )
    return fig


def _mode(steps: list[float]) -> str:
    return "lines+markers" if len(steps) <= 30 else "lines"  # markers hide a long line


# --- the page ----------------------------------------------------------------------------------

# auto-fill, not auto-fit: each plot is sized when its script runs, while the page is still
# being read, and auto-fit would stretch the first plot, alone so far, over the whole row.
STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1400px; padding: 0 16px;
       color: #222; }
h1 { font-size: 1.5em; margin-bottom: 4px; } h2 { margin-top: 32px; }
.path { color: #666; font-family: monospace; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 16px; }
.plots section { border: 1px solid #ddd; border-radius: 6px; padding: 8px; }
.plots section.wide { grid-column: 1 / -1; }
.plots h3 { margin: 4px 8px; font-size: 1em; }
table { border-collapse: collapse; font-size: 0.9em; }
table.config { width: 100%; }
td, th { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } tr.section th { background: #e8eef7; }
td.text { white-space: pre-wrap; font-family: monospace; max-width: 560px;
          overflow-wrap: anywhere; }
div.config { display: grid; grid-template-columns: repeat(auto-fill, minmax(440px, 1fr));
              gap: 16px; align-items: start; }
td.num { text-align: right; font-family: monospace; }
ul.findings { font-size: 1.05em; line-height: 1.5; }
"""


def _page(
    run: Path, series: Series, config: dict[str, Any] | None, samples: list[dict[str, Any]]
) -> str:
    plots = []
    for title, fig in figures(series):
        # a group's grid of panels and the stacked timings take a whole row
        wide = len(fig.data) > 1 and title not in {t for t, _ in PANELS}
        div = fig.to_html(
            full_html=False,
            include_plotlyjs=False,
            config={"displaylogo": False, "responsive": True},
        )
        plots.append(
            f'<section class="{"wide" if wide else ""}"><h3>{html.escape(title)}</h3>{div}'
            "</section>"
        )
    name = html.escape(run.resolve().name)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>treadle report: {name}</title>
<style>{STYLE}</style>
<script>{get_plotlyjs()}</script>
</head><body>
<h1>treadle run report: {name}</h1>
<div class="path">{html.escape(str(run.resolve()))}</div>
{_summary(series, config)}
{learning_section(series)}
<h2>Metrics</h2>
<div class="plots">
{"".join(plots)}
</div>
{_profiles(run)}
{_samples_table(samples)}
{_config_table(config)}
</body></html>
"""


def _summary(series: Series, config: dict[str, Any] | None) -> str:
    rows: list[tuple[str, str]] = []
    steps = sorted({s for steps, _ in series.values() for s in steps})
    if steps:
        rows.append(("steps logged", f"{len(steps)} (step {steps[0]:g} to {steps[-1]:g})"))
    model = ((config or {}).get("model") or {}).get("path")
    if model is not None:
        rows.append(("model", str(model)))
    if STARTUP_TIME in series:
        rows.append(("start-up", f"{series[STARTUP_TIME][1][0]:.1f} s"))
    if STEP_TIME in series:
        rows.append(("time in steps", f"{sum(series[STEP_TIME][1]):.1f} s"))
    # the step's peaks (local backend) or, with Ray workers, those of their updates
    peaks = [[max(v) for k, (_, v) in series.items() if k.startswith(name)] for name in MEMORY]
    if all(peaks):
        allocated, reserved = (max(p) for p in peaks)
        rows.append(("peak device memory", f"{allocated:.2f} GiB ({reserved:.2f} GiB reserved)"))
    for name in ("reward/mean", *accuracy_keys(series), "eval/pair_accuracy"):
        if name in series:
            step, value = series[name][0][-1], series[name][1][-1]
            rows.append((f"last {name}", f"{value:.4g} (step {step:g})"))
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="summary">{body}</table>'


def _profiles(run: Path) -> str:
    """The profiled steps (``trainer.profile_steps``): each process's table and trace, linked,
    and the ranges of the driver's table."""
    steps = {f: f.name.removeprefix("step_") for f in run.glob("profile/step_*/")}
    folders = sorted((f for f, n in steps.items() if n.isdigit()), key=lambda f: int(steps[f]))
    if not folders:
        return ""
    parts = [
        "<h2>Profiled steps</h2><p>trainer.profile_steps: for each process, a table (the "
        "ranges below, then the kernels and operators of the most time) and a trace to open "
        'in <a href="https://ui.perfetto.dev">Perfetto</a>.</p>'
    ]
    for folder in folders:
        tables = sorted(folder.glob("*.txt"), key=lambda t: (t.stem != "driver", t.stem))
        links = ", ".join(
            f'<a href="{quote(t.relative_to(run).as_posix())}">{html.escape(t.stem)}</a> '
            f'(<a href="{quote(t.with_suffix(".json.gz").relative_to(run).as_posix())}">trace</a>)'
            for t in tables
        )
        shown = ranges_part(tables[0].read_text(encoding="utf-8")) if tables else ""
        parts.append(
            f"<h3>{html.escape(folder.name.replace('_', ' '))}</h3><p>{links}</p>"
            f"<pre>{html.escape(shown)}</pre>"
        )
    return "".join(parts)


def _samples_table(samples: list[dict[str, Any]]) -> str:
    if not samples:
        return ""
    shown = samples[-MAX_SAMPLES:]
    note = (
        f"<p>The newest {len(shown)} of {len(samples)} samples in samples.jsonl.</p>"
        if len(shown) < len(samples)
        else ""
    )
    columns = ["step", "prompt", "response", "reward", "ground_truth"]
    columns += sorted({k for s in shown for k in s} - set(columns))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(_cell(s.get(c)) for c in columns) + "</tr>" for s in shown)
    return (
        f'<h2>Samples</h2>{note}<table class="samples"><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table>"
    )


def _cell(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f'<td class="num">{value:.4g}</td>'
    text = value if isinstance(value, str) else "" if value is None else json.dumps(value)
    return f'<td class="text">{html.escape(text)}</td>'


def _config_table(config: dict[str, Any] | None) -> str:
    """One small table per section, laid out side by side."""
    if config is None:
        return "<h2>Config</h2><p>No config.yaml in the run directory.</p>"
    tables = []
    for section, values in config.items():
        items = values.items() if isinstance(values, dict) else [("", values)]
        rows = "".join(
            f"<tr><td>{html.escape(str(key))}</td>{_value(value)}</tr>" for key, value in items
        )
        tables.append(
            f'<table class="config"><tr class="section"><th colspan="2">'
            f"{html.escape(str(section))}</th></tr>{rows}</table>"
        )
    return (
        "<h2>Config</h2><p>The resolved config (config.yaml).</p>"
        f'<div class="config">{"".join(tables)}</div>'
    )


def _value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return f'<td class="text">{html.escape(text)}</td>'
