#!/usr/bin/env bash
# Models larger than one GPU and the layouts beside each other, on 2x H200, in two device calls of < 10 minutes.
# Random weights, seq 512, effective batch 16, LoRA r16 on 7 projections, every speed switch of the bench configs
# (compile; CUDA graphs where the rule keeps them; fused loss; the 72B shape with checkpointing "auto").
#   1 (the 72B shape): tp=2; pp interleaved v=2 with 16 microbatches of 1; pp 1F1B 8 x 2 with an FP8 base;
#     pp 1F1B with 16 microbatches of 1. (tp and the 16-microbatch runs kept CUDA graphs and spent their limits
#     recording them: ~384 s a rank, as their own note said.)
#   2: Qwen3-4B: `pipetune plan --calibrate`, and one decoder layer under each speed lever
#     (benchmarks/tools/layer_levers.py); the 72B shape tp=2 and pp interleaved v=2 16 x 1 again, without CUDA graphs.
#     (calibrate and the graphs levers failed: their layer's gradients lived in the graphs' pool; the tp run
#     failed in its fused optimizer step: a group mixing DTensor and plain adapters. Both fixed since.)
#   3: the 72B shape tp=2 without graphs again; Qwen3-4B ddp, tp=2 with one microbatch of 16 compiled without
#     graphs, pp interleaved v=3; then `pipetune plan --calibrate` with what is left. (The 4B runs' limits were too
#     short for a fresh machine's cold compile cache, and the tp run's one microbatch was set on the pp=2 config.)
#   4 (Qwen3-4B, not yet run): ddp (its 6th step profiled: PIPETUNE_PROFILE_STEP), tp=2 with one microbatch of
#     16, pp interleaved v=3, with limits for a cold compile cache (or a carried one: h200_common.sh).
#   5 (not yet run): the 72B shape tp=2 without graphs, its 4th step profiled, to see why its step is 1.7x the
#     plan's; Qwen3-4B tp=2 4 x 4 with graphs, given the time its recording takes.
# Each run is `pipetune bench` with its own --timeout; a run that would not fit the call's budget is skipped and
# said so. Usage (device machine, repo root, .whl carried): OUT=dir bash benchmarks/journal/scripts/run_wave3_h200.sh 1|2|3|4|5
# CPU dry run with the tiny model (no GPU; fp8 left out): TINY=1 OUT=dir bash benchmarks/journal/scripts/run_wave3_h200.sh 1|2|3|4|5
CALL=${1:-1}
source benchmarks/h200_common.sh
W=/tmp/wave3-$CALL; rm -rf $W; mkdir -p $W
BUDGET=${BUDGET:-575}
if [ "${TINY:-0}" = 1 ]; then
  BENCH_ARGS=$TINY_ARGS
  S4="--steps 1 --warmup 1"; S72=$S4; FP8=""; MODEL4="--set model.name=\"tiny-qwen3\""
else
  BENCH_ARGS=""; S4="--steps 8 --warmup 4"; S72="--steps 4 --warmup 2"; FP8=fp8; MODEL4=""
fi
M16="--set parallel.n_microbatches=16"
V2="--set parallel.schedule=\"interleaved_1f1b\" --set parallel.stages_per_rank=2"
if [ "$CALL" = 1 ]; then
  bench 72b-tp 150 $B72 --strategies tp $S72
  bench 72b-pp-v2-16 150 $B72 --strategies pp $S72 $V2 $M16
  [ -n "$FP8" ] && bench 72b-pp-fp8 140 $B72 --strategies pp $S72 --set model.quantize=\"fp8\"
  bench 72b-pp-16 120 $B72 --strategies pp $S72 $M16
elif [ "$CALL" = 2 ]; then
  echo "== plan --calibrate ($(date +%T))"
  timeout 110 python3 -m pipetune plan --config $B4 --gpus 2 --calibrate $MODEL4 2>&1 | grep -v -i warn | \
    tee $OUT/plan-4b-calibrated.txt | tail -8
  echo "== layer levers ($(date +%T))"
  timeout 130 python3 benchmarks/tools/layer_levers.py --config $B4 --microbatch 8 $MODEL4 --out $OUT/layer-levers.json \
    2>&1 | grep -v -i warn | tee $OUT/layer-levers.txt | grep -E "^lever|^  "
  NOGRAPHS="--set train.cuda_graphs=false"
  bench 72b-tp 150 $B72 --strategies tp $S72 $NOGRAPHS
  bench 72b-pp-v2-16 150 $B72 --strategies pp $S72 $V2 $M16 $NOGRAPHS
elif [ "$CALL" = 3 ]; then
  bench 72b-tp 165 $B72 --strategies tp $S72 --set train.cuda_graphs=false
  bench 4b-ddp 90 $B4 --strategies ddp $S4
  bench 4b-tp-mb16 120 $B4 --strategies tp $S4 --set parallel.n_microbatches=1 --set train.cuda_graphs=false
  V3="--set parallel.schedule=\"interleaved_1f1b\" --set parallel.stages_per_rank=3"
  bench 4b-pp-v3 190 $B4 --strategies pp $S4 $V3
  if [ "$(left)" -gt 40 ]; then
    echo "== plan --calibrate ($(date +%T), limit $(( $(left) - 10 )) s)"
    timeout $(( $(left) - 10 )) python3 -m pipetune plan --config $B4 --gpus 2 --calibrate $MODEL4 2>&1 | \
      grep -v -i warn | tee $OUT/plan-4b-calibrated.txt | tail -8
  fi
elif [ "$CALL" = 4 ]; then
  PIPETUNE_PROFILE_STEP=6 bench 4b-ddp 150 $B4 --strategies ddp $S4
  TP16="--set parallel.pp=1 --set parallel.strategy=\"tp\" --set parallel.tp=2 --set parallel.n_microbatches=1"
  bench 4b-tp-mb16 150 $B4 --strategies tp $S4 $TP16 --set train.cuda_graphs=false
  V3="--set parallel.schedule=\"interleaved_1f1b\" --set parallel.stages_per_rank=3"
  bench 4b-pp-v3 260 $B4 --strategies pp $S4 $V3
elif [ "$CALL" = 5 ]; then
  PIPETUNE_PROFILE_STEP=4 bench 72b-tp 180 $B72 --strategies tp $S72 --set train.cuda_graphs=false
  grep -A22 "rank 0 profile of step 4 by self_device" $W/72b-tp/tp.log | head -24
  bench 4b-tp 300 $B4 --strategies tp $S4
fi
collect wave3_$CALL
echo "call $CALL done in $(( $(date +%s) - START )) s"
