#!/usr/bin/env bash
# Wave 8 on 2x H200 (Qwen3-4B shape unless said; random weights, seq 512, effective batch 16, LoRA r16 on 7
# projections, every speed switch of the bench configs):
#   1: `pp` interleaved v=3 4 x 4 with CUDA graphs and PEFT's dropout (no pipeline with graphs has run on a GPU
#      since the LoRA fast path became one forward) beside `ddp` 1 x 8 with shared dropout; then the plan
#      calibrated on these GPUs (benchmarks/plan_calibrate.py: every measured run's layer shape timed, the
#      accuracy targets' first) for the rest of the call.
# Usage (device machine, repo root, .whl and .baselines carried): OUT=dir bash benchmarks/run_wave8_h200.sh 1
# CPU dry run with the tiny model: TINY=1 OUT=dir bash benchmarks/run_wave8_h200.sh 1
CALL=${1:-1}
source benchmarks/h200_common.sh
W=/tmp/wave8-$CALL; rm -rf $W; mkdir -p $W
BUDGET=${BUDGET:-560}
if [ "${TINY:-0}" = 1 ]; then
  BENCH_ARGS=$TINY_ARGS; S="--steps 1 --warmup 1"; V=2
else
  BENCH_ARGS=""; S="--steps 6 --warmup 4"; V=3
fi
SHARED="--set lora.shared_dropout=true"
V3="--set parallel.schedule=\"interleaved_1f1b\" --set parallel.stages_per_rank=$V"
if [ "$CALL" = 1 ]; then
  bench 4b-pp-v3 200 $B4 --strategies pp $S $V3
  bench 4b-ddp-shared 80 $B4 --strategies ddp $S $SHARED
  collect wave8_$CALL
  if [ "${TINY:-0}" != 1 ] && [ "$(left)" -gt 60 ]; then
    echo "== plan calibration ($(date +%T), $(left) s left)"
    OUT=$W/calib python3 benchmarks/plan_calibrate.py --budget $(( $(left) - 45 )) 2>&1 | grep -v -i warn | tail -40
    tar czf $OUT/calibrate.tar.gz -C $W calib
  fi
fi
echo "call $CALL done in $(( $(date +%s) - START )) s"
