#!/usr/bin/env bash
# Wave 10 on 2x H200 (nvidia-h200-x2): what issues 20 and 22 still need, in three calls of < 10 minutes.
# Qwen3-4B shape unless said; random weights, seq 512, LoRA r16 on 7 projections, shared dropout, every speed
# switch of the bench config; the non-finite skip decided on the GPU (wave 9). Predictions: NOTES.md, wave 10.
# The bench config now sets train.layers_per_graph = 6 (wave 10 on one H200: +1%): a pipeline stage's 4-5 layers
# are then one graph, which has not run in a GPU pipeline before (if pp fails, rerun it with
# --set train.layers_per_graph=1 and say so).
#   1: issue 22 at 32 sequences a step, where a pipeline's bubble halves: `ddp` (1 x 16 a rank), `pp` interleaved
#      v=4 with 8 microbatches of 4 and with 4 of 8.
#   2: issue 22 at 16 sequences beside the baselines: `ddp` 1 x 8, `pp` v=4 4 x 4, the seed script (20 steps) and
#      DDP + PEFT compiled per layer, all in this call.
#   3: issue 20: the tp shapes timed on both GPUs (plan_calibrate.py --only 'tp=2': each rank its share of the
#      layer, the all-reduces included) beside the 4B tp=2 run they predict; then the 72B NF4 `ddp` run (microbatches
#      of 4, 2 accumulated; wave 7's run of it recomputed 10 layers by a since-fixed bug) for its memory.
# Usage (device machine, repo root, .whl and .baselines carried): OUT=dir bash benchmarks/journal/scripts/run_wave10_h200.sh 1|2|3
# CPU dry run with the tiny model (1, 2): TINY=1 OUT=dir bash benchmarks/journal/scripts/run_wave10_h200.sh 1
CALL=${1:-1}
source benchmarks/h200_common.sh
W=/tmp/wave10-$CALL; rm -rf $W; mkdir -p $W
BUDGET=${BUDGET:-560}
if [ "${TINY:-0}" = 1 ]; then
  BENCH_ARGS=$TINY_ARGS; S="--steps 1 --warmup 1"
else
  BENCH_ARGS=""; S="--steps 6 --warmup 4"
fi
SHARED="--set lora.shared_dropout=true"
V4="--set parallel.schedule=\"interleaved_1f1b\" --set parallel.stages_per_rank=4"
[ "${TINY:-0}" = 1 ] && V4="--set parallel.schedule=\"interleaved_1f1b\" --set parallel.stages_per_rank=2"
B32="--set train.batch_size=32"
if [ "$CALL" = 1 ]; then
  bench 4b-ddp32 90 $B4 --strategies ddp $S $SHARED $B32
  bench 4b-pp32-v4-8x4 180 $B4 --strategies pp $S $SHARED $V4 $B32 --set parallel.n_microbatches=8
  bench 4b-pp32-v4-4x8 150 $B4 --strategies pp $S $SHARED $V4 $B32 --set parallel.n_microbatches=4
  collect wave10_$CALL
elif [ "$CALL" = 2 ]; then
  bench 4b-ddp16 90 $B4 --strategies ddp $S $SHARED
  bench 4b-pp16-v4 180 $B4 --strategies pp $S $SHARED $V4
  [ "${TINY:-0}" != 1 ] && baselines 20 100 90 1 2>&1 | tee $OUT/baselines.txt
  cp $W/seed.csv $OUT/seed-metrics.csv 2>/dev/null
  collect wave10_$CALL
elif [ "$CALL" = 3 ]; then
  echo "== tp shapes timed on 2 GPUs ($(date +%T))"
  OUT=$W/calib timeout 220 python3 benchmarks/tools/plan_calibrate.py --only "tp=2" --budget 170 2>&1 | grep -v -i warn | tail -20
  tar czf $OUT/calibrate-tp.tar.gz -C $W calib
  TP16="--set parallel.pp=1 --set parallel.strategy=\"tp\" --set parallel.tp=2 --set parallel.n_microbatches=1 \
    --set train.cuda_graphs=false --set lora.shared_dropout=false"
  bench 4b-tp 110 $B4 --strategies tp --steps 8 --warmup 4 $TP16
  NF4_DDP="--set parallel.pp=1 --set parallel.dp=2 --set parallel.n_microbatches=1 --set train.batch_size=4 \
    --set train.grad_accum=2 $(quant nf4)"
  bench 72b-ddp-nf4 $(( $(left) - 15 )) $B72 --strategies ddp --steps 3 --warmup 2 $NF4_DDP
  collect wave10_$CALL
fi
echo "call $CALL done in $(( $(date +%s) - START )) s"
