#!/usr/bin/env bash
# Wave 10 on ONE H200 (the 2-GPU kinds were not lent; run_wave10_h200.sh waits for them). Qwen3-4B shape, random
# weights, seq 512, LoRA r16 on 7 projections, shared dropout, every speed switch of the bench config; `single`
# 1 x 8 is one GPU's share of `ddp` 1 x 8 on two (issue 22).
#   1: train.layers_per_graph: 1 (one compiled graph and CUDA graph per layer, as before), 4 and 12 consecutive
#      layers per graph, then 1 again.
#   2: rows of 5 steps (the host free to run ahead between rows) with 1 and 4 layers per graph, three runs each,
#      then a row every step with 1.
#   3: rows of 5 with 6 and 12 layers per graph against 4 and 1.
# Usage (device machine, repo root, .whl and .carry carried): BUDGET=540 OUT=dir bash benchmarks/journal/scripts/run_wave10_one_h200.sh 1
# CPU dry run with the tiny model: TINY=1 OUT=dir bash benchmarks/journal/scripts/run_wave10_one_h200.sh 1
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
  # Call 1: with a row every step (each waits for the GPU) 4 and 12 layers per graph ran as 1 did. Rows of 5
  # (the host free to run ahead between rows) with 1 and 4 layers per graph, A B A B A B, 40 timed steps; then a
  # row every step with 1 as the control. metrics.csv's host_wait_frac: the share of the time the host waited.
  R5="--rows 5 --steps 40 --warmup 5"; [ "${TINY:-0}" = 1 ] && R5="--rows 5 --steps 5 --warmup 5"
  for round in a b c; do
    bench k1-rows5-$round 90 $B4 --strategies single $R5 $ONE8 $(k 1)
    bench k4-rows5-$round 120 $B4 --strategies single $R5 $ONE8 $(k 4)
  done
  bench k1-rows1 80 $B4 --strategies single $L $ONE8 $(k 1)
  collect wave10_one_$CALL
elif [ "$CALL" = 3 ]; then
  # Call 2: rows of 5 with 4 layers per graph +1.1% over 1 in all three pairs, the host waiting ~10% of the time
  # in both (not host-bound): the gain is at the graphs' boundaries. 6 and 12 layers per graph against 4 and 1.
  R5="--rows 5 --steps 40 --warmup 5"; [ "${TINY:-0}" = 1 ] && R5="--rows 5 --steps 5 --warmup 5"
  bench k1-rows5 90 $B4 --strategies single $R5 $ONE8 $(k 1)
  bench k6-rows5-a 150 $B4 --strategies single $R5 $ONE8 $(k 6)
  bench k12-rows5-a 170 $B4 --strategies single $R5 $ONE8 $(k 12)
  bench k4-rows5 90 $B4 --strategies single $R5 $ONE8 $(k 4)
  bench k12-rows5-b 90 $B4 --strategies single $R5 $ONE8 $(k 12)
  bench k6-rows5-b 90 $B4 --strategies single $R5 $ONE8 $(k 6)
  collect wave10_one_$CALL
fi
echo "call $CALL done in $(( $(date +%s) - START )) s"
