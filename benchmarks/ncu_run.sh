#!/usr/bin/env bash
# ncu of the verify kernels and the grouped commit (device tool): summary sections and
# per-SASS-instruction execution counts and stall samples.
# Usage: bash benchmarks/ncu_run.sh "ours 32 8" "fla" "commit bf16" "commit fp32 32 1" ...  -> $OUT/ncu_*.txt
export PYTHONPATH=.:${PYTHONPATH:-}
. benchmarks/carry_wheels.sh
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats --section SourceCounters"
for case in "$@"; do
  name=$(echo $case | tr ' ' '_')
  case $case in
    commit*) script=benchmarks/ncu_commit.py; kernels="grouped_commit"; args=${case#commit } ;;
    *) script=benchmarks/ncu_verify.py; kernels="gdn_recurrent|fused_recurrent"; args=$case ;;
  esac
  ncu --clock-control none $SECTIONS --kernel-name regex:"$kernels" --launch-skip 1 --launch-count 1 \
    -o $OUT/ncu_$name -f python3 $script $args > $OUT/ncu_$name.log 2>&1
  ncu -i $OUT/ncu_$name.ncu-rep > $OUT/ncu_$name.txt 2>&1
  ncu -i $OUT/ncu_$name.ncu-rep --page source --csv --print-source sass > $OUT/ncu_${name}_sass.csv 2>&1
  rm -f $OUT/ncu_$name.ncu-rep
  echo "== $case"; grep -E "Duration|Registers Per|Achieved Occupancy|One or More Eligible|Executed Instructions  " $OUT/ncu_$name.txt | head -8
done
