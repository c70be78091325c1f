"""GRPO on one GPU: treadle (local backend, hf engine) against TRL 1.16's `GRPOTrainer`.

    python bench/gpu.py                      # both workloads, on the GPU
    python bench/gpu.py --workloads smollm2 --steps 3 --warmup 1
    python bench/gpu.py --tiny               # a tiny model and a few tokens: runs on a CPU
    python bench/gpu.py --cache dynamic,static,paged   # treadle's hf engine on each KV cache
    python bench/gpu.py --cache dynamic,dynamic+offload  # + weights and moments offloaded
    python bench/gpu.py --deadline-s 330     # what fits in 330 s (a lent GPU's minutes)
    python bench/gpu.py --profile dynamic    # + one step profiled (trainer.profile_steps)

Prints, per workload, each side's step time (median of `--steps` after `--warmup`), its
generation and training time, generated tokens/s and peak memory, the update's model FLOPs
(:func:`update_flops`) and each side's TFLOP/s in its training time (on an H100/H200/A100/L40S
also the share of its bf16 peak: MFU), the README's table in Markdown (a row per workload and
KV cache: step time and peak memory of each side, their ratios), then the ratio lines last:
`ratio step_time treadle/trl <workload>: <r>` for every workload, then `ratio peak_memory ...`.
The sides run one at a time: every workload's TRL run and treadle's on the first `--cache`,
then treadle's on the other caches in their order, the workload of the most decoding steps
first. One that fails, or is still running at `--deadline-s` (killed then, and the later ones
not started), is named in the report with its reason, the others' numbers still printed; one
killed or failed after more than `--warmup` steps (in the profiled step after them, say) is
measured on those, and the report says where and why it stopped. The script then exits with 1.

The workloads (`WORKLOADS`): SmolLM2-135M's shape, 8 prompts x 4 samples x 64 new tokens; a
1.39 B model of Qwen2.5-1.5B's shape with SmolLM2's vocabulary (49,152), 32 x 8 x 256; `tiny`
(`--tiny`), a 0.1 M model, 2 x 2 x 4. Models are built on the spot with random weights
(`AutoModelForCausalLM.from_config`, seed 0, float32), as is their tokenizer (a word-level one
of the model's vocabulary, `w<i>`, whose chat template is the message's text), so nothing but
this repository has to reach the GPU machine: every completion is exactly `max_new_tokens`
long on both sides (treadle `rollout.ignore_eos=true`, TRL `min_new_tokens`), so the work is
that of real weights. Every prompt is `--prompt-tokens` random words, the same on both sides.

Both sides, each in a process of its own, one after the other (`bench/grpo_vs_trl.py`'s
comparison, whose helpers this reuses, on a GPU): float32 weights and AdamW, bf16 mixed
precision on a GPU (TRL's `bf16` autocast; treadle `actor.mixed_precision=bf16` and a bfloat16
hf rollout engine, `rollout.dtype=bfloat16`), float32 on a CPU (`--precision bf16` there: the
GPU's settings, a dry run of what the GPU will run); GRPO advantages, token-mean loss
(TRL's `loss_type="dapo"`), no KL and no reference (TRL's `beta=0`), one optimizer step over all
samples a step, lr 1e-6, gradient checkpointing with bf16 (TRL's default; treadle
`actor.gradient_checkpointing=true`), micro-batches of at most `--micro-tokens` tokens, every
row computed (treadle `actor.skip_zero_advantage=false`). TRL generates the step's samples in
one `generate` call; treadle's hf engine in one too (`rollout.micro_batch_size` = the step's
samples, fewer a call only if `rollout.gpu_memory_utilization` leaves less room) and syncs the
weights into it after the update. `--cache dynamic,static,paged` runs treadle's side once on
each KV cache (`rollout.cache_implementation`; static: preallocated, its decoding step compiled
by transformers on a GPU; paged: transformers' continuous batching) against one TRL run, a table
and ratio lines for each (`<workload> static` in the ratio lines). A cache named with
`+offload` (`dynamic+offload`) runs treadle's side on it with what waits in host memory
(`actor.offload_params` and `actor.offload_optimizer`): its memory against its time. The
rewards differ (TRL's last-number check, treadle's length rule) and change only the
advantages' values, not the work.

Measured per step: step (TRL: `on_step_begin` to `on_step_end`; treadle: `timing/step`),
generation (TRL's `_generate_single_turn`; treadle `timing/generate`), training (TRL: the step
less its `_generate_and_score_completions`; treadle: `timing/update_actor` +
`timing/sync_weights`), generated tokens/s. Peak memory: on a GPU the highest of the measured
steps' `torch.cuda.max_memory_allocated` (counters reset as each step begins; treadle's
`perf/max_memory_allocated_gib`), and reserved beside it; on a CPU the process's peak RSS over
its whole life (`wait4`), warm-up and model loading included.

On the bare GPU machine (no Ray, vLLM, pydantic, datasets or TRL there; `/work/shared/GPU.md`):
the wheels of pydantic, datasets and trl travel with the call, installed with `pip install
--no-index --no-deps --target /tmp/site .whl/*.whl` and `PYTHONPATH=/tmp/site:$PWD`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

import grpo_vs_trl as base  # noqa: E402  (the CPU comparison's helpers)

GIB = float(1 << 30)
# treadle's length rule: rewards that vary within a group (TRL's side has its own)
REWARD = "def score(prompt, response, ground_truth):\n    return (len(response) % 7) / 6\n"
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
CACHES = ("dynamic", "static", "paged")  # rollout.cache_implementation's values
OFFLOAD = "+offload"  # a cache named so: treadle's side with actor.offload_params/_optimizer


@dataclass(frozen=True)
class Workload:
    """A model shape (``architecture`` and its config's keys) and the step's work.

    Every shape is built as a Llama (Qwen2.5's with ``attention_bias``: biases on the query,
    key and value projections as Qwen2's, and one on the output projection), since
    transformers reads a word-level tokenizer beside a ``qwen2`` config as Qwen2's BPE."""

    title: str
    architecture: str
    shape: dict[str, Any]
    prompts: int
    n: int
    new_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)


WORKLOADS: dict[str, Workload] = {
    "smollm2": Workload(
        "SmolLM2-135M's shape",
        "llama",
        {
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "rope_theta": 100000.0,
            "rms_norm_eps": 1e-5,
        },
        prompts=8,
        n=4,
        new_tokens=64,
    ),
    "1.4b": Workload(
        "Qwen2.5-1.5B's shape, vocabulary 49,152",
        "llama",
        {
            "attention_bias": True,  # Qwen2's biases (and one on the output projection)
            "vocab_size": 49152,
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
        },
        prompts=32,
        n=8,
        new_tokens=256,
    ),
    "tiny": Workload(
        "a tiny Llama (the script's own check, on a CPU)",
        "llama",
        {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        },
        prompts=2,
        n=2,
        new_tokens=4,
    ),
}
SPECIAL = ("<pad>", "<eos>", "<unk>")  # ids 0, 1, 2; then w3 .. w<vocab - 1>


# ----------------------------------------------------------------------------- the workload


def build_model(wl: Workload, folder: Path, prompt_tokens: int) -> Path:
    """A random-initialised model of ``wl``'s shape and its word-level tokenizer in ``folder``
    (kept: built once per work directory)."""
    if any(folder.glob("*.safetensors")):
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        wl.architecture,
        **wl.shape,
        max_position_embeddings=max(2048, prompt_tokens + wl.new_tokens),
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    from treadle.models.loading import save_tokenizer

    save_tokenizer(tokenizer(wl.shape["vocab_size"]), folder)  # readable by AutoTokenizer too
    return folder


def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer of ``vocab`` ids: the special tokens, then ``w3`` .. ``w<vocab-1>``
    (every id the model can sample decodes to a word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(SPECIAL)} | {f"w{i}": i for i in range(3, vocab)}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece()  # words joined by spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_prompts(wl: Workload, path: Path, prompt_tokens: int) -> Path:
    """``wl.prompts`` rows of ``prompt_tokens`` random words (seed 0), as JSONL of ``prompt``
    and ``answer`` (both sides' reader)."""
    import random

    rng = random.Random(0)
    vocab = wl.shape["vocab_size"]
    rows = [
        {
            "prompt": " ".join(f"w{rng.randrange(3, vocab)}" for _ in range(prompt_tokens)),
            "answer": "0",
        }
        for _ in range(wl.prompts)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- the two sides


def treadle_overrides(
    args: argparse.Namespace, wl: Workload, paths: dict[str, Path], cache: str
) -> list[str]:
    """treadle's run of the workload: the local backend, the hf engine on ``cache`` (see the
    docstring; ``<cache>+offload``: with what waits in host memory)."""
    rows, bf16 = wl.prompts * wl.n, args.precision == "bf16"
    profiled = cache in args.profile  # one more step, profiled, not measured
    offload = cache.endswith(OFFLOAD)
    return [
        f"model.path={paths['model']}",
        "model.dtype=float32",
        f"rollout.dtype={'bfloat16' if bf16 else 'float32'}",
        f"actor.mixed_precision={'bf16' if bf16 else 'none'}",
        f"data.train_files=[{paths['prompts']}]",
        "data.val_files=[]",
        f"data.batch_size={wl.prompts}",
        "data.shuffle=false",
        f"data.max_prompt_length={args.prompt_tokens}",
        "rollout.engine=hf",
        f"rollout.cache_implementation={cache.removesuffix(OFFLOAD)}",
        f"rollout.n={wl.n}",
        "rollout.temperature=1.0",
        f"rollout.max_new_tokens={wl.new_tokens}",
        "rollout.ignore_eos=true",
        f"rollout.micro_batch_size={rows}",
        f"reward.function={paths['reward']}:score",
        "reward.num_workers=0",
        "algorithm.adv_estimator=grpo",
        "algorithm.kl_coef=0",
        "algorithm.loss_agg_mode=token-mean",
        f"actor.lr={args.lr}",
        f"actor.ppo_mini_batch_size={rows}",
        f"actor.micro_batch_size={rows}",
        f"actor.max_tokens_per_micro_batch={args.micro_tokens}",
        f"actor.gradient_checkpointing={str(bf16).lower()}",
        "actor.skip_zero_advantage=false",  # equal work: TRL computes every row
        *(["actor.offload_params=true", "actor.offload_optimizer=true"] if offload else []),
        "trainer.backend=local",
        f"trainer.output_dir={run_folder(paths, cache)}",
        f"trainer.total_steps={profiled_step(args) if profiled else args.warmup + args.steps}",
        *([f"trainer.profile_steps=[{profiled_step(args)}]"] if profiled else []),
        "trainer.resume=false",
        "trainer.progress=false",
    ]


def workload_paths(args: argparse.Namespace, name: str) -> dict[str, Path]:
    folder = Path(args.workdir) / name
    folder.mkdir(parents=True, exist_ok=True)
    reward = folder / "reward.py"
    reward.write_text(REWARD, encoding="utf-8")
    return {
        "folder": folder,
        "model": folder / "model",
        "prompts": folder / "prompts.jsonl",
        "reward": reward,
    }


def run_folder(paths: dict[str, Path], cache: str) -> Path:
    """The folder of treadle's run of a workload on ``cache``."""
    return paths["folder"] / f"treadle_run_{cache}"


def treadle_side(args: argparse.Namespace) -> None:
    """The treadle side (in its own process): the steps' records as JSON to ``--side-out``."""
    import torch

    torch.set_num_threads(args.threads)
    wl, cache = WORKLOADS[args.workload], args.caches[0]
    paths = workload_paths(args, args.workload)
    overrides = treadle_overrides(args, wl, paths, cache)
    steps = base.treadle_steps(overrides, run_folder(paths, cache), wl.n)
    steps = steps[: args.warmup + args.steps]  # (a profiled step after them is not measured)
    Path(args.side_out).write_text(json.dumps({"steps": steps}), encoding="utf-8")


class SideFailed(Exception):
    """A side that did not finish (it failed, or ran past ``--deadline-s``: ``killed``): the
    reason, and its wall time and peak RSS as :func:`run_side` returns them."""

    def __init__(self, reason: str, killed: bool, memory: dict[str, float]) -> None:
        super().__init__(reason)
        self.killed, self.memory = killed, memory


def run_side(
    command: list[str], log: Path, threads: int, timeout: float | None = None
) -> dict[str, float]:
    """Run one side to its end, its output to ``log``: its wall time and peak RSS (``wait4``).
    A side still running after ``timeout`` seconds is killed; a failed or killed one raises
    :class:`SideFailed` with its log's last lines."""
    env = base.side_env(threads, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            proc.kill()

        timer = None if timeout is None else threading.Timer(timeout, kill)
        if timer is not None:
            timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        if timer is not None:
            timer.cancel()
    code = os.waitstatus_to_exitcode(status)
    memory = {"wall_s": time.perf_counter() - start, "peak_rss": usage.ru_maxrss * 1024.0}
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        why = "killed at --deadline-s" if killed.is_set() else f"exit {code}"
        raise SideFailed(f"{why}; {log}:\n{tail}", killed.is_set(), memory)
    return memory


def common_flags(args: argparse.Namespace, wl: Workload) -> list[str]:
    dtype = "bfloat16" if args.precision == "bf16" else "float32"
    return [
        f"--n={wl.n}",
        f"--new-tokens={wl.new_tokens}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--lr={args.lr}",
        f"--dtype={dtype}",
        f"--threads={args.threads}",
    ]


def side_command(args: argparse.Namespace, name: str, side: str) -> list[str]:
    """The command of one side of workload ``name``: ``trl`` or ``treadle_<cache>``."""
    wl, paths = WORKLOADS[name], workload_paths(args, name)
    if side == "trl":
        return [
            sys.executable,
            str(BENCH / "grpo_trl_side.py"),
            f"--model={paths['model']}",
            f"--prompts={paths['prompts']}",
            f"--out={paths['folder'] / 'trl.json'}",
            f"--workdir={paths['folder']}",
            f"--device={args.device}",
            *common_flags(args, wl),
        ]
    cache = side.removeprefix("treadle_")
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--side=treadle",
        f"--workload={name}",
        f"--side-out={paths['folder'] / f'{side}.json'}",
        f"--workdir={args.workdir}",
        f"--prompt-tokens={args.prompt_tokens}",
        f"--micro-tokens={args.micro_tokens}",
        f"--device={args.device}",
        f"--cache={cache}",
        f"--profile={cache if cache in args.profile else ''}",
        *(f for f in common_flags(args, wl) if not f.startswith(("--n=", "--new-tokens="))),
    ]


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The ``(workload, side)`` runs in the order they are measured: every workload's TRL run
    and treadle's on the first ``--cache``, then treadle's on the others, the workload of the
    most decoding steps first (where a KV cache matters most), so that a deadline cuts the
    comparisons that matter least."""
    first = [
        (name, side) for name in args.workloads for side in ("trl", f"treadle_{args.caches[0]}")
    ]
    longest = sorted(args.workloads, key=lambda name: -WORKLOADS[name].new_tokens)
    rest = [(name, f"treadle_{cache}") for name in longest for cache in args.caches[1:]]
    return first + rest


def measure(args: argparse.Namespace, deadline: float | None = None) -> dict[str, dict[str, Any]]:
    """Every side of :func:`plan`: its step records and process peak RSS, or ``{"failed":
    reason}`` (it failed, or ``deadline``, a ``time.perf_counter()``, came first)."""
    measured: dict[str, dict[str, Any]] = {name: {} for name in args.workloads}
    for name, side in plan(args):
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
            measured[name][side] = {"failed": "not started: --deadline-s had passed"}
            continue
        wl, paths = WORKLOADS[name], workload_paths(args, name)
        build_model(wl, paths["model"], args.prompt_tokens)
        write_prompts(wl, paths["prompts"], args.prompt_tokens)
        (paths["folder"] / f"{side}.json").unlink(missing_ok=True)  # (an earlier run's)
        if side != "trl":
            shutil.rmtree(run_folder(paths, side.removeprefix("treadle_")), ignore_errors=True)
        log = paths["folder"] / f"{side}.log"
        print(f"{name}: {side} (log: {log})", flush=True)
        try:
            memory = run_side(side_command(args, name, side), log, args.threads, left)
        except SideFailed as failed:
            print(f"{name}: {side} failed: {failed}", flush=True)
            steps = finished_steps(args, name, side)
            reason = str(failed).splitlines()[0].rstrip(":")
            if len(steps) > args.warmup:  # enough for a median: kept, and said
                total = args.warmup + args.steps
                done = f"all {total}" if len(steps) == total else f"{len(steps)} of {total}"
                why = "cut at --deadline-s" if failed.killed else f"stopped ({reason})"
                cut = f"{why} after {done} steps"
                measured[name][side] = {"steps": steps, "memory": failed.memory, "cut": cut}
            else:
                measured[name][side] = {"failed": reason}
            continue
        record = json.loads((paths["folder"] / f"{side}.json").read_text())
        measured[name][side] = {**record, "memory": memory}
    return measured


def finished_steps(args: argparse.Namespace, name: str, side: str) -> list[dict[str, Any]]:
    """The step records of a side stopped before its end: TRL's from its output file (written
    after every step), treadle's from its run's ``metrics.jsonl`` (every step once logged)."""
    wl, paths = WORKLOADS[name], workload_paths(args, name)
    if side == "trl":
        out = paths["folder"] / "trl.json"
        return list(json.loads(out.read_text())["steps"]) if out.is_file() else []
    from treadle.tracking.tracker import read_metrics

    run = run_folder(paths, side.removeprefix("treadle_"))
    if not (run / "metrics.jsonl").is_file():
        return []
    samples = wl.prompts * wl.n  # every prompt is --prompt-tokens tokens (write_prompts)
    steps = base.step_records(read_metrics(run), samples, samples * args.prompt_tokens)
    return steps[: args.warmup + args.steps]


# ----------------------------------------------------------------------------- the report

GPU_COLUMNS = (
    *base.COLUMNS[:5],
    ("peak alloc GiB", "peak_gib", "{:.2f}"),
    ("peak reserved GiB", "reserved_gib", "{:.2f}"),
)
CPU_COLUMNS = (*base.COLUMNS[:5], ("peak RSS GiB", "peak_gib", "{:.2f}"))
RATIOS = (("step_time", "step"), ("peak_memory", "peak_gib"))


def summary(side: dict[str, Any], phases: Any, keys: tuple[str, str], warmup: int) -> dict:
    """The median step of ``side`` (``phases`` splits a record) and its peak memory: on a GPU
    the highest of the measured steps' ``keys`` (allocated, reserved; GiB), else peak RSS."""
    out = base.medians([phases(r) for r in side["steps"]], warmup)
    measured = side["steps"][warmup:]
    if keys[0] in measured[0]:
        scale = GIB if keys[0] == "max_memory_allocated" else 1.0  # TRL's are bytes
        out["peak_gib"] = max(r[keys[0]] for r in measured) / scale
        out["reserved_gib"] = max(r[keys[1]] for r in measured) / scale
    else:
        out["peak_gib"] = side["memory"]["peak_rss"] / GIB
    return out


def report(args: argparse.Namespace, measured: dict[str, dict[str, Any]]) -> list[str]:
    """The printed lines: the header, a table per workload and KV cache, the ratio lines last
    (a workload's name alone for one cache, ``<workload> <cache>`` for several). A side that
    did not finish is named with its reason, and a ratio needs both sides."""
    lines = header(args)
    columns = GPU_COLUMNS if args.device == "cuda" else CPU_COLUMNS
    results = {}
    rows = []  # (workload, cache, TRL's summary, treadle's): the README's table
    for name, sides in measured.items():
        wl = WORKLOADS[name]
        lines += [
            "",
            f"{name}: {wl.title}; {wl.prompts} prompts x {wl.n} samples x {wl.new_tokens} new "
            f"tokens, prompts of {args.prompt_tokens} tokens",
        ]
        trl = None
        if "failed" in sides["trl"]:
            lines.append(f"TRL: not measured ({sides['trl']['failed']})")
        else:
            trl = summary(sides["trl"], base.trl_phases, TRL_MEMORY, args.warmup)
            if "cut" in sides["trl"]:
                lines.append(f"TRL: {sides['trl']['cut']}")
        treadle: dict[str, dict | None] = {}
        for cache in args.caches:
            side = sides[f"treadle_{cache}"]
            if "failed" in side:
                lines.append(f"treadle on the {cache} KV cache: not measured ({side['failed']})")
                continue
            ours = summary(side, base.treadle_phases, TREADLE_MEMORY, args.warmup)
            treadle[f"treadle {cache}"] = ours
            cut = f" ({side['cut']})" if "cut" in side else ""
            lines.append(f"treadle on the {cache} KV cache{cut}:")
            if trl is None:
                lines.append(
                    ", ".join(f"{title} {fmt.format(ours[key])}" for title, key, fmt in columns)
                )
            else:
                results[name if len(args.caches) == 1 else f"{name} {cache}"] = (trl, ours)
                rows.append((name, cache, trl, ours))
                lines += [
                    *base.format_table(trl, ours, columns),
                    *base.workload_warnings(trl, ours),
                ]
            lines.append(base.treadle_breakdown(side["steps"], args.warmup))
            table = profile_table(args, name, cache)
            if table is not None:  # its path, then its ranges (bench.txt always comes back)
                from treadle.tracking.profiler import ranges_part

                lines.append(f"its step {profiled_step(args)}, profiled: {table}")
                ranges = ranges_part(table.read_text(encoding="utf-8")).splitlines()[2:]
                lines += [f"  {line}" for line in ranges]
        if trl is not None:
            lines.append(base.trl_breakdown(sides["trl"]["steps"], args.warmup))
        lines.append(flops_line(args, name, {"TRL": trl, **treadle}))
    return [*lines, "", *readme_table(args, rows), "", *base.ratio_lines(results, RATIOS)]


def readme_table(args: argparse.Namespace, rows: list[tuple[str, str, dict, dict]]) -> list[str]:
    """The README's table ("On a GPU"), in Markdown: a row per workload and KV cache measured
    against TRL, its step time and peak memory (on a GPU: allocated) and their ratios."""
    if not rows:
        return []
    memory = "peak GiB" if args.device == "cuda" else "peak RSS GiB"
    lines = [
        "the README's table:",
        f"| workload | KV cache | step s, TRL | step s, treadle | treadle/TRL | {memory}, TRL "
        f"| {memory}, treadle | treadle/TRL |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, cache, trl, ours in rows:
        wl = WORKLOADS[name]
        work = f"{wl.title}, {wl.prompts} x {wl.n} x {wl.new_tokens}"
        step, peak = (f"{trl[k]:.2f} | {ours[k]:.2f} | {ours[k] / trl[k]:.2f}" for _, k in RATIOS)
        lines.append(f"| {work} | {cache} | {step} | {peak} |")
    return lines


def update_flops(wl: Workload, prompt_tokens: int) -> float:
    """The model FLOPs of a step's update: treadle's count (PaLM's, as verl's MFU:
    :mod:`treadle.engines.flops`, which its runs log as ``perf/tflops/actor``) over the
    step's rows of ``prompt_tokens + new_tokens`` tokens."""
    from transformers import AutoConfig

    from treadle.engines.flops import update_flops as count

    rows, length = wl.prompts * wl.n, prompt_tokens + wl.new_tokens
    flops = count(
        AutoConfig.for_model(wl.architecture, **wl.shape), rows * length, rows * length**2
    )
    assert flops is not None, wl.title  # (a dense shape)
    return flops


def flops_line(args: argparse.Namespace, name: str, sides: dict[str, dict | None]) -> str:
    """The update's model FLOPs and each measured side's rate in its training time, and on a
    known GPU the share of its bf16 peak (MFU)."""
    flops = update_flops(WORKLOADS[name], args.prompt_tokens)
    peak = device_peak(args)
    rates = []
    for side, summary in sides.items():
        if summary is None or summary["training"] <= 0:
            continue
        rate = flops / summary["training"] / 1e12
        share = f" ({rate / peak:.0%} MFU)" if peak else ""
        rates.append(f"{side} {rate:.3g}{share}")
    where = f" of the device's {peak:.0f} bf16 TFLOP/s" if peak else ""
    head = f"update: {flops / 1e12:.3g} TFLOP a step; TFLOP/s in training{where}: "
    return head + ", ".join(rates)


def device_peak(args: argparse.Namespace) -> float | None:
    """The GPU's bf16 dense TFLOP/s (:data:`treadle.engines.flops.PEAK_TFLOPS`); None on a CPU
    or another GPU."""
    if args.device != "cuda":
        return None
    import torch

    from treadle.engines.flops import peak_tflops

    return peak_tflops(torch.device("cuda", 0))


def profiled_step(args: argparse.Namespace) -> int:
    """The step ``--profile`` adds after the warm-up and measured ones."""
    return args.warmup + args.steps + 1


def profile_table(args: argparse.Namespace, name: str, cache: str) -> Path | None:
    """The table of the profiled step of treadle's side on ``cache`` (``--profile``), if it
    was written."""
    folder = run_folder(workload_paths(args, name), cache)
    table = folder / f"profile/step_{profiled_step(args)}/driver.txt"
    return table if cache in args.profile and table.is_file() else None


TRL_MEMORY = ("max_memory_allocated", "max_memory_reserved")
TREADLE_MEMORY = ("perf/max_memory_allocated_gib", "perf/max_memory_reserved_gib")


def header(args: argparse.Namespace) -> list[str]:
    from importlib.metadata import version

    import torch

    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        machine = f"device: {props.name}, {props.total_memory / GIB:.0f} GiB"
    else:
        machine = (
            base.machine_line()
            if base.psutil is not None
            else f"device: {platform.processor() or 'CPU'}"
        )
    versions = ", ".join(f"{p} {version(p)}" for p in ("torch", "transformers", "trl"))
    precision = "bf16 mixed precision" if args.precision == "bf16" else "float32"
    return [
        f"date: {date.today().isoformat()}",
        machine,
        f"{versions}; {precision}; median of {args.steps} steps after {args.warmup} warm-up",
        "TRL: GRPOTrainer's defaults (loss dapo, beta 0, gradient checkpointing), one generate "
        "call and one forward/backward over the step's samples",
        "treadle: local backend, hf engine (one generate call), "
        f"micro-batches of <= {args.micro_tokens} tokens, gradient checkpointing "
        f"{'on' if args.precision == 'bf16' else 'off'}, weight sync every step",
    ]


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="smollm2,1.4b", help="comma-separated: smollm2,1.4b")
    p.add_argument("--tiny", action="store_true", help="the tiny workload (a CPU check)")
    p.add_argument("--steps", type=int, default=3, help="measured steps (median)")
    p.add_argument("--warmup", type=int, default=1, help="steps before the measured ones")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 64 (tiny: 8)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--micro-tokens", type=int, default=16384, help="treadle's tokens a fwd/bwd")
    p.add_argument("--threads", type=int, default=None, help="torch threads (GPU: up to 8)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument(
        "--precision",
        choices=["auto", "bf16", "float32"],
        default="auto",
        help="bf16: bf16 mixed precision and gradient checkpointing on both sides (auto: on a "
        "GPU; float32 on a CPU). bf16 on a CPU runs the GPU's settings there, a dry run",
    )
    p.add_argument(
        "--cache",
        default="dynamic",
        help="treadle's KV caches, of dynamic, static and paged, each also as <cache>+offload "
        "(what waits in host memory)",
    )
    p.add_argument(
        "--profile",
        default="",
        help="KV caches (of --cache) whose treadle sides run one more step, profiled "
        "(trainer.profile_steps) and left out of the measurement",
    )
    p.add_argument("--workdir", default=str(ROOT / "runs" / "gpu_bench"))
    p.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="seconds for the whole run: a side still running then is killed, later ones are "
        "not started, and the report shows what was measured",
    )
    p.add_argument("--side", choices=["treadle"], help=argparse.SUPPRESS)
    p.add_argument("--side-out", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)  # (the sides' common flags)
    p.add_argument("--new-tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.workloads = ["tiny"] if args.tiny else [w.strip() for w in args.workloads.split(",")]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown or not args.workloads:
        p.error(f"--workloads: unknown {unknown}; choose from smollm2, 1.4b (or --tiny)")
    args.caches = [c.strip() for c in args.cache.split(",")]
    known = {*CACHES, *(c + OFFLOAD for c in CACHES)}
    if not set(args.caches) <= known or len(set(args.caches)) < len(args.caches):
        p.error(f"--cache: {args.cache!r}; give some of {', '.join(CACHES)} (each may end "
                f"with {OFFLOAD}), each once")  # fmt: skip
    args.profile = [c.strip() for c in args.profile.split(",") if c.strip()]
    if not set(args.profile) <= set(args.caches):
        p.error(f"--profile: {args.profile} are not among --cache {args.caches}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    if args.deadline_s is not None and args.deadline_s <= 0:
        p.error(f"--deadline-s must be above 0, not {args.deadline_s}")
    if args.prompt_tokens is None:
        args.prompt_tokens = 8 if args.tiny else 64
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.precision == "auto":
        args.precision = "bf16" if args.device == "cuda" else "float32"
    if args.threads is None:
        cores = os.cpu_count() or 1
        args.threads = (
            min(8, cores) if args.device == "cuda" else int(os.environ.get("OMP_NUM_THREADS", "2"))
        )
    return args


def main() -> None:
    args = parse_args()
    if args.side == "treadle":
        treadle_side(args)
        return
    start = time.perf_counter()
    deadline = None if args.deadline_s is None else start + args.deadline_s
    measured = measure(args, deadline)
    print("\n".join(report(args, measured)))
    print(f"(the whole benchmark: {time.perf_counter() - start:.0f} s)")
    if any(
        {"failed", "cut"} & side.keys() for sides in measured.values() for side in sides.values()
    ):
        sys.exit(1)


if __name__ == "__main__":
    main()
