#!/usr/bin/env bash
# The SmolLM2 recipe: the base model evaluated, SFT warm start, GRPO, then checkpoints of both
# runs evaluated again with 8 samples a prompt on the first 100 problems (pass@k, maj@k; about
# 2 minutes each). Prints the wall times.
# Run from the repository root: bash examples/smollm2/run.sh
set -euo pipefail
ex=examples/smollm2
base=~/.cache/treadle/models/smollm2-135m-instruct
sampled=(eval.n=8 eval.temperature=1.0 data.val_size=100)
treadle model fetch smollm2-135m-instruct
treadle prepare --task chat_arithmetic
rm -rf runs/smollm2/sft runs/smollm2/grpo
stamp() { date +%s; }
t0=$(stamp)
treadle eval $ex/sft_arithmetic.yaml                                  # the base model, greedy
treadle eval $base --config $ex/sft_arithmetic.yaml "${sampled[@]}"   # ... and sampled
t1=$(stamp)
treadle sft $ex/sft_arithmetic.yaml
t2=$(stamp)
treadle train $ex/grpo_arithmetic.yaml
t3=$(stamp)
treadle eval runs/smollm2/sft --steps 20,100 "${sampled[@]}"   # -> runs/smollm2/sft/eval.jsonl
treadle eval runs/smollm2/grpo --steps 12 "${sampled[@]}"      # -> runs/smollm2/grpo/eval.jsonl
t4=$(stamp)
echo "wall: base model $((t1 - t0)) s, sft $((t2 - t1)) s, grpo $((t3 - t2)) s," \
     "training $((t3 - t1)) s, sampled evaluation of the checkpoints $((t4 - t3)) s"
