"""vLLM CPU settings, swept on the rollout workload of `bench/rollout.py`.

    python bench/vllm_sweep.py [--configs base,bs32,...] [--rounds 2] [--repeats 2]
        [--prompts 32 --n 4 --new-tokens 64 --dtype float32 --threads 2]

Each configuration is a set of environment variables (set before the measuring process starts,
so `LD_PRELOAD` and OpenMP settings take effect) and keyword arguments for `vllm.LLM` (through
`VLLMRolloutEngine`). vLLM allows one engine per process, so each (configuration, round) runs
in a child process: it starts the engine, warms it up, then ``--repeats`` times times one
`generate` of the whole workload (SmolLM2-135M-Instruct, chat-formatted arithmetic prompts,
``--n`` samples at temperature 1, every response forced to ``--new-tokens`` tokens) and one
with a single new token (the prefill, nearly alone); `generate` starts from an empty prefix
cache, as every rollout after a weight update does. ``hf`` is the transformers engine on the
same workload, one batch. The machine is shared: the configurations run interleaved, round
after round (A, B, C, A, B, C, ...), and the table gives medians and the 1-minute load
average seen at each start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

LIB = Path(sys.prefix) / "lib"
JEMALLOC = LIB / "python3.11/site-packages/ray/core/libjemalloc.so"  # ships with Ray
# name -> (environment variables, vllm.LLM keyword arguments)
CONFIGS: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "hf": ({}, {}),
    "base": ({}, {"block_size": 128}),  # treadle before this sweep: vLLM's CPU default
    "bs32": ({}, {"block_size": 32}),  # treadle's default since this sweep
    "bs64": ({}, {"block_size": 64}),
    "nopc": ({}, {"enable_prefix_caching": False}),
    "bs32-nopc": ({}, {"block_size": 32, "enable_prefix_caching": False}),
    "mbt8k": ({}, {"max_num_batched_tokens": 8192}),
    "bs32-mbt8k": ({}, {"block_size": 32, "max_num_batched_tokens": 8192}),
    "bs32-mbt1k": ({}, {"block_size": 32, "max_num_batched_tokens": 1024}),
    "seqs64": ({}, {"max_num_seqs": 64}),
    "compile": ({}, {"enforce_eager": False}),
    "bs32-compile": ({}, {"block_size": 32, "enforce_eager": False}),
    "splitkv0": ({"VLLM_CPU_ATTN_SPLIT_KV": "0"}, {}),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, {}),
    "threads1": ({"OMP_NUM_THREADS": "1"}, {}),
    # threads that sleep at a barrier: CPU seconds then count work, not spinning, on a busy
    # machine (the wall time does not)
    "hf-passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, {}),
    "base-passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, {"block_size": 128}),
    "bind": ({"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}, {}),
    "jemalloc": ({"LD_PRELOAD": str(JEMALLOC)}, {}),
    "iomp": ({"LD_PRELOAD": str(LIB / "libiomp5.so"), "KMP_BLOCKTIME": "5"}, {}),
}


def cpu_seconds() -> float:
    """User plus system CPU time of this process, all its threads."""
    t = os.times()
    return t.user + t.system


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", args.threads)))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _env import model_folder
    from rollout import chat_prompts

    from treadle.engines.inference import HFRolloutEngine, SamplingParams
    from treadle.models.loading import load_tokenizer

    path = model_folder("smollm2-135m", Path(args.workdir))
    tokenizer = load_tokenizer(path)
    prompts = chat_prompts(tokenizer, args.prompts)
    params = SamplingParams(
        n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True
    )
    one = replace(params, max_new_tokens=1)
    result: dict[str, Any] = {"load": os.getloadavg()[0], "runs": [], "prefill_s": []}
    start = time.perf_counter()
    if args.config.startswith("hf"):
        from treadle.models.loading import load_causal_lm

        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        model = load_causal_lm(path, args.dtype)
        engine: Any = HFRolloutEngine(
            model, [tokenizer.eos_token_id], pad, micro_batch_size=len(prompts) * args.n
        )
    else:
        from treadle.engines.vllm import VLLMRolloutEngine

        engine = VLLMRolloutEngine(
            path,
            dtype=args.dtype,
            max_model_len=max(map(len, prompts)) + args.new_tokens,
            kv_cache_gib=args.kv_cache_gib,
            **CONFIGS[args.config][1],
        )
    result["start_s"] = time.perf_counter() - start
    result["prompt_tokens_mean"] = sum(map(len, prompts)) / len(prompts)
    engine.generate(prompts[:2], replace(params, n=1, max_new_tokens=4))  # warm-up
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        engine.generate(prompts, one)
        result["prefill_s"].append(time.perf_counter() - t0)
        t0, c0 = time.perf_counter(), cpu_seconds()
        out = engine.generate(prompts, params)
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        tokens = sum(len(t) for t in out.token_ids)
        result["runs"].append(
            {"s": seconds, "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / seconds}
        )
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="hf,base,bs32,bs16,mbt8k,jemalloc,bind")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.config:
        child(args)
        return
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="treadle-sweep-") as tmp:
        workdir = args.workdir or tmp
        for r in range(args.rounds):
            for name in names:
                env = {
                    **os.environ,
                    "OMP_NUM_THREADS": str(args.threads),
                    "TOKENIZERS_PARALLELISM": "false",
                    **CONFIGS[name][0],
                }
                command = [
                    sys.executable,
                    __file__,
                    f"--config={name}",
                    f"--workdir={workdir}",
                    *(
                        f"--{k.replace('_', '-')}={v}"
                        for k, v in vars(args).items()
                        if k in ("repeats", "prompts", "n", "new_tokens", "threads")
                        or k in ("kv_cache_gib", "dtype")
                    ),
                ]
                proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    log = Path(workdir).parent / f"sweep-{name}-{r}.log"
                    log.write_text(proc.stdout + proc.stderr, encoding="utf-8")
                    print(f"round {r} {name}: failed (code {proc.returncode}; log {log})")
                    continue
                res = json.loads(line[len("RESULT ") :])
                results[name].append(res)
                tps = ", ".join(
                    f"{x['tokens_per_s']:.0f} (cpu {x.get('cpu_s', float('nan')):.1f} s)"
                    for x in res["runs"]
                )
                print(
                    f"round {r} {name:<13} load {res['load']:5.1f}  start {res['start_s']:5.1f} s"
                    f"  prefill {', '.join(f'{p:.2f}' for p in res['prefill_s'])} s"
                    f"  tokens/s {tps}",
                    flush=True,
                )
    print(
        f"\n{args.prompts} prompts x {args.n} samples x {args.new_tokens} tokens, {args.dtype}, "
        f"{args.threads} threads; medians over {args.rounds} rounds x {args.repeats} runs"
    )
    print(
        f"{'config':<14}{'tokens/s':>9}{'gen s':>8}{'gen cpu s':>10}{'prefill s':>11}"
        f"{'start s':>9}  loads"
    )
    hf = results.get("hf")
    hf_tps = statistics.median(x["tokens_per_s"] for r in hf for x in r["runs"]) if hf else None
    for name, res in results.items():
        if not res:
            continue
        tps = statistics.median(x["tokens_per_s"] for r in res for x in r["runs"])
        gen = statistics.median(x["s"] for r in res for x in r["runs"])
        cpu = statistics.median(x.get("cpu_s", float("nan")) for r in res for x in r["runs"])
        prefill = statistics.median(p for r in res for p in r["prefill_s"])
        start = statistics.median(r["start_s"] for r in res)
        loads = ",".join(f"{r['load']:.1f}" for r in res)
        ratio = f"  vs hf {tps / hf_tps:.2f}" if hf_tps and name != "hf" else ""
        print(
            f"{name:<14}{tps:9.0f}{gen:8.1f}{cpu:10.1f}{prefill:11.2f}{start:9.1f}  {loads}{ratio}"
        )


if __name__ == "__main__":
    main()
