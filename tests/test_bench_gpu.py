"""The pure parts of bench/gpu.py: the workloads' tokenizer and prompts, the shapes' sizes, the
summary of each side's steps and the closing ratio lines. (The benchmark itself runs with
``--tiny`` on a CPU in ~1 min when idle; its numbers are no test's business.)"""

from __future__ import annotations

import pytest
from bench_scripts import bench_script

GIB = float(1 << 30)


def record(step: float, **phases: float) -> dict:
    """A side's step record: ``step`` seconds, 8 tokens generated from 16."""
    return {"step": step, "generated_tokens": 8.0, "prompt_tokens": 16.0, **phases}


def side(step: float, **phases: float) -> dict:
    """A side measured on one step (after no warm-up), 2 GiB peak RSS."""
    return {"steps": [record(step, **phases)], "memory": {"peak_rss": 2 * GIB}}


@pytest.fixture(scope="module")
def bench():
    with bench_script("gpu") as module:
        yield module


def test_the_tokenizer_reads_back_as_treadle_and_trl_load_it(bench, tmp_path):
    """Every id the model can sample decodes to a word; a prompt of P words is P tokens,
    through treadle's loader and AutoTokenizer (TRL's) alike, with the chat template applied."""
    from transformers import AutoTokenizer

    from treadle.models.loading import load_tokenizer

    wl = bench.WORKLOADS["tiny"]
    folder = bench.build_model(wl, tmp_path / "model", prompt_tokens=8)
    rows = bench.write_prompts(wl, tmp_path / "prompts.jsonl", prompt_tokens=8).read_text()
    prompt = __import__("json").loads(rows.splitlines()[0])["prompt"]
    for tok in (load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)):
        assert len(tok) == wl.shape["vocab_size"] == 512
        chat = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False)
        assert chat == prompt
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        assert len(ids) == 8 and min(ids) >= 3  # words, no special or unknown token
        assert tok.decode(ids) == prompt
        assert tok.decode([3, 511]) == "w3 w511"


