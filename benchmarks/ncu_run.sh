#!/usr/bin/env bash
# ncu comparison of verify kernels (device tool): summary sections and per-SASS-instruction
# execution counts. Usage: bash benchmarks/ncu_run.sh "ours 32 8" "fla" ...  -> $OUT/ncu_*.txt
export PYTHONPATH=.:${PYTHONPATH:-}
. benchmarks/carry_wheels.sh
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats --section SourceCounters"
for case in "$@"; do
  name=$(echo $case | tr ' ' '_')
  ncu --clock-control none $SECTIONS --kernel-name regex:"gdn_recurrent|fused_recurrent" --launch-skip 1 --launch-count 1 \
    -o $OUT/ncu_$name -f python3 benchmarks/ncu_verify.py $case > $OUT/ncu_$name.log 2>&1
  ncu -i $OUT/ncu_$name.ncu-rep > $OUT/ncu_$name.txt 2>&1
  ncu -i $OUT/ncu_$name.ncu-rep --page source --csv --print-source sass > $OUT/ncu_${name}_sass.csv 2>&1
  rm -f $OUT/ncu_$name.ncu-rep
  echo "== $case"; grep -E "Duration|Registers Per|Achieved Occupancy|One or More Eligible|Executed Instructions  " $OUT/ncu_$name.txt | head -8
done
