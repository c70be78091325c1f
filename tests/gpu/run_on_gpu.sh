#!/usr/bin/env bash
# One call on the lent GPU machine (/work/shared/GPU.md): the wheels it lacks, then
#   tests   tests/gpu and tests/engines/test_cuda.py          (~5 min budget)
#   bench   bench/gpu.py, both workloads, treadle on each KV cache (dynamic, and static
#           with its decoding step compiled) against one TRL run    (~8 min budget)
#   all     both, one after the other (more than one 10-minute call of the lent machine)
# Before the call, on the CPU machine, from the repository root (~10 MB with the source):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection \
#     typing_extensions==4.16.0 datasets==5.2.0 dill multiprocess xxhash cloudpickle trl==1.16.0
# and give the run tool carry=[".whl"]. What it prints goes to $OUT (tests.txt, bench.txt).
set -u
what=${1:-all}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider -rfE --durations=20 \
    tests/gpu tests/engines/test_cuda.py 2>&1 | tee "$out/tests.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 540 python3 bench/gpu.py --cache dynamic,static --workdir /tmp/gpu_bench 2>&1 \
    | tee "$out/bench.txt"
  # each side's log and step records, by workload (the records come back after a timeout too)
  for log in /tmp/gpu_bench/*/*.log /tmp/gpu_bench/*/*.json; do
    [ -f "$log" ] && cp "$log" "$out/$(basename "$(dirname "$log")")-$(basename "$log")"
  done
fi