def test_the_workloads_have_the_shapes_they_are_named_after(bench):
    from transformers import AutoConfig

    def parameters(name: str) -> int:
        wl = bench.WORKLOADS[name]
        c = AutoConfig.for_model(wl.architecture, **wl.shape, tie_word_embeddings=True)
        h, layers, v = c.hidden_size, c.num_hidden_layers, c.vocab_size
        kv = c.num_key_value_heads * (h // c.num_attention_heads)
        attention = 2 * h * h + 2 * h * kv + (2 * h + 2 * kv if c.attention_bias else 0)
        return v * h + layers * (attention + 3 * h * c.intermediate_size + 2 * h) + h

    assert parameters("smollm2") == 134_515_008  # SmolLM2-135M
    assert parameters("1.4b") == pytest.approx(1.39e9, rel=0.01)  # Qwen2.5-1.5B at 49,152 words
    big = bench.WORKLOADS["1.4b"]
    assert (big.prompts, big.n, big.new_tokens) == (32, 8, 256)


def test_summary_and_ratio_lines(bench):
    """The median step; peak memory the highest of the measured steps (TRL's in bytes,
    treadle's in GiB), or the process's peak RSS on a CPU."""

    def step(s: float, gen: float) -> dict[str, float]:
        return {"step": s, "generate": gen, "generated_tokens": 64.0, "prompt_tokens": 32.0}

    trl_steps = [
        {**step(9.0, 5.0), "prepare": 6.0, "max_memory_allocated": 9 * GIB}
        | {"max_memory_reserved": 10 * GIB},
        *(
            {**step(s, 2.0), "prepare": 2.5, "max_memory_allocated": m * GIB}
            | {"max_memory_reserved": 5 * GIB}
            for s, m in ((4.0, 3.0), (5.0, 4.0), (6.0, 3.5))
        ),
    ]
    ours_steps = [
        {**step(3.0, 1.0), "update_actor": 1.5, "sync_weights": 0.1}
        | {"perf/max_memory_allocated_gib": m, "perf/max_memory_reserved_gib": 2.5}
        for m in (9.0, 2.0, 1.5, 2.25)
    ]
    trl = bench.summary({"steps": trl_steps}, bench.base.trl_phases, bench.TRL_MEMORY, 1)
    ours = bench.summary({"steps": ours_steps}, bench.base.treadle_phases, bench.TREADLE_MEMORY, 1)
    assert trl["step"] == 5.0 and trl["generation"] == 2.0 and trl["training"] == 2.5
    assert (trl["peak_gib"], trl["reserved_gib"]) == (4.0, 5.0)  # not the warm-up's 9
    assert ours["training"] == pytest.approx(1.6) and ours["peak_gib"] == 2.25
    cpu = bench.summary(
        {"steps": [step(1.0, 0.5), step(1.0, 0.5)], "memory": {"peak_rss": 3 * GIB}},
        bench.base.treadle_phases,
        bench.TREADLE_MEMORY,
        1,
    )
    assert cpu["peak_gib"] == 3.0
    lines = bench.base.ratio_lines({"1.4b": (trl, ours)}, bench.RATIOS)
    assert lines == [
        "ratio step_time treadle/trl 1.4b: 0.60",
        "ratio peak_memory treadle/trl 1.4b: 0.56",
    ]


def test_the_tiny_flag_the_workloads_and_the_caches(bench, tmp_path):
    args = bench.parse_args(["--tiny", "--device", "cpu"])
    assert (args.workloads, args.prompt_tokens, args.caches) == (["tiny"], 8, ["dynamic"])
    both = bench.parse_args(
        ["--tiny", "--device", "cpu", "--cache", "dynamic,static", "--workdir", str(tmp_path)]
    )
    assert both.caches == ["dynamic", "static"]
    paths = bench.workload_paths(both, "tiny")
    assert "rollout.cache_implementation=static" in bench.treadle_overrides(
        both, bench.WORKLOADS["tiny"], paths, "static"
    )
    assert bench.parse_args(["--device", "cpu"]).workloads == ["smollm2", "1.4b"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--workloads", "smollm2,7b", "--device", "cpu"])
    assert bench.parse_args(["--cache", "paged", "--device", "cpu"]).caches == ["paged"]
    offload = bench.parse_args(["--tiny", "--device", "cpu", "--cache", "dynamic,static+offload"])
    keys = bench.treadle_overrides(offload, bench.WORKLOADS["tiny"], paths, "static+offload")
    assert "rollout.cache_implementation=static" in keys
    assert {"actor.offload_params=true", "actor.offload_optimizer=true"} <= set(keys)
    assert not any(
        "offload" in k
        for k in bench.treadle_overrides(both, bench.WORKLOADS["tiny"], paths, "static")
    )
    for bad in ("compiled", "static,static", "offload", "dynamic+offload,dynamic+offload"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--cache", bad, "--device", "cpu"])


def test_the_gpu_s_precision_on_a_cpu(bench, tmp_path):
    """``--precision``: bf16 mixed precision and gradient checkpointing on both sides on a GPU
    (auto) or where asked (a CPU's dry run of the GPU's settings); float32 on a CPU."""
    flags = ["--tiny", "--device", "cpu", "--workdir", str(tmp_path)]
    gpu_keys = {
        "rollout.dtype=bfloat16",
        "actor.mixed_precision=bf16",
        "actor.gradient_checkpointing=true",
    }
    for precision, want in (("auto", "float32"), ("float32", "float32"), ("bf16", "bf16")):
        args = bench.parse_args([*flags, "--precision", precision])
        assert args.precision == want
        wl, paths = bench.WORKLOADS["tiny"], bench.workload_paths(args, "tiny")
        keys = set(bench.treadle_overrides(args, wl, paths, "dynamic"))
        assert (gpu_keys <= keys) == (want == "bf16")
        dtype = "bfloat16" if want == "bf16" else "float32"
        assert f"--dtype={dtype}" in bench.side_command(args, "tiny", "trl")


def test_one_trl_run_against_each_cache(bench):
    """``--cache dynamic,static``: a table for each cache against the one TRL run, and ratio
    lines named by workload and cache."""
    args = bench.parse_args(["--tiny", "--device", "cpu", "--cache", "dynamic,static"])
    args.steps, args.warmup = 1, 0

    trl = side(4.0, generate=2.0, prepare=2.5)
    measured = {
        "tiny": {
            "trl": trl,
            "treadle_dynamic": side(2.0, generate=1.0, update_actor=0.8),
            "treadle_static": side(1.0, generate=0.25, update_actor=0.6),
        }
    }
    lines = bench.report(args, measured)
    assert lines[-4:] == [
        "ratio step_time treadle/trl tiny dynamic: 0.50",
        "ratio step_time treadle/trl tiny static: 0.25",
        "ratio peak_memory treadle/trl tiny dynamic: 1.00",
        "ratio peak_memory treadle/trl tiny static: 1.00",
    ]
    titles = [line for line in lines if line.startswith("treadle on the")]
    assert titles == ["treadle on the dynamic KV cache:", "treadle on the static KV cache:"]
    table = lines.index("the README's table:")
    assert lines[table + 3 : table + 6] == [  # (peak RSS: 2 GiB each side)
        "| a tiny Llama (the script's own check, on a CPU), 2 x 2 x 4 | dynamic | 4.00 | 2.00 "
        "| 0.50 | 2.00 | 2.00 | 1.00 |",
        "| a tiny Llama (the script's own check, on a CPU), 2 x 2 x 4 | static | 4.00 | 1.00 "
        "| 0.25 | 2.00 | 2.00 | 1.00 |",
        "",
    ]


def test_the_sides_run_in_order_of_what_matters_most(bench):
    """Every workload's TRL run and treadle's first cache, then treadle's other caches in
    their order, the 1.4b workload's first (256 decoding steps a sample against 64)."""
    args = bench.parse_args(["--device", "cpu", "--cache", "dynamic,static,paged"])
    assert bench.plan(args) == [
        ("smollm2", "trl"),
        ("smollm2", "treadle_dynamic"),
        ("1.4b", "trl"),
        ("1.4b", "treadle_dynamic"),
        ("1.4b", "treadle_static"),
        ("1.4b", "treadle_paged"),
        ("smollm2", "treadle_static"),
        ("smollm2", "treadle_paged"),
    ]
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--deadline-s", "0"])


def test_a_side_past_the_deadline_is_killed_and_a_failed_one_named(bench, tmp_path):
    import sys
    import time

    log = tmp_path / "side.log"
    start = time.perf_counter()
    sleeper = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(600)"]
    with pytest.raises(bench.SideFailed, match="killed at --deadline-s") as killed:
        bench.run_side(sleeper, log, 1, timeout=2.0)
    assert time.perf_counter() - start < 300  # the kill came, not the sleep's end
    assert "started" in str(killed.value)  # the log's tail
    assert killed.value.killed and killed.value.memory["wall_s"] >= 2.0
    failing = [sys.executable, "-c", "print('no cuda here'); raise SystemExit(3)"]
    with pytest.raises(bench.SideFailed, match=r"^exit 3; .*\n.*no cuda here") as failed:
        bench.run_side(failing, log, 1)
    assert not failed.value.killed
    ok = bench.run_side([sys.executable, "-c", "pass"], log, 1, timeout=300)
    assert ok["wall_s"] > 0 and ok["peak_rss"] > 0


def test_no_side_starts_after_the_deadline(bench, tmp_path):
    import time

    args = bench.parse_args(["--tiny", "--device", "cpu", "--workdir", str(tmp_path)])
    measured = bench.measure(args, deadline=time.perf_counter() - 1)
    reason = "not started: --deadline-s had passed"
    assert measured == {"tiny": {"trl": {"failed": reason}, "treadle_dynamic": {"failed": reason}}}
    assert not (tmp_path / "tiny" / "model").exists()  # nothing built for it either


def test_the_report_names_what_did_not_finish_and_rates_only_pairs(bench):
    args = bench.parse_args(
        ["--device", "cpu", "--workloads", "smollm2,1.4b", "--cache", "dynamic,static"]
    )
    args.steps, args.warmup = 1, 0

    measured = {
        "smollm2": {
            "trl": side(4.0, generate=2.0, prepare=2.5),
            "treadle_dynamic": side(2.0, generate=1.0, update_actor=0.8),
            "treadle_static": {"failed": "exit 1"},
        },
        "1.4b": {
            "trl": {"failed": "killed at --deadline-s"},
            "treadle_dynamic": side(3.0, generate=2.0, update_actor=0.8),
            "treadle_static": {"failed": "not started: --deadline-s had passed"},
        },
    }
    lines = bench.report(args, measured)
    assert "treadle on the static KV cache: not measured (exit 1)" in lines
    assert "TRL: not measured (killed at --deadline-s)" in lines
    assert (
        "treadle on the static KV cache: not measured (not started: --deadline-s had passed)"
        in lines
    )
    alone = lines[lines.index("TRL: not measured (killed at --deadline-s)") + 2]
    assert alone.startswith("step s 3.00, ") and alone.endswith("peak RSS GiB 2.00")
    assert lines[-2:] == [
        "ratio step_time treadle/trl smollm2 dynamic: 0.50",
        "ratio peak_memory treadle/trl smollm2 dynamic: 1.00",
    ]


def test_a_side_cut_at_the_deadline_keeps_the_steps_it_finished(bench, tmp_path):
    """TRL's side writes its steps so far after every step, treadle's run logs each step: what
    a side killed at the deadline had finished is read back, and the report says it was cut."""
    import json

    args = bench.parse_args(["--tiny", "--device", "cpu", "--workdir", str(tmp_path)])
    args.steps, args.warmup = 2, 1
    paths = bench.workload_paths(args, "tiny")
    assert bench.finished_steps(args, "tiny", "trl") == []  # nothing written yet
    assert bench.finished_steps(args, "tiny", "treadle_dynamic") == []
    trl = [{"step": 3.0, "generate": 1.0, "prepare": 1.5}, {"step": 2.0, "generate": 1.0}]
    (paths["folder"] / "trl.json").write_text(json.dumps({"steps": trl}))
    assert bench.finished_steps(args, "tiny", "trl") == trl
    run = bench.run_folder(paths, "dynamic")
    run.mkdir(parents=True)
    logged = [
        {"step": 1, "timing/step": 2.5, "timing/generate": 1.0, "response/length_mean": 4.0},
        {"step": 2, "timing/step": 1.5, "timing/generate": 0.5, "response/length_mean": 3.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in logged))
    wl = bench.WORKLOADS["tiny"]  # 2 prompts x 2 samples, prompts of 8 tokens
    assert bench.finished_steps(args, "tiny", "treadle_dynamic") == [
        {"step": 2.5, "generate": 1.0, "generated_tokens": 16.0, "prompt_tokens": 32.0},
        {"step": 1.5, "generate": 0.5, "generated_tokens": 12.0, "prompt_tokens": 32.0},
    ]
    assert wl.prompts * wl.n * args.prompt_tokens == 32

    cut = "cut at --deadline-s after 2 of 3 steps"
    trl = [record(s, generate=1.0, prepare=2.0) for s in (9, 4, 4)]
    ours = [record(s, generate=1.0) for s in (9, 2)]
    memory = {"peak_rss": GIB}
    measured = {
        "tiny": {
            "trl": {"steps": trl, "memory": memory},
            "treadle_dynamic": {"steps": ours, "memory": memory, "cut": cut},
        }
    }
    lines = bench.report(args, measured)
    assert f"treadle on the dynamic KV cache ({cut}):" in lines
    assert lines[-2] == "ratio step_time treadle/trl tiny: 0.50"  # its measured step: 2 s


def test_a_side_that_fails_after_its_measured_steps_keeps_them(bench, tmp_path, monkeypatch):
    """treadle's side fails in the profiled step after its 3 measured ones (say): those are
    read back from its run and measured, and the report says why the side stopped; TRL's side
    failing in its first step is named as not measured."""
    import json

    flags = ["--tiny", "--device", "cpu", "--workdir", str(tmp_path), "--steps", "2"]
    args = bench.parse_args([*flags, "--profile", "dynamic"])
    paths = bench.workload_paths(args, "tiny")
    logged = [
        {"step": k, "timing/step": s, "timing/generate": 1.0, "response/length_mean": 4.0}
        for k, s in ((1, 9.0), (2, 2.0), (3, 4.0))
    ]

    def run_side(command, log, threads, timeout=None):
        if "--side=treadle" in command:  # its run logged 3 steps, then the 4th failed
            run = bench.run_folder(paths, "dynamic")
            run.mkdir(parents=True)
            (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in logged))
        raise bench.SideFailed(f"exit 1; {log}:\nAttributeError: ...", False, {"peak_rss": GIB})

    monkeypatch.setattr(bench, "run_side", run_side)
    measured = bench.measure(args)["tiny"]
    assert measured["trl"] == {"failed": f"exit 1; {paths['folder'] / 'trl.log'}"}
    ours = measured["treadle_dynamic"]
    assert [s["step"] for s in ours["steps"]] == [9.0, 2.0, 4.0]
    log = paths["folder"] / "treadle_dynamic.log"
    assert ours["cut"] == f"stopped (exit 1; {log}) after all 3 steps"
    assert f"treadle on the dynamic KV cache ({ours['cut']}):" in bench.report(
        args, {"tiny": measured}
    )


def test_a_profiled_step_comes_after_the_measured_ones_and_is_not_measured(bench, tmp_path):
    """``--profile dynamic``: treadle's side on that cache runs one more step, profiled
    (``trainer.profile_steps``); its record is dropped, and the report names its table."""
    import json

    flags = ["--tiny", "--device", "cpu", "--workdir", str(tmp_path), "--steps", "2"]
    args = bench.parse_args([*flags, "--cache", "dynamic,static", "--profile", "dynamic"])
    wl, paths = bench.WORKLOADS["tiny"], bench.workload_paths(args, "tiny")
    dynamic = bench.treadle_overrides(args, wl, paths, "dynamic")
    assert "trainer.total_steps=4" in dynamic and "trainer.profile_steps=[4]" in dynamic
    static = bench.treadle_overrides(args, wl, paths, "static")
    assert "trainer.total_steps=3" in static
    assert not any(o.startswith("trainer.profile_steps") for o in static)
    assert "--profile=dynamic" in bench.side_command(args, "tiny", "treadle_dynamic")
    assert "--profile=" in bench.side_command(args, "tiny", "treadle_static")
    with pytest.raises(SystemExit):
        bench.parse_args([*flags, "--profile", "static"])  # not among --cache

    run = bench.run_folder(paths, "dynamic")
    (run / "profile/step_4").mkdir(parents=True)
    logged = [{"step": k, "timing/step": 1.0, "response/length_mean": 4.0} for k in (1, 2, 3, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in logged))
    assert len(bench.finished_steps(args, "tiny", "treadle_dynamic")) == 3  # not step 4
    memory = {"peak_rss": GIB}
    measured = {
        "tiny": {
            "trl": {"steps": [record(2.0, generate=1.0, prepare=1.5)] * 3, "memory": memory},
            "treadle_dynamic": {"steps": [record(1.0, generate=0.5)] * 3, "memory": memory},
            "treadle_static": {"failed": "not started: --deadline-s had passed"},
        }
    }
    table = run / "profile/step_4/driver.txt"
    said = f"its step 4, profiled: {table}"
    assert said not in bench.report(args, measured)  # no table written: nothing said
    table.write_text(
        "driver: 1.2 s profiled on the cpu; the trace: driver.json.gz\n\n"
        "range      calls    wall s\ntreadle/generate     1     0.500\n\nthe CPU: ...\n"
    )
    lines = bench.report(args, measured)
    at = lines.index(said)  # then the table's ranges, indented: bench.txt always comes back
    assert lines[at + 1 : at + 3] == [
        "  range      calls    wall s",
        "  treadle/generate     1     0.500",
    ]
    assert lines[at + 3] != "  the CPU: ..."


def test_the_update_s_model_flops_and_each_side_s_share_of_the_gpu_s_peak(bench, monkeypatch):
    """PaLM's count, as verl's MFU: the tiny workload by hand (2 layers of width 64, 32 for
    K and V, MLP 128, 512 words; 4 rows of 8 + 4 tokens), then the 1.4b one's rates."""
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128  # 36,864
    matmul = 2 * per_layer + 512 * 64  # 106,496: the tied head once
    want = 6 * matmul * 4 * 12 + 12 * 2 * 64 * 4 * 12**2  # 30,670,848 + 884,736
    assert bench.update_flops(bench.WORKLOADS["tiny"], 8) == want == 31_555_584

    import torch

    args = bench.parse_args(["--device", "cpu"])  # no peak on a CPU: rates only
    sides = {"TRL": {"training": 7.0}, "treadle dynamic": {"training": 2.0}, "x": None}
    assert bench.flops_line(args, "1.4b", sides) == (
        "update: 695 TFLOP a step; TFLOP/s in training: TRL 99.2, treadle dynamic 347"
    )
    args.device = "cuda"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    assert bench.flops_line(args, "1.4b", sides) == (
        "update: 695 TFLOP a step; TFLOP/s in training of the device's 989 bf16 TFLOP/s: "
        "TRL 99.2 (10% MFU), treadle dynamic 347 (35% MFU)"
    )
