"""The pure helpers of bench/grpo_vs_trl.py: process-tree memory, phases, the table, the ratios.

The benchmark itself is not run here (it times things and takes minutes).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from bench_scripts import bench_script

MIB = 1 << 20


@pytest.fixture(scope="module")
def bench():
    with bench_script("grpo_vs_trl") as module:
        yield module


# A child that starts a grandchild holding 100 MiB, then holds 200 MiB itself; both filled with
# non-zero bytes so the pages are resident. It says "ready" and waits for stdin to close.
CHILD = """
import subprocess, sys
grandchild = subprocess.Popen(
    [sys.executable, "-c", "import sys; b = b'x' * (100 << 20); print('ready', flush=True); "
     "sys.stdin.read()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
)
grandchild.stdout.readline()
held = b"y" * (200 << 20)
print("ready", flush=True)
sys.stdin.read()
grandchild.stdin.close()
grandchild.wait()
"""


def test_tree_memory_sums_a_process_and_its_descendants(bench):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        processes = bench.tree_memory(proc.pid)
        cheap = bench.tree_memory(proc.pid, with_pss=False)
        peak = bench.TreePeak(proc.pid)
        peak.sample()  # the first sample is a new peak: PSS is read
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert len(processes) == 2
    rss = sum(p[1] for p in processes)
    pss = sum(p[2] for p in processes)
    # 300 MiB held, plus two interpreters (~10-20 MiB each).
    assert 300 * MIB <= rss <= 380 * MIB
    assert 290 * MIB <= pss <= rss
    assert [p[2] for p in cheap] == [0, 0]
    assert 300 * MIB <= peak.rss <= 380 * MIB and 290 * MIB <= peak.pss <= peak.rss
    biggest = max(processes, key=lambda p: p[1])
    assert 200 * MIB <= biggest[1] <= 240 * MIB


def test_tree_peak_keeps_the_highest_sums_and_the_processes_at_the_rss_peak(bench):
    peak = bench.TreePeak(pid=0)
    peak.update([("a", 100, 90), ("b", 50, 40)])
    peak.update([("a", 120, 60), ("c", 20, 20)])  # RSS 140 < 150; PSS 80 < 130
    peak.update([("a", 10, 200)])  # PSS peak alone
    assert (peak.rss, peak.pss) == (150, 200)
    assert peak.at_peak == [("a", 100, 90), ("b", 50, 40)]


def test_phases_split_each_side_step_the_same_way(bench):
    trl = bench.trl_phases(
        {
            "step": 10.0,
            "generate": 4.0,
            "prepare": 4.5,
            "logps_in_prepare": 0.25,
            "generated_tokens": 2048.0,
            "prompt_tokens": 544.0,
        }
    )
    assert trl["training"] == pytest.approx(10.0 - 4.5 + 0.25)
    assert trl["other"] == pytest.approx(4.5 - 4.0 - 0.25)
    assert trl["tokens_per_s"] == pytest.approx(512.0)
    ours = bench.treadle_phases(
        {
            "step": 6.0,
            "generate": 2.0,
            "reward": 0.1,
            "old_log_probs": 0.5,
            "update_actor": 3.0,
            "sync_weights": 0.2,
            "advantages": 0.05,
            "generated_tokens": 2048.0,
            "prompt_tokens": 544.0,
        }
    )
    assert ours["training"] == pytest.approx(3.7)
    assert ours["other"] == pytest.approx(0.3)
    assert ours["tokens_per_s"] == pytest.approx(1024.0)


def test_medians_skip_the_warmup(bench):
    records = [{"step": 100.0}, {"step": 3.0}, {"step": 1.0}, {"step": 2.0}]
    assert bench.medians(records, warmup=1) == {"step": 2.0}
    with pytest.raises(ValueError, match="no step after the 4 warm-up steps"):
        bench.medians(records, warmup=4)


def summary(step, rss_gib, **other):
    base = {
        "generation": 1.0,
        "training": 1.0,
        "other": 0.5,
        "tokens_per_s": 100.0,
        "peak_pss_gib": 1.0,
    }
    return {**base, **other, "step": step, "peak_rss_gib": rss_gib}


def test_table_and_closing_ratio_lines(bench):
    trl, ours = summary(4.0, 2.0, tokens_per_s=500.0), summary(1.0, 3.0, tokens_per_s=1000.0)
    table = bench.format_table(trl, ours)
    assert len(table) == 4 and len({len(line) for line in table}) == 1  # aligned
    header = "step s  generation s  training s  other s  gen tokens/s  peak RSS GiB  peak PSS GiB"
    assert table[0].split() == header.split()
    assert table[1].split() == ["TRL", "4.00", "1.00", "1.00", "0.50", "500", "2.00", "1.00"]
    ratios = ["0.25", "1.00", "1.00", "1.00", "2.00", "1.50", "1.00"]
    assert table[3].split() == ["treadle/TRL", *ratios]
    results = {"tiny": (trl, ours), "smollm2-135m": (summary(10.0, 4.0), summary(4.0, 5.0))}
    assert bench.ratio_lines(results) == [
        "ratio step_time treadle/trl tiny: 0.25",
        "ratio step_time treadle/trl smollm2-135m: 0.40",
        "ratio peak_rss treadle/trl tiny: 1.50",
        "ratio peak_rss treadle/trl smollm2-135m: 1.25",
    ]


def test_kv_cache_is_sized_to_the_workload(bench, tmp_path):
    config = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    config["num_hidden_layers"] = 30
    (tmp_path / "config.json").write_text(json.dumps(config))
    # 30 layers x (K, V) x 3 heads x 64 dims x 4 bytes; 128 + 64 tokens -> 2 blocks of 128.
    expected = 1.5 * 32 * 256 * (30 * 2 * 3 * 64 * 4) / (1 << 30)
    assert bench.kv_cache_gib(tmp_path, 32, 64, "float32") == pytest.approx(expected, abs=1e-3)
    assert bench.kv_cache_gib(tmp_path, 32, 64, "bfloat16") == pytest.approx(expected / 2, abs=1e-3)


def test_model_list_is_checked(bench):
    assert bench.parse_args(["--models", "smollm2-135m"]).models == ["smollm2-135m"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "tiny,gpt5"])
