#!/usr/bin/env bash
# One call on the lent GPU machine: install what its image lacks, run the GPU tests and the named
# benchmarks. Everything lands in $OUT.
#   run(command="bash benchmarks/gpu_session.sh attention norms", carry=[".whl"])
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# GPU_TESTS: which test files (default: all); "none" runs no tests
if [ "${GPU_TESTS:-tests}" != none ]; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -30
fi
for bench in "$@"; do
  timeout ${BENCH_TIMEOUT:-420} python3 "benchmarks/$bench.py" --out "$OUT" 2>&1 | tee "$OUT/$bench.log" | tail -40
done
