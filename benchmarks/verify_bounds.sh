#!/usr/bin/env bash
# verify_bounds.py's timings, then ncu of the library's recurrence kernel and of its no-load variant.
# Usage (GPU machine, repository root): bash benchmarks/verify_bounds.sh
#   -> $OUT/verify_bounds.json, $OUT/verify_bounds.log, $OUT/ncu_bounds_{library,no_load}.txt (OUT defaults to /tmp/out)
export PYTHONPATH=.:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}
export OUT
mkdir -p "$OUT"
python3 benchmarks/verify_bounds.py --repeat 2 2>&1 | tee "$OUT/verify_bounds.log"
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats"
for variant in library no_load; do
  ncu --clock-control none $SECTIONS --kernel-name regex:recurrence_kernel --launch-skip 1 --launch-count 1 \
    python3 benchmarks/verify_bounds.py --ncu $variant > "$OUT/ncu_bounds_$variant.txt" 2>&1
  echo "== $variant"; grep -E "Duration|Registers Per|Achieved Occupancy|One or More Eligible|Issued Warp|Executed Instructions  " "$OUT/ncu_bounds_$variant.txt" | head -8
done
rm -f "$OUT"/recoverssm_recurrence_*.py
