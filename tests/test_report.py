"""``treadle report``: the page built from a hand-made run directory with known numbers, its bad
input, and the page opened from file:// in a real headless chromium (Debian's, driven by
Playwright; ``make test`` installs it when it is missing)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from treadle.cli import main
from treadle.tracking.report import checkpoint_series, figures, numeric_series, read_jsonl

CHROMIUM = "/usr/bin/chromium"
SCRIPT = "<script>window.pwned = 1</script>"  # model text is untrusted: it must stay text
REWARD = [0.1, 0.25, 0.5, 0.75]
ACCURACY = {2: 0.3, 4: 0.6}  # held-out evaluation every 2 steps
TITLES = [
    "Reward",
    "Held-out: val",
    "KL",
    "Entropy",
    "Response length",
    "Clip fraction",
    "Time per phase (s)",
    "Throughput",
    "Start-up (s)",
    "actor",
    "rollout",
]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """What an RL run leaves: 4 steps of metrics, the resolved config, two logged samples."""
    records = []
    for i, reward in enumerate(REWARD):
        step = i + 1
        record = {
            "step": step,
            "reward/mean": reward,
            "reward/max": 1.0,
            "actor/kl": "nan" if step == 3 else 0.01 * step,  # the tracker writes NaN so
            "actor/entropy": 2.0 - 0.1 * step,
            "actor/pg_loss": -0.05 * step,
            "actor/clip_frac": 0.02,
            "response/length_mean": 10.0 + step,
            "rollout/weight_version": step,
            "timing/generate": 1.5,
            "timing/update_actor": 0.5 * step,
            "timing/step": 2.5 + 0.5 * step,
            "throughput/tokens_per_s": 100.0 * step,
        }
        if step in (1, 3):  # the first step of the run and of a resumed process
            record.update({"timing/startup": 9.0 * step, "startup/ray": 1.0 * step})
            record["startup/workers"] = 5.0 + step
        if step in ACCURACY:
            record["eval/val/accuracy"] = ACCURACY[step]
            record["timing/eval"] = 0.7  # after the step, outside timing/step
        records.append(record)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {
        "model": {"path": "runs/sft/final_model", "dtype": "float32"},
        "rollout": {"n": 8, "engine": "hf"},
        "algorithm": {"adv_estimator": "grpo", "kl_coef": 0.001},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    samples = [
        {"step": 2, "prompt": "1+2=", "response": "3 <b>bold</b>", "reward": 1.0,
         "ground_truth": "3"},
        {"step": 4, "prompt": "5+7=", "response": SCRIPT, "reward": 0.0, "ground_truth": "12"},
    ]  # fmt: skip
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return tmp_path


def test_panels_plot_the_run_s_series(run_dir):
    series = numeric_series(read_jsonl(run_dir / "metrics.jsonl"))
    figs = dict(figures(series))
    assert list(figs) == TITLES
    reward = {t.name: list(t.y) for t in figs["Reward"].data}
    assert reward == {"reward/mean": REWARD, "reward/max": [1.0] * 4}
    (accuracy,) = figs["Held-out: val"].data
    assert list(accuracy.x) == [2, 4] and list(accuracy.y) == [0.3, 0.6]
    kl = figs["KL"].data[0].y
    assert kl[2] != kl[2] and kl[3] == pytest.approx(0.04)  # NaN stays a gap
    timing = figs["Time per phase (s)"]
    assert timing.layout.barmode == "stack"
    assert [t.name for t in timing.data] == ["generate", "update_actor", "other", "eval"]
    assert {t.type for t in timing.data} == {"bar"}
    assert list(timing.data[1].y) == [0.5, 1.0, 1.5, 2.0]
    assert list(timing.data[2].y) == pytest.approx([1.0] * 4)  # step - generate - update
    assert list(timing.data[3].x) == [2, 4]  # evaluation: on top, not taken from the step
    # start-up: one group of bars per process start, a bar per part
    startup = figs["Start-up (s)"].data
    assert [t.name for t in startup] == ["before step 1", "before step 3"]
    assert [list(t.x) for t in startup] == [["ray", "workers"]] * 2
    assert [list(t.y) for t in startup] == [[1.0, 6.0], [3.0, 8.0]]
    # the rest, one small panel per series, grouped by prefix
    assert [t.name for t in figs["actor"].data] == ["actor/pg_loss"]
    assert [t.name for t in figs["rollout"].data] == ["rollout/weight_version"]


def test_each_validation_set_has_a_panel_with_the_checkpoints_evaluation(run_dir):
    """Sets of metrics.jsonl (in training) and of eval.jsonl (`treadle eval RUN_DIR`, dashed)."""
    lines = [
        {"step": 2, "eval/val/accuracy": 0.3, "eval/hard/accuracy": 0.1, "eval/hard/pass@4": 0.2},
        {"step": 4, "eval/val/accuracy": 0.6, "eval/hard/accuracy": 0.2, "eval/hard/pass@4": 0.5},
    ]
    for line in lines:
        line["eval/hard/pass@4/std"] = 0.01
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({**r, "reward/mean": 0.5}) + "\n" for r in lines)
    )
    checkpoints = [{**r, "eval/val/accuracy": r["eval/val/accuracy"] + 0.05} for r in lines]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in checkpoints))
    series = numeric_series(read_jsonl(run_dir / "metrics.jsonl"))
    series.update(checkpoint_series(run_dir / "eval.jsonl"))
    figs = dict(figures(series))
    assert list(figs)[:3] == ["Reward", "Held-out: val", "Held-out: hard"]
    val = {t.name: (list(t.x), list(t.y), t.line.dash) for t in figs["Held-out: val"].data}
    assert val == {
        "eval/val/accuracy": ([2, 4], [0.3, 0.6], None),
        "eval/val/accuracy (treadle eval)": ([2, 4], [0.35, 0.65], "dash"),
    }
    hard = [t.name for t in figs["Held-out: hard"].data]
    assert hard == [
        "eval/hard/accuracy",
        "eval/hard/pass@4",
        "eval/hard/accuracy (treadle eval)",
        "eval/hard/pass@4 (treadle eval)",
    ]
    assert "Held-out accuracy" not in figs  # (the sets' accuracies are in their panels)
    # the bootstrap std goes with the other eval series, apart
    assert {t.name for t in figs["eval"].data} == {
        "eval/hard/pass@4/std",
        "eval/hard/pass@4/std (treadle eval)",
    }


def test_report_command_writes_one_self_contained_page(run_dir, capsys):
    assert main(["report", str(run_dir)]) == 0
    out = run_dir / "report.html"
    assert capsys.readouterr().out == f"report: {out}\n"
    page = out.read_text()
    assert SCRIPT not in page and "&lt;script&gt;window.pwned = 1&lt;/script&gt;" in page
    assert "3 &lt;b&gt;bold&lt;/b&gt;" in page
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)=", page)  # all inline
    assert "<h2>Is it learning?</h2>" in page  # (tests/test_report_learning.py: its rules)
    drawn = len(TITLES) + 1  # the panels, and "Is it learning?"'s plots
    assert "Plotly" in page and page.count('class="plotly-graph-div"') == drawn


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (shutil.rmtree, "{d}: no such directory"),
        (lambda d: None, "{d}: no metrics.jsonl (not a run directory"),
        (lambda d: (d / "metrics.jsonl").write_text(""), "{d}/metrics.jsonl: no steps yet"),
        (
            lambda d: (d / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "reward/m'),
            "{d}/metrics.jsonl line 2: not valid JSON (Unterminated string",
        ),
        (
            lambda d: (d / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n'),
            "{d}/metrics.jsonl line 2: not a JSON object",
        ),
        (
            lambda d: (d / "metrics.jsonl").write_text('{"step": 1}\n{"reward/mean": 1}\n'),
            "{d}/metrics.jsonl line 2: no integer 'step'",
        ),
        (
            lambda d: [
                (d / "metrics.jsonl").write_text('{"step": 1}\n'),
                (d / "samples.jsonl").write_text('{"step": 1}\n\n{"step": 1, "prompt"\n'),
            ],
            "{d}/samples.jsonl line 3: not valid JSON",
        ),
        (
            lambda d: [
                (d / "metrics.jsonl").write_text('{"step": 1}\n'),
                (d / "config.yaml").write_text("model:\n  path: [a\n"),
            ],
            "{d}/config.yaml: cannot read the resolved config: while parsing",
        ),
        (
            lambda d: [
                (d / "metrics.jsonl").write_text('{"step": 1}\n'),
                (d / "eval.jsonl").write_text('{"step": 1}\n{"eval/val/accuracy": 1}\n'),
            ],
            "{d}/eval.jsonl line 2: no integer 'step'",
        ),
    ],
    ids=[
        "missing",
        "not-a-run",
        "empty",
        "cut-line",
        "not-object",
        "no-step",
        "bad-sample",
        "bad-config",
        "bad-eval",
    ],
)
def test_bad_run_dir_is_one_line_naming_file_and_line(tmp_path, capsys, setup, message):
    run = tmp_path / "run"
    run.mkdir()
    setup(run)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("treadle: error: " + message.format(d=run)), err
    assert err.count("\n") == 1
    assert not (run / "report.html").exists()


@pytest.mark.slow
def test_page_loads_offline_in_chromium_with_plots_and_tables(run_dir):
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), f"no {CHROMIUM}: `make browser` installs it (make test does)"
    assert main(["report", str(run_dir)]) == 0
    url = (run_dir / "report.html").as_uri()
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
                "--disable-sync",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: m.type == "error" and problems.append(m.text))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))
            page.on("request", lambda r: r.url == url or problems.append(f"request: {r.url}"))
            page.goto(url)
            n = len(TITLES)
            page.wait_for_function(
                f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {n}",
                timeout=30_000,
            )
            # every plot div drawn, and the numbers read back from the rendered graph
            plots = page.locator("section")
            assert plots.locator("h3").all_inner_texts() == TITLES
            assert page.locator(".js-plotly-plot").count() == n + 1  # and "Is it learning?"
            drawn = page.evaluate(
                "[...document.querySelectorAll('.js-plotly-plot')]"
                ".map(g => g.querySelectorAll('.scatterlayer .trace, .barlayer .trace').length)"
            )
            assert all(drawn), drawn
            overflow = page.evaluate(
                "[...document.querySelectorAll('section')].filter(s => s.querySelector("
                "'.main-svg').getBoundingClientRect().right > s.getBoundingClientRect().right)"
                ".length"
            )
            assert overflow == 0  # each plot fits its box (plotly sizes them to it)
            reward = page.evaluate(
                "document.querySelector('.plots .js-plotly-plot').data"
                ".map(t => [t.name, Array.from(t.y)])"
            )
            assert reward == [["reward/mean", REWARD], ["reward/max", [1, 1, 1, 1]]]
            # the tables: config keys and values, samples with their rewards, as text
            config = page.locator("table.config").all_inner_texts()
            assert any("path\truns/sft/final_model" in t for t in config), config
            assert any("adv_estimator\tgrpo" in t for t in config), config
            rows = page.locator("table.samples tbody tr")
            assert rows.count() == 2
            assert rows.nth(1).locator("td").all_inner_texts() == ["4", "5+7=", SCRIPT, "0", "12"]
            assert page.evaluate("window.pwned") is None  # the sample's script did not run
        finally:
            browser.close()
    assert problems == []


def test_an_sft_run_plots_its_own_series():
    records = [
        {"step": s, "epoch": s / 10, "sft/loss": 2.0 / s, "sft/lr": 1e-3, "timing/step": 0.2}
        for s in (1, 2, 3)
    ]
    figs = dict(figures(numeric_series(records)))
    assert list(figs) == ["Loss", "Time per phase (s)", "other", "sft"]
    assert list(figs["Loss"].data[0].y) == pytest.approx([2.0, 1.0, 2 / 3])
    (step_time,) = figs["Time per phase (s)"].data  # no named phase: the step's time alone
    assert step_time.name == "step" and list(step_time.y) == pytest.approx([0.2] * 3)
    assert [t.name for t in figs["sft"].data] == ["sft/lr"]


def test_a_distillation_run_has_its_panel_first():
    records = [
        {"step": s, "distill/reverse_kl": 0.5 / s, "distill/teacher_log_prob": -1.0 / s}
        | {"reward/mean": 0.1 * s, "timing/step": 0.3}
        for s in (1, 2)
    ]
    figs = dict(figures(numeric_series(records)))
    assert list(figs)[:2] == ["Distillation", "Reward"]
    kl, teacher = figs["Distillation"].data
    assert kl.name == "distill/reverse_kl" and list(kl.y) == pytest.approx([0.5, 0.25])
    assert list(teacher.y) == pytest.approx([-1.0, -0.5])


def test_a_gpu_run_has_its_peak_memory_panel_and_summary(tmp_path):
    """The local backend on a GPU logs each phase's peak device memory and the step's
    (tracking.tracker.timed): one panel of them, and the run's highest in the summary."""
    records = [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "timing/step": 1.0,
            "perf/max_memory_allocated_gib/generate": 3.0 + s,
            "perf/max_memory_allocated_gib/update_actor": 2.0,
            "perf/max_memory_allocated_gib": 3.0 + s,
            "perf/max_memory_reserved_gib": 6.5,
        }
        for s in (1, 2)
    ]
    figs = dict(figures(numeric_series(records)))
    names = [t.name for t in figs["Peak device memory (GiB)"].data]
    assert sorted(names) == sorted(k for k in records[0] if k.startswith("perf/"))
    assert "perf" not in figs  # not also among the rest
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "<th>peak device memory</th><td>5.00 GiB (6.50 GiB reserved)</td>" in page


