#!/usr/bin/env bash
# The whole H200 session in one call: GPU tests, compute-sanitizer, benchmark.
# Usage (device tool, repo root): bash benchmarks/h200_check.sh [tests|sanitize|bench|all]...
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
. benchmarks/carry_wheels.sh
what=${*:-all}
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
git rev-parse --short HEAD 2>/dev/null || true
for step in $what; do
  case $step in
    tests|all)
      python3 -m pytest tests/test_triton_kernels.py -q -p no:cacheprovider -m "gpu" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;&
    sanitize|all)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_case.py > "$OUT/sanitizer_$tool.log" 2>&1
        echo "compute-sanitizer $tool exit=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)"
      done ;;&
    bench|all)
      RECOVERSSM_COMMIT=$(cat .commit 2>/dev/null) python3 -c "import sys; from recoverssm.bench import main; sys.exit(main(sys.argv[1:]))" --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -70 ;;
  esac
done
