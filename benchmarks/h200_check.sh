#!/usr/bin/env bash
# Checks and measurements on an NVIDIA GPU machine, in one call (logs and JSON under $OUT).
# Usage, from the repository root: bash benchmarks/h200_check.sh STEP...
#   tests      the GPU tests: every test that runs the cuda backend on the GPU
#   sanitize   compute-sanitizer memcheck and racecheck on benchmarks/sanitize_case.py
#   gluon      benchmarks/gluon/h200_check.py --quick (the Gluon recurrence experiment)
#   bench      recoverssm bench (every suite but the model suite and rounding)
#   model      recoverssm bench --only model
#   smoke      recoverssm bench --quick (every suite, a few cases each)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
. benchmarks/carry_wheels.sh
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
bench() { RECOVERSSM_COMMIT=$(cat .commit 2>/dev/null) python3 -m recoverssm bench "$@"; }
for step in "$@"; do
  start=$(date +%s)
  case $step in
    tests)
      timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_recurrence.py tests/test_kernel_commit.py \
        tests/test_kernel_conv.py tests/test_kernel_plan.py tests/test_kda.py tests/test_conv_decode.py tests/test_ops.py \
        tests/test_cuda_graphs.py tests/test_repeats.py tests/test_padding_outputs.py tests/test_deferred.py \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_case.py \
          > "$OUT/sanitizer_$tool.log" 2>&1
        echo "compute-sanitizer $tool exit=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize case ran' "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
      done ;;
    gluon)
      timeout 300 python3 benchmarks/gluon/h200_check.py --quick 2>&1 | tee "$OUT/gluon_check.log" | tail -30 ;;
    bench)
      bench --out "$OUT" --only commit,verify,kda,mamba2,graph,host,memory 2>&1 | tee "$OUT/bench.log" | tail -90 ;;
    model)
      bench --out "$OUT" --only model 2>&1 | tee "$OUT/bench_model.log" | tail -60 ;;
    smoke)
      bench --out "$OUT" --quick 2>&1 | tee "$OUT/bench_smoke.log" | tail -60 ;;
    *) echo "unknown step $step" ;;
  esac
  echo "== $step: $(( $(date +%s) - start )) s"
done
