"""GRPO step time and memory: treadle against TRL's `GRPOTrainer`, the same workload on both.

    python bench/grpo_vs_trl.py [--models tiny,smollm2-135m] [--steps 5 --warmup 2]

(run by another python, the script re-runs itself under `.venv/bin/python`, running `make install`
first when needed).

Setup, done by the script when missing: TRL's own environment `.venv-trl/` at the repo root
(`python -m venv`, then `torch==2.13.0` first, so pip takes the CPU wheel, then `trl==1.16.*`
with transformers pinned to this environment's version, so both sides run the same model
code); the tiny model and its data (`treadle prepare` -> `data/arithmetic/`); SmolLM2-135M-
Instruct (`treadle model fetch smollm2-135m-instruct`) and its data (`treadle prepare --task
chat_arithmetic` -> `data/chat_arithmetic/`).

The workload, the same on both sides, per model:

- the same model folder and precision (`--dtype`: by default bfloat16 where the CPU has bf16
  instructions, else float32; `bfloat16` is mixed precision on both sides: float32 weights
  and optimizer, bfloat16 matmuls: TRL's default `bf16` autocast; treadle's
  `actor.mixed_precision=bf16` and a bfloat16 vLLM engine, `rollout.dtype=bfloat16`);
- the same 8 prompts every step (the first rows of the task's `train.jsonl`, rendered with the
  tokenizer's chat template by each side), 4 samples each at temperature 1, exactly 64 new
  tokens per sample (treadle: `rollout.ignore_eos=true`; TRL: `min_new_tokens=64`); the prompt
  and generated token counts are compared and a mismatch is reported;
- GRPO advantages (group mean and std), token-mean loss (TRL's default `loss_type="dapo"`),
  clip 0.2, no KL term and no reference model (TRL's default `beta=0`; treadle
  `algorithm.kl_coef=0`), one AdamW step on all 32 samples per step, learning rate 1e-6;
- `--warmup` steps, then `--steps` measured steps; every number is the median of those.

Where the sides differ, each with its own defaults: TRL generates with transformers `generate`
(one batch of 32), trains the 32 samples in one forward/backward with gradient checkpointing
on (its default) and fused LM-head log-probs, and makes no separate old-log-prob pass (with one
iteration it reuses the detached current ones). treadle runs its product path: one Ray actor
with FSDP2 on one rank and an in-process vLLM engine (`rollout.engine=vllm`,
`trainer.backend=ray`), micro-batches of at most `--micro-tokens` tokens
(`actor.max_tokens_per_micro_batch`; measured on SmolLM2: 2 of ~2,300 tokens beat 4 of ~1,200
by 14% and one of ~4,700 by 10%) without gradient checkpointing, no separate old-log-prob
pass either (on-policy: the update's first forward stands for the old policy), and a weight
sync into vLLM after the update. treadle computes every row too (`actor.skip_zero_advantage=false`:
by default it leaves out the rows of zero advantage, which the two sides' different rewards
would make unequal work). treadle's vLLM KV cache is sized to the workload
(`--kv-cache-gib`, default: room for the 32 sequences of 128 + 64 tokens, x1.5), since vLLM on
CPU allocates and fills all of it at start, where transformers' cache grows with the batch.
Both use `--threads` torch threads. TRL's reward is a plain last-integer check, treadle's the
task's built-in reward (rewards only change advantage values, not the work).

What is measured, per step:

- step: TRL, `on_step_begin` to `on_step_end` of its trainer (generation, scoring, loss,
  backward, clip, optimizer); treadle, `timing/step` from the run's `metrics.jsonl` (the whole
  RL step);
- generation: TRL, its `_generate_single_turn` (padding and `model.generate`); treadle,
  `timing/generate` (vLLM sampling and building the response tensors);
- training: TRL, the step less its `_generate_and_score_completions` (so loss forward,
  backward, clip and optimizer step; plus any log-prob pass made while preparing, none with
  these settings); treadle, `timing/update_actor` + `timing/sync_weights` (+
  `timing/old_log_probs` / `timing/ref_log_probs` when those passes run);
- other: step - generation - training (decoding, reward, advantages, driver overhead);
- generated tokens/s: generated tokens of the step / generation time;
- peak RSS and peak PSS: each side runs in its own process, one side after the other, never
  both at once. Every 0.2 s the script sums the RSS of that process and all its
  descendants (for treadle: the driver, Ray's GCS server, raylet, agents and workers, and the
  actor that holds the model, the optimizer and the vLLM engine) and keeps the peak of the
  sum. Summed RSS counts a shared library once per process that maps it, so treadle's several
  processes are over-counted; PSS (`/proc/<pid>/smaps_rollup`) divides shared pages among the
  processes sharing them, so the PSS column is the honest total. Reading PSS walks the page
  tables (tens of ms of CPU per GB), so it is read only when the RSS sum reaches a new peak
  and every 5 s. The `peak_rss` ratio line uses RSS, as the target is stated in RSS.

The machine may be shared: the 1-minute load average at the start of each side is printed.
The output ends with `ratio step_time treadle/trl <model>: <r>` and `ratio peak_rss
treadle/trl <model>: <r>` lines, step time first, in the order of `--models`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

try:
    import psutil
except ImportError:  # not treadle's environment: main() re-runs this under .venv/bin/python
    psutil = None

ROOT = Path(__file__).resolve().parents[1]
TRL_SIDE = Path(__file__).resolve().with_name("grpo_trl_side.py")
TRL_PIN = "trl==1.16.*"
TORCH_PIN = "torch==2.13.0"
MODELS = ("tiny", "smollm2-135m")
GIB = float(1 << 30)
MAX_PROMPT = 128  # treadle's data.max_prompt_length; the prompts here are shorter


# ----------------------------------------------------------------------------- memory


def process_memory(pid: int, with_pss: bool = True) -> tuple[int, int]:
    """(RSS, PSS) of one process in bytes. RSS from /proc/<pid>/statm (cheap); PSS from
    /proc/<pid>/smaps_rollup, which walks the page tables (~30 ms of CPU for 1.4 GB), so
    only when asked (0 otherwise, or if unreadable)."""
    rss = psutil.Process(pid).memory_info().rss
    pss = 0
    if with_pss:
        try:
            with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
                pss = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("Pss:")), 0)
        except OSError:
            pass
    return rss, pss


def tree_memory(pid: int, with_pss: bool = True) -> list[tuple[str, int, int]]:
    """(name, RSS, PSS) in bytes of process `pid` and of each of its descendants."""
    root = psutil.Process(pid)
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            found.append((proc.name(), *process_memory(proc.pid, with_pss)))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # ended between the listing and the read
    return found


@dataclass
class TreePeak:
    """Peak summed RSS / PSS of a process tree, sampled on a thread every `interval` seconds.

    RSS is read at every sample; PSS, which costs CPU time that the measured processes would
    feel, only when the RSS sum reaches a new peak and otherwise every `pss_interval` seconds.
    `at_peak` is the (name, RSS, PSS) of each process in the sample of the highest summed RSS.
    """

    pid: int
    interval: float = 0.2
    pss_interval: float = 5.0
    rss: int = 0
    pss: int = 0
    at_peak: list[tuple[str, int, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _last_pss: float = float("-inf")

    def update(self, processes: list[tuple[str, int, int]]) -> None:
        rss = sum(p[1] for p in processes)
        if rss > self.rss:
            self.rss, self.at_peak = rss, processes
        self.pss = max(self.pss, sum(p[2] for p in processes))

    def sample(self) -> None:
        processes = tree_memory(self.pid, with_pss=False)
        due = time.monotonic() - self._last_pss >= self.pss_interval
        if due or sum(p[1] for p in processes) > self.rss:
            processes = tree_memory(self.pid, with_pss=True)
            self._last_pss = time.monotonic()
        self.update(processes)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except psutil.NoSuchProcess:
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> TreePeak:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def run_measured(command: list[str], env: dict[str, str], log_file: Path) -> dict[str, Any]:
    """Run `command` to completion, its output to `log_file`; its tree's peak memory and time."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with log_file.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        with TreePeak(proc.pid) as peak:
            code = proc.wait()
    if code != 0:
        sys.exit(f"{command[1]} failed with exit code {code}; see {log_file}")
    return {
        "peak_rss": peak.rss,
        "peak_pss": peak.pss,
        "at_peak": peak.at_peak,
        "wall_s": time.perf_counter() - start,
        "load_average": load,
    }


