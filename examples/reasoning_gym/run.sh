#!/usr/bin/env bash
# The best recipe measured (README.md): held-out accuracy before, SFT on worked steps, GRPO;
# wall times logged.
# Run from the repository root: bash examples/reasoning_gym/run.sh
set -euo pipefail
ex=examples/reasoning_gym
stamp() { date +%s; }
rm -rf runs/reasoning_gym/sft_steps runs/reasoning_gym/grpo_steps
t0=$(stamp)
treadle eval $ex/sft_steps.yaml                  # the base model (its model.path)
t1=$(stamp)
treadle sft $ex/sft_steps.yaml
t2=$(stamp)
treadle train $ex/grpo_steps.yaml
t3=$(stamp)
echo "wall: eval before $((t1 - t0)) s, sft $((t2 - t1)) s, grpo $((t3 - t2)) s," \
     "training $((t3 - t1)) s"
