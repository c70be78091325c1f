"""The SFT driver: next-token loss on response tokens, with the same actor workers.

It uses the RL actor's worker group (FSDP2 engine, optimizer, checkpoints) without a
reference; a step is one optimizer step over ``data.batch_size`` samples. The run ends at
``trainer.total_steps`` (or after ``trainer.epochs`` passes), writes a checkpoint and exports
``<output_dir>/final_model``, and reports held-out accuracy when ``data.val_files`` is set.
"""

from __future__ import annotations

import math
import time

from treadle import checkpoint as ckpt
from treadle.config import Config
from treadle.data import ResumableSampler, collate_sft, load_sft_dataset
from treadle.errors import ConfigError
from treadle.models import load_tokenizer
from treadle.protocol import Batch
from treadle.tracking import Tracker, timed
from treadle.trainers.common import (
    build_actors,
    evaluate,
    load_prompts,
    prepare_run_dir,
    resume_point,
    save_checkpoint,
)


def sft(cfg: Config) -> dict[str, float]:
    out = prepare_run_dir(cfg)
    latest, actor_path = resume_point(cfg)
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: list at least one JSONL or Parquet file")
    d = cfg.data
    tok = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    ds = load_sft_dataset(
        d.train_files,
        prompt_key=d.prompt_key,
        response_key=d.response_key,
        tokenizer=tok,
        max_length=d.max_prompt_length + cfg.rollout.max_new_tokens,
        apply_chat_template=d.apply_chat_template,
        system_prompt=d.system_prompt,
    )
    sampler = ResumableSampler(len(ds), d.batch_size, cfg.trainer.seed, shuffle=d.shuffle)
    steps_per_epoch = len(ds) // d.batch_size
    total = cfg.trainer.total_steps
    if cfg.trainer.epochs is not None:
        total = cfg.trainer.epochs * steps_per_epoch
    start = 0
    if latest is not None:
        state = ckpt.read_state(latest)
        start = int(state["step"])
        sampler.load_state_dict(state["sampler"])
    actors = build_actors(cfg, actor_path, with_ref=False)
    group = actors.group
    if latest is not None:
        group.load_checkpoint(str(latest))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    metrics: dict[str, float] = {}
    with Tracker(out, total, start, cfg.trainer.progress, headline="sft/loss") as tracker:
        for step in range(start + 1, total + 1):
            metrics = {}
            t0 = time.perf_counter()
            rows = [ds[i] for i in sampler.next_indices()]
            ids, mask, loss_mask = collate_sft(rows, pad)
            batch = Batch.from_dict(
                tensors={"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
            )
            with timed(metrics, "update_actor"):
                metrics.update(group.train_sft(batch))
            metrics["timing/step"] = time.perf_counter() - t0
            metrics["epoch"] = step / max(steps_per_epoch, 1)
            if not math.isfinite(metrics["sft/loss"]):
                raise FloatingPointError(f"step {step}: SFT loss is {metrics['sft/loss']}")
            if cfg.data.val_files and (
                step == total or (cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0)
            ):
                val = load_prompts(cfg, d.val_files, "data.val_files")
                group.sync_weights()  # the rollout engine generates with the trained weights
                metrics["eval/accuracy"] = evaluate(cfg, group, val, pad)
            tracker.log(step, metrics)
            if step == total or (cfg.trainer.save_every and step % cfg.trainer.save_every == 0):
                save_checkpoint(cfg, group, step, sampler.state_dict(), final=step == total)
    actors.close()
    return metrics