# ----------------------------------------------------------------------------- setup


def ensure_trl_env(venv: Path) -> Path:
    """The TRL environment's python; the environment is created first if it lacks TRL 1.16."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import trl, sys; sys.exit(not trl.__version__.startswith('1.16'))"]
    if python.exists() and subprocess.run(check, check=False, capture_output=True).returncode == 0:
        return python
    from importlib.metadata import version

    print(f"creating {venv} for TRL ({TRL_PIN}, {TORCH_PIN}): a few minutes, ~1.5 GB", flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_PIN], check=True)  # first: pip then keeps this CPU build
    transformers = f"transformers=={version('transformers')}"  # the same model code as treadle's
    subprocess.run([*pip, TRL_PIN, transformers, "psutil"], check=True)
    if subprocess.run(check, check=False).returncode != 0:
        sys.exit(f"{venv}: TRL 1.16 is still not importable after installing it")
    return python


@dataclass
class Workload:
    name: str
    model: Path
    prompts: Path  # JSONL of `prompt`, `answer`: the rows every step uses
    reward: str  # treadle's built-in reward for the task
    kv_cache_gib: float = 0.0  # treadle's vLLM KV cache


def prepare_workload(name: str, workdir: Path, n_prompts: int) -> Workload:
    """The model folder and the step's prompts; prepares the task and fetches SmolLM2 if missing."""
    if name == "tiny":
        from treadle.tasks.arithmetic import prepare

        paths = prepare(ROOT / "data" / "arithmetic")  # what `treadle prepare` does
        model, train, reward = paths["model"], paths["train"], "arithmetic"
    else:
        from treadle.models.hub import fetch_model
        from treadle.tasks.chat_arithmetic import prepare_chat

        train = prepare_chat(ROOT / "data" / "chat_arithmetic")["train"]
        model, reward = fetch_model("smollm2-135m-instruct"), "chat_arithmetic"
    lines = train.read_text(encoding="utf-8").splitlines()[:n_prompts]
    rows = [json.loads(line) for line in lines]
    prompts = workdir / name / "prompts.jsonl"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.write_text(
        "".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows),
        encoding="utf-8",
    )
    return Workload(name, Path(model), prompts, reward)


