#!/usr/bin/env bash
# ncu of verify launches (ours with a recurrence spec, or FLA's) and grouped commit launches (with a
# commit spec): summary sections, per-SASS-instruction execution counts and stall samples. Each case
# profiles the second of two launches (ncu_verify.py, ncu_commit.py).
# Usage (GPU machine with ncu, repository root):
#   bash benchmarks/ncu_run.sh "ours" "ours lanes_k=16 rows=4" "gluon rs8x8" "fla" "commit bf16" "commit fp32 block_v=64 warps=2" "commit kda"
#   -> $OUT/ncu_<case>.txt (report), .log (the script's output), _sass.csv (source page); OUT defaults to /tmp/out
set -u
OUT=${OUT:-/tmp/out}
export OUT
mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-}
. benchmarks/carry_wheels.sh
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats --section SourceCounters"
for case in "$@"; do
  name=$(echo "$case" | tr ' =' '_-')
  case $case in
    commit*) script=benchmarks/ncu_commit.py; kernels="grouped_commit_kernel"; args=${case#commit } ;;
    *) script=benchmarks/ncu_verify.py; kernels="recurrence_kernel|gdn_recurrent_gluon|fused_recurrent"; args=$case ;;
  esac
  # shellcheck disable=SC2086  # $args: the case's words, one argument each
  ncu --clock-control none $SECTIONS --kernel-name regex:"$kernels" --launch-skip 1 --launch-count 1 \
    -o "$OUT/ncu_$name" -f python3 $script $args > "$OUT/ncu_$name.log" 2>&1
  ncu -i "$OUT/ncu_$name.ncu-rep" > "$OUT/ncu_$name.txt" 2>&1
  ncu -i "$OUT/ncu_$name.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${name}_sass.csv" 2>&1
  rm -f "$OUT/ncu_$name.ncu-rep"
  echo "== $case"; grep -E "Duration|Registers Per|Achieved Occupancy|One or More Eligible|Executed Instructions  " "$OUT/ncu_$name.txt" | head -8
done
