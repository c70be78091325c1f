"""``treadle demo``: the built-in task end to end, SFT warm start then GRPO.

1. ``treadle prepare``: arithmetic problems, a tokenizer and a tiny model, built locally;
2. SFT on worked answers (``examples/arithmetic/sft.yaml``);
3. GRPO from the SFT model (``examples/arithmetic/grpo.yaml``);
4. greedy held-out accuracy at the end of both runs, on the same problems:
   ``held-out accuracy: sft=<x>% rl=<y>%``.

The demo's runs go to the output directories its two configs name, which it empties first,
so that ``treadle train examples/arithmetic/grpo.yaml`` works after it.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from treadle.config import load_config
from treadle.runtime.errors import ConfigError
from treadle.tasks.arithmetic import prepare
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
    # Both runs end with a greedy evaluation on the whole held-out file: the same problems.
    full_eval = ["data.val_size=null"]
    sft_cfg = load_config(examples / "sft.yaml", full_eval)
    rl_cfg = load_config(examples / "grpo.yaml", full_eval)
    for cfg in (sft_cfg, rl_cfg):
        shutil.rmtree(cfg.trainer.output_dir, ignore_errors=True)
    print(f"[1/2] SFT warm start -> {sft_cfg.trainer.output_dir}", flush=True)
    sft_acc = 100 * sft(sft_cfg)["eval/val/accuracy"]
    print(f"[2/2] GRPO from {rl_cfg.model.path} -> {rl_cfg.trainer.output_dir}", flush=True)
    rl_acc = 100 * train(rl_cfg)["eval/val/accuracy"]
    minutes = (time.perf_counter() - start) / 60
    line = f"held-out accuracy: sft={sft_acc:.1f}% rl={rl_acc:.1f}%"
    print(f"demo finished in {minutes:.1f} min")
    print(line)
    return line
