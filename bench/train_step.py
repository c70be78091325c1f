"""One actor update: treadle's worker against a minimal plain PyTorch loop, and the FLOP/s.

    OMP_NUM_THREADS=2 .venv/bin/python bench/train_step.py [--model smollm2|tiny]

Both sides get the same model weights, the same batch (``--seqs`` sequences of ``--prompt``
prompt and ``--response`` response tokens, random ids, every position valid), the same AdamW,
the same micro-batch size and the same PPO-clip token-mean loss on the response tokens:

- treadle: ``ActorRolloutRefWorker.update_actor`` through a local-backend ``WorkerGroup`` (FSDP2
  on one rank, log-probs chunked over positions with recompute);
- plain: ``model(...).logits`` -> float32 log_softmax -> PPO loss -> backward -> clip -> step.

Tokens/s counts every token of every sequence (prompt + response) per update, median of
``--repeats`` updates after one warm-up. Achieved FLOP/s uses 6 x parameters x tokens (the
usual forward + backward estimate, attention ignored) and is shown against a measured peak: the
median of five 2048^3 float32 matrix products on the same threads. The last line is
``ratio tokens_per_s treadle/plain: <r>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def model_folder(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from treadle.tasks.arithmetic import prepare

        return prepare(workdir / "tiny")["model"]
    from treadle.hub import fetch_model

    return fetch_model("smollm2-135m-instruct")


def make_batch(vocab: int, args: argparse.Namespace):
    from treadle.protocol import Batch

    g = torch.Generator().manual_seed(0)
    n, p, r = args.seqs, args.prompt, args.response
    return Batch.from_dict(
        tensors={
            "prompts": torch.randint(3, vocab, (n, p), generator=g),
            "prompt_mask": torch.ones(n, p, dtype=torch.long),
            "responses": torch.randint(3, vocab, (n, r), generator=g),
            "response_mask": torch.ones(n, r, dtype=torch.long),
            "old_log_probs": -torch.rand(n, r, generator=g) * 5,
            "advantages": torch.randn(n, r, generator=g),
        },
        meta={"step": 1},
    )


def time_updates(update, repeats: int) -> float:
    update()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        update()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def treadle_seconds(path: Path, batch, args: argparse.Namespace) -> float:
    from treadle.config import load_config
    from treadle.trainers.common import build_actors

    cfg = load_config(
        None,
        [
            f"model.path={path}",
            "trainer.backend=local",
            f"trainer.threads_per_rank={torch.get_num_threads()}",
            "algorithm.kl_coef=0",
            f"data.batch_size={args.seqs}",
            "rollout.n=1",
            f"actor.ppo_mini_batch_size={args.seqs}",
            f"actor.micro_batch_size={args.micro}",
            "actor.lr=1e-6",
        ],
    )
    actors = build_actors(cfg, str(path), with_ref=False)
    try:
        return time_updates(lambda: actors.group.update_actor(batch), args.repeats)
    finally:
        actors.close()


def plain_seconds(path: Path, batch, args: argparse.Namespace) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    r = args.response

    def update() -> None:
        for mb in batch.split(args.micro):
            ids = torch.cat([mb["prompts"], mb["responses"]], 1)
            mask = torch.cat([mb["prompt_mask"], mb["response_mask"]], 1)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            logp = torch.log_softmax(logits[:, -r - 1 : -1].float(), -1)
            logp = logp.gather(-1, mb["responses"][..., None]).squeeze(-1)
            ratio = torch.exp(logp - mb["old_log_probs"])
            adv = mb["advantages"]
            pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
            loss = pg.sum() / batch["response_mask"].sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return time_updates(update, args.repeats)


def matmul_peak() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    times = []
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * 2048**3 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as tmp:
        path = model_folder(args.model, Path(tmp))
        vocab = AutoConfig.from_pretrained(path).vocab_size
        batch = make_batch(vocab, args)
        from treadle.models import count_parameters, load_causal_lm

        params = count_parameters(load_causal_lm(path))
        plain = plain_seconds(path, batch, args)
        ours = treadle_seconds(path, batch, args)
    peak = matmul_peak()
    tokens = args.seqs * (args.prompt + args.response)
    print(
        f"\n{args.model} ({params / 1e6:.1f}M params), {args.seqs} seqs x "
        f"{args.prompt}+{args.response} tokens, micro-batch {args.micro}, float32, "
        f"{torch.get_num_threads()} threads; matmul peak {peak / 1e9:.0f} GFLOP/s"
    )
    print(f"{'side':8} {'update s':>9} {'tokens/s':>9} {'GFLOP/s':>8} {'of peak':>8}")
    for side, seconds in (("plain", plain), ("treadle", ours)):
        flops = 6 * params * tokens / seconds
        print(
            f"{side:8} {seconds:9.2f} {tokens / seconds:9.0f} {flops / 1e9:8.1f} "
            f"{flops / peak:8.1%}"
        )
    print(f"ratio tokens_per_s treadle/plain: {plain / ours:.2f}")


if __name__ == "__main__":
    main()
