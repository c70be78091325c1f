"""The OpenAI-compatible endpoint under load: many concurrent agent sessions on the tiny model.

    OMP_NUM_THREADS=1 python bench/load.py [--sessions 1000] [--turns 2] [--engine vllm]

`treadle serve` serves `treadle prepare`'s tiny model (made in a temporary folder) with the
engine `--engine` names; then `--sessions` sessions run at once, each a conversation of
`--turns` chat calls (`X-Treadle-Session` header, so a session stays on its replica and its
calls are recorded as in training; each turn sends the conversation so far, 16 new tokens a
call, temperature 1). A warm-up wave of as many sessions runs first (`--warmup`), so the
server's buffers, the engine's batch shapes and Python's allocator have met that load once:
what the measured wave adds to the memory after it is what every such wave would add.

Then `--waves` measured waves of the same size. It prints one table, of the last wave:
sessions, calls, errors (any non-200 answer or broken connection), the latency of a call
(p50, p99, max, seconds), calls/s over the wave; and the serving process's resident memory
(RSS, MiB, with its children) after the warm-up and after each wave, the growth from the
warm-up to the end in percent (the issue's bound: 10%), and the server's open file
descriptors at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _env import ROOT, ensure_project_python, model_folder


def start_server(model: Path, engine: str, workdir: Path) -> tuple[subprocess.Popen, str, str]:
    """`treadle serve` on ``model``: the process, its base URL and API key (from its line)."""
    config = workdir / "serve.yaml"
    config.write_text(
        f"model:\n  path: {model}\ndata:\n  max_prompt_length: 192\n"
        f"rollout:\n  engine: {engine}\n  max_new_tokens: 16\n  max_inflight_per_replica: 4096\n"
        f"trainer:\n  output_dir: {workdir / 'run'}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "treadle", "serve", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # the announcement: "serving M at URL (api key: K); ..."
        found = re.search(r"serving .* at (\S+) \(api key: (\S+)\)", line)
        if found:  # from here its output goes to serve.log (a full pipe would stall it)
            log = (workdir / "serve.log").open("w")
            threading.Thread(
                target=shutil.copyfileobj, args=(proc.stdout, log), daemon=True
            ).start()
            return proc, found.group(1), found.group(2)
    raise SystemExit(f"treadle serve exited ({proc.wait()}) before it announced its URL")


def rss_mib(pid: int) -> float:
    import psutil

    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def session(client, url: str, key: str, name: str, turns: int, out: dict) -> None:
    """One conversation of ``turns`` calls; each call's latency (or its error) into ``out``."""
    messages = [{"role": "user", "content": f"What is {len(name) % 50}+{hash(name) % 50}?"}]
    headers = {"Authorization": f"Bearer {key}", "X-Treadle-Session": name}
    body = {"model": "m", "max_tokens": 16, "temperature": 1.0}
    for _ in range(turns):
        start = time.perf_counter()
        try:
            r = await client.post(
                f"{url}/chat/completions", json={**body, "messages": messages}, headers=headers
            )
            if r.status_code != 200:
                out["errors"].append(f"{r.status_code}: {r.text[:200]}")
                return
            reply = r.json()["choices"][0]["message"]["content"] or ""
        except Exception as e:  # a broken connection, a timeout: counted, and said
            out["errors"].append(f"{type(e).__name__}: {e}")
            return
        out["latency"].append(time.perf_counter() - start)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]


async def wave(url: str, key: str, sessions: int, turns: int, tag: str) -> dict:
    import httpx

    out: dict = {"latency": [], "errors": []}
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(
            *(session(client, url, key, f"{tag}-{i}", turns, out) for i in range(sessions))
        )
        out["seconds"] = time.perf_counter() - start
    return out


def main() -> None:
    ensure_project_python()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--warmup", type=int, default=None, help="default: --sessions")
    p.add_argument("--engine", choices=["hf", "vllm"], default="vllm")
    p.add_argument("--waves", type=int, default=2, help="measured waves after the warm-up")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = model_folder("tiny", workdir)
        proc, url, key = start_server(model, args.engine, workdir)
        try:
            warmup = args.sessions if args.warmup is None else args.warmup
            asyncio.run(wave(url, key, warmup, args.turns, "warmup"))
            rss = [rss_mib(proc.pid)]
            for i in range(args.waves):
                out = asyncio.run(wave(url, key, args.sessions, args.turns, f"load{i}"))
                rss.append(rss_mib(proc.pid))
            fds = open_fds(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            log_tail = "".join((workdir / "serve.log").read_text().splitlines(True)[-20:])
    lat = sorted(out["latency"])
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else lat * 99
    rows = [
        ("engine", args.engine),
        ("sessions x turns", f"{args.sessions} x {args.turns}"),
        ("calls answered", str(len(lat))),
        ("errors", str(len(out["errors"]))),
        ("latency p50 / p99 / max (s)", f"{q[49]:.2f} / {q[98]:.2f} / {lat[-1]:.2f}"),
        ("calls/s", f"{len(lat) / out['seconds']:.1f}"),
        ("server RSS after warm-up, each wave (MiB)", " / ".join(f"{m:.0f}" for m in rss)),
        ("RSS growth, warm-up to end", f"{100 * (rss[-1] - rss[0]) / rss[0]:+.1f}%"),
        ("server open fds at the end", str(fds)),
    ]
    print("\n| measure | value |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")
    for error in out["errors"][:5]:
        print(f"error: {error}")
    if out["errors"]:
        print(f"the server's log ended:\n{log_tail}")


if __name__ == "__main__":
    main()
