#!/usr/bin/env bash
# One call on the lent GPU machine (/work/shared/GPU.md): the wheels it lacks, then
#   tests   tests/gpu, tests/engines/test_cuda.py and test_sequence_parallel.py, a line a
#           test, in 4 processes (240 s at most); then bench/sp_attention.py (60 s at most)
#   bench   bench/gpu.py, both workloads, treadle on each KV cache (dynamic; then static, its
#           decoding step compiled; then paged, transformers' continuous batching, last: without
#           flash-attn its attention spans the whole batch; then dynamic+offload, what waits
#           in host memory) against one TRL run, within --deadline-s; treadle's side on the
#           dynamic cache profiles one more step (trainer.profile_steps)
#   all     both, one after the other, in 575 s: tests, then bench with the time left
# A session is lent 15 minutes of device time, the machine's start (1-2 min) included, and one
# call runs 10 minutes at most: so call `all` once, with timeout_s=600, and give the machine
# back after it. A side cut by the deadline, or failed after its measured steps, keeps the
# steps it finished ("cut at ...", "stopped (...)"), and one that did not start is named in
# bench.txt ("not measured (...)").
# Before the call, on the CPU machine, from the repository root (~11 MB with the source; peft
# travels too, the version the CPU suite runs, so the LoRA cases do not meet the image's own):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection \
#     typing_extensions==4.16.0 datasets==5.2.0 dill multiprocess xxhash cloudpickle trl==1.16.0 \
#     pytest-xdist==3.8.0 execnet==2.1.2 peft==0.21.2
# and give the run tool carry=[".whl"]. What it prints goes to $OUT: gpu.txt, tests.txt,
# bench.txt (its end: the README's table, in Markdown, then the ratio lines), sides.tgz (each
# side's log, step records and profile table) and traces.tar.
# A dry run of the bench's GPU settings on the CPU, with the image's torch and transformers
# in front (PYTHONPATH) where they are unpacked:
#   python bench/gpu.py --tiny --device cpu --precision bf16 \
#     --cache dynamic,static,paged,dynamic+offload \
#     --profile dynamic --steps 2 --warmup 1 --workdir /tmp/dry
set -u
what=${1:-all}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv |
  tee "$out/gpu.txt"
# what torch.compile's triton needs to build its launchers (the static KV cache's compiled step)
python3 -c "import os, sysconfig; h = sysconfig.get_paths()['include'] + '/Python.h'
print('Python.h:', h if os.path.exists(h) else 'missing')" | tee -a "$out/gpu.txt"
echo "C compiler: $(command -v cc gcc | head -1)" | tee -a "$out/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  # 4 test processes share the GPU (tiny models; 16 cores), where pytest-xdist came along and
  # the GPU takes several processes (its compute mode is Default, not exclusive)
  workers=()
  mode=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader | head -1)
  [ "$mode" = Default ] && python3 -c "import xdist" 2>/dev/null && workers=(-n 4 --dist load)
  # (cuBLAS's fixed workspaces: the resume test's two runs may then give equal numbers)
  CUBLAS_WORKSPACE_CONFIG=:4096:8 OMP_NUM_THREADS=4 timeout -k 15 240 python3 -m pytest -v ${workers[@]+"${workers[@]}"} -p no:cacheprovider -rfE \
    --durations=20 tests/gpu tests/engines/test_cuda.py tests/engines/test_sequence_parallel.py \
    2>&1 | tee "$out/tests.txt"
  # sequence parallelism's attention: masked, per sequence, varlen (about 10 s)
  timeout -k 5 60 python3 bench/sp_attention.py 2>&1 | tee -a "$out/tests.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  # all: what is left of 575 s (the call's 600 less the copying back); bench alone: 540 s
  left=540
  [ "$what" = all ] && left=$(( 575 - SECONDS ))
  python3 bench/gpu.py --cache dynamic,static,paged,dynamic+offload --profile dynamic \
    --steps 2 --warmup 1 --deadline-s "$left" --workdir /tmp/gpu_bench 2>&1 | tee "$out/bench.txt"
  # each side's log, step records and profile table, by workload, in one file (8 files at most
  # come back, 16 MiB each); the profiles' traces in another, the 1.4b one left out if too big
  cd /tmp/gpu_bench
  tar czf "$out/sides.tgz" */*.log */*.json */treadle_run_*/profile/*/*.txt
  tar cf "$out/traces.tar" */treadle_run_*/profile/*/*.json.gz
  [ "$(stat -c %s "$out/traces.tar")" -le 16000000 ] ||
    tar cf "$out/traces.tar" smollm2/treadle_run_*/profile/*/*.json.gz
fi
