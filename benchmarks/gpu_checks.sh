#!/usr/bin/env bash
# One call on the lent GPU machine: install what its image lacks, record `kernel-pytorch info`, run the
# GPU tests, the whole CPU suite on its torch, and the demos. Everything lands in $OUT.
#   run(command="bash benchmarks/gpu_checks.sh", carry=[".whl"])
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || echo "console script not installed (see install.log); using python -m kernel_pytorch.cli"
info() { if command -v kernel-pytorch >/dev/null; then kernel-pytorch "$@"; else python3 -m kernel_pytorch.cli "$@"; fi; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia_smi.txt"
info info | tee "$OUT/info.txt"
info info --json >"$OUT/info.json"
python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
# The CPU suite, on this machine's torch, with the GPU hidden (its tests describe a CPU-only machine).
CUDA_VISIBLE_DEVICES="" python3 -m pytest -q tests 2>&1 | tee "$OUT/pytest_all.txt" | tail -15
python3 demos/run_all_demos.py 2>&1 | tee "$OUT/demos.txt" | tail -25
