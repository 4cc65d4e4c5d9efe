export PYTHONPATH=.
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats --section SourceCounters --section MemoryWorkloadAnalysis"
for case in "fp32" "bf16" "bf16 64 4 128" "bf16 32 2"; do
  name=commit_$(echo $case | tr ' ' '_')
  ncu --clock-control none $SECTIONS --kernel-name regex:"grouped_commit" --launch-skip 1 --launch-count 1 \
    -o $OUT/ncu_$name -f python3 benchmarks/ncu_commit.py $case > $OUT/ncu_$name.log 2>&1
  ncu -i $OUT/ncu_$name.ncu-rep > $OUT/ncu_$name.txt 2>&1
  ncu -i $OUT/ncu_$name.ncu-rep --page source --csv --print-source sass > $OUT/ncu_${name}_sass.csv 2>&1
  rm -f $OUT/ncu_$name.ncu-rep
  echo "== $case"; grep -E "Duration|Registers Per|Achieved Occupancy|One or More Eligible|Executed Instructions  |Memory Throughput|DRAM Throughput" $OUT/ncu_$name.txt | head -9
done