def workload(name: str, args: argparse.Namespace) -> Workload:
    wl = prepare_workload(name, Path(args.workdir), args.prompts_per_step)
    seqs = args.prompts_per_step * args.n
    wl.kv_cache_gib = args.kv_cache_gib or kv_cache_gib(wl.model, seqs, args.new_tokens, args.dtype)
    return wl


def kv_cache_gib(model: Path, seqs: int, new_tokens: int, dtype: str, block: int = 128) -> float:
    """vLLM KV cache for `seqs` sequences of MAX_PROMPT + `new_tokens` tokens, 1.5x, in GiB.

    vLLM on CPU allocates (and zero-fills) the whole cache at start, so its size is resident
    memory; TRL's transformers cache grows with the batch. Sized to the workload, as a user would.
    """
    cfg = json.loads((model / "config.json").read_text(encoding="utf-8"))
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", heads) * head_dim
    per_token *= 4 if dtype == "float32" else 2
    tokens = -(-(MAX_PROMPT + new_tokens) // block) * block  # whole blocks
    return round(max(1.5 * seqs * tokens * per_token / GIB, 1 / 16), 3)


def side_env(threads: int, pythonpath: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        OMP_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
        PYTHONUNBUFFERED="1",  # the logs show progress as it happens
    )
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def common_flags(args: argparse.Namespace) -> list[str]:
    return [
        f"--n={args.n}",
        f"--new-tokens={args.new_tokens}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--lr={args.lr}",
        f"--dtype={args.dtype}",
        f"--threads={args.threads}",
    ]


def measure_trl(python: Path, wl: Workload, args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.workdir) / wl.name / "trl.json"
    command = [
        str(python),
        str(TRL_SIDE),
        f"--model={wl.model}",
        f"--prompts={wl.prompts}",
        f"--out={out}",
        f"--workdir={Path(args.workdir) / wl.name}",
        *common_flags(args),
    ]
    log = Path(args.workdir) / wl.name / "trl.log"
    memory = run_measured(command, side_env(args.threads, None), log)
    return measured_result(out, memory)


def measure_treadle(wl: Workload, args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.workdir) / wl.name / "treadle.json"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--side=treadle",
        f"--model-path={wl.model}",
        f"--prompts={wl.prompts}",
        f"--reward={wl.reward}",
        f"--side-out={out}",
        f"--workdir={Path(args.workdir) / wl.name}",
        f"--micro-tokens={args.micro_tokens}",
        f"--kv-cache-gib={wl.kv_cache_gib}",
        *common_flags(args),
    ]
    log = Path(args.workdir) / wl.name / "treadle.log"
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    memory = run_measured(command, side_env(args.threads, pythonpath), log)
    return measured_result(out, memory)


