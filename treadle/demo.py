"""``treadle demo``: the built-in task end to end, SFT warm start then GRPO.

1. ``treadle prepare``: arithmetic problems, a tokenizer and a tiny model, built locally;
2. SFT on worked answers (``examples/arithmetic/sft.yaml``);
3. GRPO from the SFT model (``examples/arithmetic/grpo.yaml``);
4. greedy held-out accuracy of both, on the same problems:
   ``held-out accuracy: sft=<x>% rl=<y>%``.

The demo's runs go to the output directories its two configs name, which it empties first,
so that ``treadle train examples/arithmetic/grpo.yaml`` works after it.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from treadle.config import load_config
from treadle.errors import ConfigError
from treadle.tasks.arithmetic import prepare
from treadle.trainers.common import evaluate_model
from treadle.trainers.rl import train
from treadle.trainers.sft import sft


def run_demo(
    examples: str | Path = "examples/arithmetic", data_dir: str = "data/arithmetic"
) -> str:
    examples = Path(examples)
    if not (examples / "sft.yaml").is_file():
        raise ConfigError(f"demo: {examples}/sft.yaml not found; run it from the repository root")
    start = time.perf_counter()
    prepare(data_dir)
    sft_cfg = load_config(examples / "sft.yaml")
    rl_cfg = load_config(examples / "grpo.yaml")
    for cfg in (sft_cfg, rl_cfg):
        shutil.rmtree(cfg.trainer.output_dir, ignore_errors=True)
    print(f"[1/3] SFT warm start -> {sft_cfg.trainer.output_dir}", flush=True)
    sft(sft_cfg)
    sft_model = str(Path(sft_cfg.trainer.output_dir) / "final_model")
    print(f"[2/3] GRPO from {sft_model} -> {rl_cfg.trainer.output_dir}", flush=True)
    train(rl_cfg)
    rl_model = str(Path(rl_cfg.trainer.output_dir) / "final_model")
    print("[3/3] held-out evaluation (greedy)", flush=True)
    acc = {}
    for name, model in (("sft", sft_model), ("rl", rl_model)):
        cfg = load_config(examples / "grpo.yaml", [f"model.path={model}", "data.val_size=null"])
        acc[name] = 100 * evaluate_model(cfg)
    minutes = (time.perf_counter() - start) / 60
    line = f"held-out accuracy: sft={acc['sft']:.1f}% rl={acc['rl']:.1f}%"
    print(f"demo finished in {minutes:.1f} min")
    print(line)
    return line
