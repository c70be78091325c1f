"""One actor update: treadle's worker against a minimal plain PyTorch loop, and the FLOP/s.

    OMP_NUM_THREADS=2 python bench/train_step.py [--model smollm2|tiny]
        [--lengths uniform|uneven|grouped] [--variant NAME=key=value,key=value ...]
        [--no-plain]

Both sides get the same model weights, the same batch (``--seqs`` sequences of random ids),
the same AdamW, the same micro-batch size and the same PPO-clip token-mean loss on the
response tokens. ``--lengths uniform``: every sequence ``--prompt`` + ``--response`` tokens,
no padding; ``uneven``: prompts of 20-60 and responses of 5-64 tokens, left- and right-padded
to the longest as treadle's batches are (the realistic case the packed path is for);
``grouped``: GRPO's shape on reasoning-gym's basic_arithmetic, ``--seqs / --group`` prompts of
40-52 tokens, each with ``--group`` responses of 3-8 tokens (what ``actor.share_prompts``
is for: compare ``--variant share=actor.share_prompts=true --variant
unshared=actor.share_prompts=false --no-plain``).

- treadle: ``ActorRolloutRefWorker.update_actor`` through a local-backend ``WorkerGroup``
  (FSDP2 on one rank, log-probs chunked over positions with recompute), once per
  ``--variant`` (a name and config overrides; the default is treadle's defaults, then the
  padded path, then bf16 mixed precision);
- plain: ``model(...).logits`` -> float32 log_softmax -> PPO loss -> backward -> clip -> step,
  on the padded batch, in float32.

Tokens/s counts the valid tokens (prompt + response, padding excluded) per update, median of
``--repeats`` updates after one warm-up. Achieved FLOP/s uses 6 x parameters x tokens (the
usual forward + backward estimate, attention ignored) and is shown against a measured peak: the
median of five 2048^3 float32 matrix products on the same threads. The last line is
``ratio tokens_per_s treadle/plain: <r>`` for the first variant (``--no-plain``: no plain
loop, and the ratio is the first variant's against the second's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # under treadle's .venv, set up when missing (bench/_env.py)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _env import ensure_project_python

    ensure_project_python()

import torch

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def make_batch(vocab: int, args: argparse.Namespace):
    from treadle.protocol import Batch

    g = torch.Generator().manual_seed(0)
    n, p, r = args.seqs, args.prompt, args.response
    if args.lengths == "uniform":
        p_len, r_len = torch.full((n,), p), torch.full((n,), r)
    elif args.lengths == "grouped":
        k = args.group
        p_len = torch.randint(40, 53, (n // k,), generator=g).repeat_interleave(k)
        r_len = torch.randint(3, 9, (n,), generator=g)
        p, r = int(p_len.max()), int(r_len.max())
    else:
        p_len = torch.randint(20, 61, (n,), generator=g)
        r_len = torch.randint(5, 65, (n,), generator=g)
        p, r = int(p_len.max()), int(r_len.max())
    pmask = (torch.arange(p)[None] >= (p - p_len)[:, None]).long()  # left-padded
    rmask = (torch.arange(r)[None] < r_len[:, None]).long()  # right-padded
    prompts = torch.randint(3, vocab, (n, p), generator=g)
    if args.lengths == "grouped":  # one prompt a group
        prompts = prompts[:: args.group].repeat_interleave(args.group, 0)
    return Batch.from_dict(
        tensors={
            "prompts": prompts * pmask,
            "prompt_mask": pmask,
            "responses": torch.randint(3, vocab, (n, r), generator=g) * rmask,
            "response_mask": rmask,
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


def treadle_seconds(path: Path, batch, args: argparse.Namespace, overrides: list[str]) -> float:
    from treadle.config import load_config
    from treadle.trainers.roles import build_actors

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
            *overrides,
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
    r = batch["responses"].shape[1]

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
            loss = (pg * mb["response_mask"]).sum() / batch["response_mask"].sum()
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


DEFAULT_VARIANTS = [
    "treadle=",
    "padded=actor.remove_padding=false",
    "bf16=actor.mixed_precision=bf16",
]


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition("=")
    return name, [o for o in overrides.split(",") if o]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--lengths", choices=["uniform", "uneven", "grouped"], default="uniform")
    parser.add_argument("--group", type=int, default=8, help="grouped: samples per prompt")
    parser.add_argument("--no-plain", action="store_true", help="no plain PyTorch loop")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--variant",
        action="append",
        help="NAME=key=value,key=value: a treadle run with these config overrides "
        f"(repeatable; default: {' '.join(DEFAULT_VARIANTS)})",
    )
    args = parser.parse_args()
    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as tmp:
        from _env import model_folder

        path = model_folder(args.model, Path(tmp))
        vocab = AutoConfig.from_pretrained(path).vocab_size
        batch = make_batch(vocab, args)
        from treadle.models.loading import count_parameters, load_causal_lm

        params = count_parameters(load_causal_lm(path))
        results = [] if args.no_plain else [("plain", plain_seconds(path, batch, args))]
        for name, overrides in variants:
            results.append((name, treadle_seconds(path, batch, args, overrides)))
            print(f"{name}: {results[-1][1]:.2f} s an update", flush=True)  # as they come
    peak = matmul_peak()
    tokens = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    padded = batch["prompts"].numel() + batch["responses"].numel()
    print(
        f"\n{args.model} ({params / 1e6:.1f}M params), {args.seqs} seqs, {args.lengths} "
        f"lengths: {tokens} tokens ({padded} padded), micro-batch {args.micro}, "
        f"{torch.get_num_threads()} threads; float32 matmul peak {peak / 1e9:.0f} GFLOP/s"
    )
    print(f"{'side':10} {'update s':>9} {'tokens/s':>9} {'GFLOP/s':>8} {'of peak':>8}  overrides")
    extras = ([] if args.no_plain else [[]]) + [o for _, o in variants]
    for (side, seconds), extra in zip(results, extras, strict=True):
        flops = 6 * params * tokens / seconds
        print(
            f"{side:10} {seconds:9.2f} {tokens / seconds:9.0f} {flops / 1e9:8.1f} "
            f"{flops / peak:8.1%}  {' '.join(extra)}"
        )
    if args.no_plain:
        (first, a), (second, b) = results[:2]
        print(f"ratio tokens_per_s {first}/{second}: {b / a:.2f}")
    else:
        print(f"ratio tokens_per_s treadle/plain: {results[0][1] / results[1][1]:.2f}")


if __name__ == "__main__":
    main()
