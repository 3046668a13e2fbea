#!/usr/bin/env bash
# The device check of issue 40, in one call on a GPU machine without network (benchmarks/gpu/fetch.sh,
# run beforehand where there is network, fills .gpu/: the wheels the machine's image lacks and a Llama 3
# tokenizer). From the repo root:   [STEPS="tests bench profile"] bash benchmarks/gpu_check.sh [gpu.py args...]
# Writes under $OUT (default /tmp/gpu-check): tests.log, bench.log, gpu.json, gpu.md, serve.log (STEPS has
# tests and bench by default), profile.log and gpu_profile.json (profile: benchmarks/gpu_profile.py).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 LADLE_GPU_TOKENIZER=$PWD/.gpu/llama3-tokenizer
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
STEPS=${STEPS:-tests bench}  # any of: tests bench profile
if [[ " $STEPS " == *" tests "* ]]; then
  echo "== tests/gpu (and the Triton kernel tests, now on the GPU)"
  tests=$(ls -d tests/gpu tests/test_triton_attention.py tests/test_triton_ops.py tests/test_sampler_batched.py 2>/dev/null)
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest $tests -q -p no:cacheprovider --durations=10 2>&1 \
      | tee "$OUT/tests.log" | tail -40
fi
if [[ " $STEPS " == *" bench "* ]]; then
  echo "== benchmarks/gpu.py"
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/gpu.py --tokenizer .gpu/llama3-tokenizer --out "$OUT" "$@" 2>&1 \
      | tee "$OUT/bench.log" | grep -v "^  transformers:" | tail -60
fi
if [[ " $STEPS " == *" profile "* ]]; then  # where a decode step's time goes: host phases, kernels by name
  echo "== benchmarks/gpu_profile.py"
  timeout "${PROFILE_TIMEOUT:-240}" python3 benchmarks/gpu_profile.py --tokenizer .gpu/llama3-tokenizer --out "$OUT" \
      2>&1 | tee "$OUT/profile.log" | tail -80
fi