def test_the_updates_flop_rates_have_their_panels():
    """``perf/tflops/<role>`` on any device, ``perf/mfu/<role>`` on a GPU of known peak: one
    panel each, not the rest's."""
    records = [
        {
            "step": s,
            "timing/step": 1.0,
            "perf/tflops/actor": 300.0 + s,
            "perf/tflops/critic": 200.0,
            "perf/mfu/actor": (300.0 + s) / 989.4,
            "perf/max_memory_allocated_gib": 5.0,
        }
        for s in (1, 2)
    ]
    figs = dict(figures(numeric_series(records)))
    rates = figs["Training TFLOP/s a device"].data
    assert [t.name for t in rates] == ["perf/tflops/actor", "perf/tflops/critic"]
    assert list(rates[0].y) == [301.0, 302.0]
    (mfu,) = figs["MFU (share of the GPU's bf16 peak)"].data
    assert mfu.name == "perf/mfu/actor" and list(mfu.y) == pytest.approx([301 / 989.4, 302 / 989.4])
    assert [t.name for t in figs["Peak device memory (GiB)"].data] == [
        "perf/max_memory_allocated_gib"
    ]


def test_ray_workers_peaks_make_the_summary_s_peak(tmp_path):
    """With Ray workers only their updates report peaks (no step's): the summary shows the
    highest of them."""
    records = [
        {
            "step": s,
            "perf/max_memory_allocated_gib/update_actor": 4.0 + s,
            "perf/max_memory_reserved_gib/update_actor": 7.0,
            "perf/max_memory_allocated_gib/update_critic": 3.0,
            "perf/max_memory_reserved_gib/update_critic": 8.0,
        }
        for s in (1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "<th>peak device memory</th><td>6.00 GiB (8.00 GiB reserved)</td>" in page


def test_profiled_steps_are_linked_with_the_driver_s_ranges(tmp_path):
    """`trainer.profile_steps` left tables and traces under profile/: the page links each
    process's, steps in order (10 after 2), and shows the driver's ranges."""
    import torch

    from treadle.tracking.profiler import StepProfile, phase

    records = [{"step": s, "reward/mean": 0.5} for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for step, process in ((10, "driver"), (2, "actor-rank0"), (2, "driver")):
        profile = StepProfile(tmp_path / f"profile/step_{step}", process)
        profile.start()
        with phase(f"generate_{step}"):
            torch.ones(8) + 1
        profile.stop()
    (tmp_path / "profile/step_notes").mkdir()  # not a step's: left out
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    section = page.split("<h2>Profiled steps</h2>")[1].split("<h2>")[0]
    assert section.index("<h3>step 2</h3>") < section.index("<h3>step 10</h3>")
    assert "step notes" not in section
    step2 = section.split("<h3>step 10</h3>")[0]
    assert step2.index('<a href="profile/step_2/driver.txt">driver</a>') < step2.index(
        '<a href="profile/step_2/actor-rank0.txt">actor-rank0</a>'
    )  # the driver first
    assert '(<a href="profile/step_2/actor-rank0.json.gz">trace</a>)' in step2
    shown = step2.split("<pre>")[1].split("</pre>")[0]
    assert shown.startswith("driver: ") and "treadle/generate_2 " in shown
    assert "the CPU:" not in shown  # the ranges only