def measured_result(side_out: Path, memory: dict[str, Any]) -> dict[str, Any]:
    """A side's steps and settings with the memory measured around it; kept as <side>.full.json."""
    result = {**json.loads(side_out.read_text(encoding="utf-8")), "memory": memory}
    side_out.with_suffix(".full.json").write_text(json.dumps(result), encoding="utf-8")
    return result


# ----------------------------------------------------------------------------- treadle side


def treadle_overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    rows = len(Path(args.prompts).read_text(encoding="utf-8").splitlines())
    return [
        f"model.path={args.model_path}",
        "model.dtype=float32",
        f"rollout.dtype={args.dtype}",
        f"actor.mixed_precision={'bf16' if args.dtype == 'bfloat16' else 'none'}",
        f"data.train_files=[{args.prompts}]",
        f"data.batch_size={rows}",
        "data.shuffle=false",
        f"data.max_prompt_length={MAX_PROMPT}",
        "rollout.engine=vllm",
        f"rollout.n={args.n}",
        "rollout.temperature=1.0",
        f"rollout.max_new_tokens={args.new_tokens}",
        "rollout.ignore_eos=true",
        f"rollout.kv_cache_gib={args.kv_cache_gib}",
        f"reward.function={args.reward}",
        "algorithm.adv_estimator=grpo",
        "algorithm.kl_coef=0",
        "algorithm.loss_agg_mode=token-mean",
        f"actor.lr={args.lr}",
        f"actor.ppo_mini_batch_size={rows * args.n}",
        f"actor.micro_batch_size={rows * args.n}",
        f"actor.max_tokens_per_micro_batch={args.micro_tokens}",
        "actor.skip_zero_advantage=false",  # equal work: TRL computes every row
        "trainer.backend=ray",
        f"trainer.num_cpus={args.threads}",
        f"trainer.threads_per_rank={args.threads}",
        f"trainer.output_dir={run_dir}",
        f"trainer.total_steps={args.warmup + args.steps}",
        "trainer.resume=false",
        "trainer.progress=false",
    ]


def treadle_side(args: argparse.Namespace) -> None:
    """Run the RL steps with treadle as a library; write per-step timings as JSON."""
    run_dir = Path(args.workdir) / "treadle_run"
    steps = treadle_steps(treadle_overrides(args, run_dir), run_dir, args.n)
    settings = {"micro_tokens": args.micro_tokens, "kv_cache_gib": args.kv_cache_gib}
    Path(args.side_out).write_text(json.dumps({"steps": steps, "settings": settings}))


