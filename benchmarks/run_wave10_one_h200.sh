#!/usr/bin/env bash
# Wave 10 on ONE H200 (the 2-GPU kinds were not lent; run_wave10_h200.sh waits for them). Qwen3-4B shape, random
# weights, seq 512, LoRA r16 on 7 projections, shared dropout, every speed switch of the bench config; `single`
# 1 x 8 is one GPU's share of `ddp` 1 x 8 on two (issue 22).
#   1: train.layers_per_graph: 1 (one compiled graph and CUDA graph per layer, as before), 4 and 12 consecutive
#      layers per graph, then 1 again.
#   2: the best group size against 1, three runs each in A B A B A B order, 40 timed steps; then each traced at
#      step 30 (the GPU's idle gaps).
# Usage (device machine, repo root, .whl and .carry carried): BUDGET=540 OUT=dir bash benchmarks/run_wave10_one_h200.sh 1
# CPU dry run with the tiny model: TINY=1 OUT=dir bash benchmarks/run_wave10_one_h200.sh 1
CALL=${1:-1}
source benchmarks/h200_common.sh
W=/tmp/wave10-$CALL; rm -rf $W; mkdir -p $W
BUDGET=${BUDGET:-540}
if [ "${TINY:-0}" = 1 ]; then
  BENCH_ARGS="$TINY_ARGS --set train.compile=true"; S="--steps 5 --warmup 5"; L="$S"
else
  BENCH_ARGS=""; S="--steps 20 --warmup 5"; L="--steps 40 --warmup 5"
fi
ONE8="--set parallel.pp=1 --set parallel.n_microbatches=1 --set train.batch_size=8 --set lora.shared_dropout=true"
k() { echo "--set train.layers_per_graph=$1"; }
if [ "$CALL" = 1 ]; then
  bench k1-a 120 $B4 --strategies single $S $ONE8 $(k 1)
  bench k4 150 $B4 --strategies single $S $ONE8 $(k 4)
  bench k12 150 $B4 --strategies single $S $ONE8 $(k 12)
  bench k1-b 90 $B4 --strategies single $S $ONE8 $(k 1)
  collect wave10_one_$CALL
elif [ "$CALL" = 2 ]; then
  BEST=${BEST:-12}
  for round in 1 2 3; do
    bench k1-r$round 80 $B4 --strategies single $L $ONE8 $(k 1)
    bench k$BEST-r$round 80 $B4 --strategies single $L $ONE8 $(k $BEST)
  done
  for v in 1 $BEST; do
    PIPETUNE_PROFILE_STEP=30 PIPETUNE_PROFILE_TRACE=$W/trace-$v bench k$v-traced 80 $B4 --strategies single $L $ONE8 $(k $v)
    { python3 benchmarks/trace_gaps.py $W/trace-$v/trace-rank0.json.gz 2>&1 | head -24
      grep -A16 "by self_device" $W/k$v-traced/single.log | head -18; } > $OUT/diag-k$v.txt
    rm -rf $W/trace-$v
  done
  collect wave10_one_$CALL
fi
echo "call $CALL done in $(( $(date +%s) - START )) s"
