#!/usr/bin/env bash
# One call on the lent GPU machine (/work/shared/GPU.md): the wheels it lacks, then
#   tests   tests/gpu and tests/engines/test_cuda.py          (~5 min budget)
#   bench   bench/gpu.py, both workloads                       (~8 min budget)
#   static  bench/gpu.py --cache static: treadle's hf engine on a static KV cache, whose
#           decoding step transformers compiles (~8 min; the default rollout is chosen by
#           the two runs' step times)
#   all     tests and bench
# Before the call, on the CPU machine, from the repository root (9.6 MB with the source):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection \
#     typing_extensions==4.16.0 datasets==5.2.0 dill multiprocess trl==1.16.0
# and give the run tool carry=[".whl"]. Its output goes to $OUT (tests.txt, bench-<cache>.txt).
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
if [ "$what" = bench ] || [ "$what" = static ] || [ "$what" = all ]; then
  cache=dynamic; [ "$what" = static ] && cache=static
  timeout 480 python3 bench/gpu.py --cache $cache --workdir /tmp/gpu_bench 2>&1 \
    | tee "$out/bench-$cache.txt"
  for log in /tmp/gpu_bench/*/*.log; do  # each side's log, by workload
    [ -f "$log" ] && cp "$log" "$out/$(basename "$(dirname "$log")")-$(basename "$log")"
  done
fi