def treadle_steps(overrides: list[str], run_dir: Path, n: int) -> list[dict[str, float]]:
    """The RL steps of the config ``overrides`` make (into ``run_dir``), one record a step: its
    ``timing/*`` without the prefix, its ``perf/*`` metrics, and the prompt and generated tokens.

    The loop is `Trainer.fit` without its final checkpoint (TRL's side saves none either); a
    step ``trainer.profile_steps`` names is profiled as there."""
    from treadle.config import load_config
    from treadle.tracking.tracker import Tracker, read_metrics
    from treadle.trainers.rl import RLTrainer

    cfg = load_config(None, overrides)
    trainer = RLTrainer(cfg)
    total = cfg.trainer.total_steps
    try:
        with Tracker(trainer.out, total, 0, show_progress=False) as tracker:
            for step in range(1, total + 1):
                with trainer.profiled(step):
                    metrics = trainer.run_step(step)
                tracker.log(step, metrics)
    finally:
        trainer.actors.close()
    prompt_tokens = sum(len(row["prompt_ids"]) for row in trainer.train_ds.rows) * n
    return step_records(read_metrics(run_dir), cfg.data.batch_size * n, prompt_tokens)


def step_records(
    metrics: list[dict[str, float]], samples: int, prompt_tokens: float
) -> list[dict[str, float]]:
    """A treadle run's logged steps (``metrics.jsonl``) as step records: each step's
    ``timing/*`` without the prefix, its ``perf/*`` metrics, and its prompt and generated
    tokens (``samples`` a step)."""
    steps = []
    for m in metrics:
        record = {k.removeprefix("timing/"): v for k, v in m.items() if k.startswith("timing/")}
        record |= {k: v for k, v in m.items() if k.startswith("perf/")}
        record["generated_tokens"] = m["response/length_mean"] * samples
        record["prompt_tokens"] = prompt_tokens
        steps.append(record)
    return steps


# ----------------------------------------------------------------------------- summary

TRAINING_PHASES = ("old_log_probs", "ref_log_probs", "update_actor", "sync_weights")


def trl_phases(record: dict[str, float]) -> dict[str, float]:
    """step / generation / training / other of one TRL step record."""
    training = record["step"] - record["prepare"] + record.get("logps_in_prepare", 0.0)
    return split_phases(record, record["generate"], training)


def treadle_phases(record: dict[str, float]) -> dict[str, float]:
    """step / generation / training / other of one treadle step record (`timing/*` metrics)."""
    training = sum(record.get(name, 0.0) for name in TRAINING_PHASES)
    return split_phases(record, record["generate"], training)


def split_phases(record: dict[str, float], generation: float, training: float) -> dict[str, float]:
    return {
        "step": record["step"],
        "generation": generation,
        "training": training,
        "other": record["step"] - generation - training,
        "tokens_per_s": record["generated_tokens"] / generation,
        "generated_tokens": record["generated_tokens"],
        "prompt_tokens": record["prompt_tokens"],
    }


def medians(records: list[dict[str, float]], warmup: int) -> dict[str, float]:
    """Per key, the median over the records after the first `warmup`."""
    measured = records[warmup:]
    if not measured:
        raise ValueError(f"no step after the {warmup} warm-up steps")
    return {k: statistics.median(r[k] for r in measured) for k in measured[0]}


COLUMNS = (
    ("step s", "step", "{:.2f}"),
    ("generation s", "generation", "{:.2f}"),
    ("training s", "training", "{:.2f}"),
    ("other s", "other", "{:.2f}"),
    ("gen tokens/s", "tokens_per_s", "{:.0f}"),
    ("peak RSS GiB", "peak_rss_gib", "{:.2f}"),
    ("peak PSS GiB", "peak_pss_gib", "{:.2f}"),
)


