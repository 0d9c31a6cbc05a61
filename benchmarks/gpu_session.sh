#!/usr/bin/env bash
# One call on the lent GPU machine: install what its image lacks, run the GPU tests, then each step
# named: "info" (kernel-pytorch info), "cpu-suite" (the CPU tests on this torch, GPU hidden), "demos",
# or a benchmark script's name ("attention", "kernels", "tune_row_kernels"), with its arguments after it in the same
# word, shell-quoted ("decode --quick --providers 'static loop (reduce-overhead)' optimize"). Everything lands in $OUT.
#   run(command="GPU_TESTS=none bash benchmarks/gpu_session.sh info attention", carry=[".whl"])
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# GPU_TESTS: which test files (default: all); "none" runs no tests. GPU_TESTS_TIMEOUT: their seconds (default 300).
# GPU_TEST_WORKERS: pytest-xdist processes sharing the GPU (default 1; its wheel in .whl: device-wheels.sh pytest-xdist
# execnet), for tests that check numerics only: most of a cold run is Triton and Inductor compiling, one core each.
if [ "${GPU_TESTS:-tests}" != none ]; then
  workers=()
  if [ "${GPU_TEST_WORKERS:-1}" -gt 1 ]; then workers=(-n "$GPU_TEST_WORKERS" --dist loadgroup); fi
  timeout "${GPU_TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider "${workers[@]}" ${GPU_TESTS:-tests} 2>&1 \
    | tee "$OUT/pytest_gpu.txt" | tail -30
fi
for step in "$@"; do
  case "$step" in
    info) python3 -m kernel_pytorch.cli info | tee "$OUT/info.txt"; python3 -m kernel_pytorch.cli info --json >"$OUT/info.json" ;;
    cpu-suite) CUDA_VISIBLE_DEVICES="" python3 -m pytest -q tests 2>&1 | tee "$OUT/pytest_cpu.txt" | tail -15 ;;
    demos) python3 demos/run_all_demos.py 2>&1 | tee "$OUT/demos.txt" | tail -25 ;;
    *) name=${step%% *}; arguments=${step#"$name"}
       eval "timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/$name.py $arguments --out \"\$OUT\"" 2>&1 \
         | tee "$OUT/$name.log" | tail -40 ;;
  esac
done
