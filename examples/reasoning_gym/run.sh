#!/usr/bin/env bash
# The measured recipe: held-out accuracy before, SFT warm start, GRPO; wall times logged.
# Run from the repository root: bash examples/reasoning_gym/run.sh
set -euo pipefail
ex=examples/reasoning_gym
stamp() { date +%s; }
rm -rf runs/reasoning_gym/sft runs/reasoning_gym/grpo
t0=$(stamp)
treadle eval $ex/sft.yaml                        # the base model (sft.yaml's model.path)
t1=$(stamp)
treadle sft $ex/sft.yaml
t2=$(stamp)
treadle train $ex/grpo.yaml
t3=$(stamp)
echo "wall: eval before $((t1 - t0)) s, sft $((t2 - t1)) s, grpo $((t3 - t2)) s," \
     "training $((t3 - t1)) s"
