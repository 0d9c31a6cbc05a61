#!/usr/bin/env bash
# Issue 27's generation warm-up, one fresh process per variant (each with empty Inductor and Triton caches), on the
# lent GPU machine: benchmarks/profile_warm_up.py with each variant's optimize(model, ...) options (JSON; a
# "generation" key holds the generation options), its compiles and first generate calls printed as they happen and
# its text under $OUT/<i>/.
#   bash benchmarks/warm_up_ab.sh '{}' '{"compile": false}' '{"generation": {"compile_prefill": false}}'
# PROFILE_ARGS: more of profile_warm_up.py's options for every variant, e.g. "--guards" (each guard pinning a size,
# with the stack that added it).
set -uo pipefail
OUT=${OUT:-/tmp/out}
index=0
for options in "$@"; do
  index=$((index + 1))
  caches=$(mktemp -d)
  echo "== variant $index: optimize options $options"
  TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton timeout "${VARIANT_TIMEOUT:-280}" \
    python3 benchmarks/profile_warm_up.py --optimize "$options" --no-host-profile \
    --first-generate ${FIRST_GENERATE:-1 8} ${PROFILE_ARGS:-} --out "$OUT/$index" 2>&1 | grep --line-buffered -v "Warning\|warn" \
    | grep "==\|graph \|generate at\|^    " --line-buffered | cut -c1-700
done