def side_summary(side: dict[str, Any], phases: Any, warmup: int) -> dict[str, float]:
    summary = medians([phases(r) for r in side["steps"]], warmup)
    summary["peak_rss_gib"] = side["memory"]["peak_rss"] / GIB
    summary["peak_pss_gib"] = side["memory"]["peak_pss"] / GIB
    return summary


def format_table(
    trl: dict[str, float], ours: dict[str, float], columns: tuple = COLUMNS
) -> list[str]:
    """Aligned rows: TRL, treadle, and treadle / TRL per column."""
    rows = [["", *(title for title, _, _ in columns)]]
    for name, s in (("TRL", trl), ("treadle", ours)):
        rows.append([name, *(fmt.format(s[key]) for _, key, fmt in columns)])
    rows.append(["treadle/TRL", *(f"{ours[key] / trl[key]:.2f}" for _, key, _ in columns)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]


def ratio_lines(
    results: dict[str, tuple[dict[str, float], dict[str, float]]],
    metrics: tuple[tuple[str, str], ...] = (("step_time", "step"), ("peak_rss", "peak_rss_gib")),
) -> list[str]:
    """The closing lines: step-time ratios for every model, then peak-RSS ratios (or the
    ``(name, key)`` of ``metrics``, in their order)."""
    lines = []
    for metric, key in metrics:
        for model, (trl, ours) in results.items():
            lines.append(f"ratio {metric} treadle/trl {model}: {ours[key] / trl[key]:.2f}")
    return lines


def workload_warnings(trl: dict[str, float], ours: dict[str, float]) -> list[str]:
    keys = (("prompt tokens", "prompt_tokens"), ("generated tokens", "generated_tokens"))
    return [
        f"warning: {what} differ: TRL {trl[key]:.0f}, treadle {ours[key]:.0f} per step"
        for what, key in keys
        if trl[key] != ours[key]
    ]


def treadle_breakdown(steps: list[dict[str, float]], warmup: int) -> str:
    m = medians(steps, warmup)
    parts = [f"{k} {m[k]:.2f}" for k in ("generate", *TRAINING_PHASES) if k in m]
    rest = m["step"] - sum(m[k] for k in ("generate", *TRAINING_PHASES) if k in m)
    return "treadle phases (median s): " + ", ".join(parts) + f", rest {rest:.2f}"


def trl_breakdown(steps: list[dict[str, float]], warmup: int) -> str:
    m = medians(steps, warmup)
    scoring = m["prepare"] - m["generate"] - m.get("logps_in_prepare", 0.0)
    train = m["step"] - m["prepare"]
    return (
        f"TRL phases (median s): generate {m['generate']:.2f}, decode+reward+advantages "
        f"{scoring:.2f}, loss+backward+optimizer {train:.2f}"
    )


def memory_breakdown(processes: list[tuple[str, int, int]]) -> str:
    """treadle's processes at its RSS peak, largest first: name RSS/PSS in GiB."""
    ranked = sorted(processes, key=lambda p: -p[1])
    parts = [f"{name} {rss / GIB:.2f}/{pss / GIB:.2f}" for name, rss, pss in ranked]
    return f"treadle at peak, {len(processes)} processes (RSS/PSS GiB): " + ", ".join(parts)


# ----------------------------------------------------------------------------- main


def machine_line() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(
            (ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
            model,
        )
    except (OSError, subprocess.CalledProcessError):
        pass
    memory = psutil.virtual_memory().total / GIB
    return f"machine: {model}, {os.cpu_count()} cores, {memory:.0f} GiB, {platform.machine()}"


def print_header(args: argparse.Namespace, settings: dict[str, Any]) -> None:
    print(f"\ndate: {date.today().isoformat()}")
    print(machine_line())
    print(
        f"workload: {args.prompts_per_step} prompts x {args.n} samples x {args.new_tokens} new "
        f"tokens (forced), temperature 1, {args.dtype}, kl 0, lr {args.lr}, {args.threads} "
        f"threads; median of {args.steps} steps after {args.warmup} warm-up"
    )
    s = settings
    print(
        f"TRL 1.16 GRPOTrainer, its defaults: loss_type={s['loss_type']}, beta={s['beta']}, "
        f"gradient_checkpointing={s['gradient_checkpointing']}, one forward/backward over all "
        f"{args.prompts_per_step * args.n} samples, no old-log-prob pass; bf16={s['bf16']} "
        "(TRL's default is bf16 autocast)"
    )
    mixed = "bf16 mixed precision, bf16 vLLM" if args.dtype == "bfloat16" else "float32"
    print(
        f"treadle: Ray, FSDP2 on 1 rank, vLLM rollout, micro-batches of <= {args.micro_tokens} "
        "tokens, packed "
        f"sequences, {mixed}, no gradient checkpointing, no old-log-prob pass (on-policy), "
        "weight sync to vLLM every step"
    )


def report(args: argparse.Namespace, measured: dict[str, dict[str, Any]]) -> None:
    trl_settings = next(iter(measured.values()))["trl"]["settings"]
    print_header(args, trl_settings)
    results = {}
    for model, sides in measured.items():
        trl = side_summary(sides["trl"], trl_phases, args.warmup)
        ours = side_summary(sides["treadle"], treadle_phases, args.warmup)
        results[model] = (trl, ours)
        params = sides["trl"]["settings"]["parameters"] / 1e6
        loads = ", ".join(f"{s} {sides[s]['memory']['load_average']:.1f}" for s in sides)
        kv = sides["treadle"]["settings"]["kv_cache_gib"]
        print(
            f"\n{model} ({params:.1f}M parameters); treadle's vLLM KV cache {kv} GiB; "
            f"1-min load average at start: {loads}"
        )
        print("\n".join(format_table(trl, ours)))
        print(trl_breakdown(sides["trl"]["steps"], args.warmup))
        print(treadle_breakdown(sides["treadle"]["steps"], args.warmup))
        print(memory_breakdown(sides["treadle"]["memory"]["at_peak"]))
        for warning in workload_warnings(trl, ours):
            print(warning)
    print()
    print("\n".join(ratio_lines(results)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: tiny,smollm2-135m")
    p.add_argument("--steps", type=int, default=5, help="measured steps (median)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the measured ones")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto: bfloat16 where the CPU has bf16 instructions (TRL's default), else float32",
    )
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument(
        "--micro-tokens",
        type=int,
        default=2560,
        help="treadle: tokens per fwd/bwd (actor.max_tokens_per_micro_batch)",
    )
    p.add_argument("--kv-cache-gib", type=float, default=None, help="default: sized to fit")
    p.add_argument("--trl-venv", default=str(ROOT / ".venv-trl"))
    p.add_argument("--workdir", default=str(ROOT / "runs" / "grpo_vs_trl"), help="logs, runs")
    # The treadle side, run by this script in a child process.
    p.add_argument("--side", choices=["treadle"], help=argparse.SUPPRESS)
    p.add_argument("--side-out", help=argparse.SUPPRESS)
    p.add_argument("--model-path", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--reward", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        p.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cpu_has_bf16() else "float32"
    return args


def cpu_has_bf16() -> bool:
    """bf16 matrix instructions (AVX-512 BF16 or AMX), where bfloat16 compute is fast on CPU."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _env import ensure_project_python

    ensure_project_python()
    args = parse_args()
    if args.side == "treadle":
        treadle_side(args)
        return
    trl_python = ensure_trl_env(Path(args.trl_venv))
    measured: dict[str, dict[str, Any]] = {}
    for model in args.models:
        wl = workload(model, args)
        for side in ("trl", "treadle"):
            print(f"{model}: {side} (log: {Path(args.workdir) / model / side}.log)", flush=True)
        trl = measure_trl(trl_python, wl, args)
        measured[model] = {"trl": trl, "treadle": measure_treadle(wl, args)}
    report(args, measured)


if __name__ == "__main__":
    main()
