#!/usr/bin/env bash
# Wave 8 on 2x H200 (Qwen3-4B shape unless said; random weights, seq 512, effective batch 16, LoRA r16 on 7
# projections, every speed switch of the bench configs):
#   1: `pp` interleaved v=3 4 x 4 with CUDA graphs and PEFT's dropout (no pipeline with graphs has run on a GPU
#      since the LoRA fast path became one forward) beside `ddp` 1 x 8 with shared dropout; then the plan
#      calibrated on these GPUs (benchmarks/tools/plan_calibrate.py: every measured run's layer shape timed, the
#      accuracy targets' first) for the rest of the call.
#   2: why `pp` with CUDA graphs fails in its recording step (call 1: "[5] for chunk 0 has gradients None" at the
#      last stage's first backward send): the tiny model in bf16, compiled with graphs, interleaved v=2 4 x 4, as
#      it is and with one switch changed at a time.
#   3: call 2's tiny runs passed, with no validation; every pipeline run that failed (wave 7 and call 1) had the
#      validation before step 1 on its training stages, every one that passed at 32B and 72B had none. Validation
#      now runs on pipeline stages of its own: `pp` v=3 4 x 4 with graphs and validation (if it fails again: the
#      same without validation), then with shared dropout and graphs, beside `ddp` 1 x 8 with shared dropout.
#   4: issue 22's figures in one call, after the loss stopped waiting for the GPU (supervised positions found on
#      the host): `ddp` 1 x 8 and `pp` v=3 4 x 4, both with shared dropout and graphs, beside the seed script and
#      DDP + PEFT compiled per layer; then `pp` v=4 4 x 4 (the plan's best pipeline) if the budget holds it.
#   5: the loss's labels on the host, on the GPUs' other paths: the tiny model in bf16 under tp=2 (vocabulary-
#      parallel fused loss) and as a pipeline with the plain loss.
# Usage (device machine, repo root, .whl and .baselines carried): OUT=dir bash benchmarks/journal/scripts/run_wave8_h200.sh 1
# CPU dry run with the tiny model: TINY=1 OUT=dir bash benchmarks/journal/scripts/run_wave8_h200.sh 1
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
    OUT=$W/calib python3 benchmarks/tools/plan_calibrate.py --budget $(( $(left) - 45 )) 2>&1 | grep -v -i warn | tail -40
    tar czf $OUT/calibrate.tar.gz -C $W calib
  fi
elif [ "$CALL" = 2 ]; then
  T="--set model.name=\"tiny-qwen3\" --set data.synthetic_train=64 --set data.synthetic_validation=0"
  T="$T --steps 2 --warmup 2 --set parallel.schedule=\"interleaved_1f1b\" --set parallel.stages_per_rank=2"
  bench tiny-pp-graphs 90 $B4 --strategies pp $T
  bench tiny-pp-graphs-peft 90 $B4 --strategies pp $T --set lora.fast_path=false
  bench tiny-pp-graphs-plainloss 90 $B4 --strategies pp $T --set train.fused_loss=false
  bench tiny-pp-graphs-nodropout 90 $B4 --strategies pp $T --set lora.dropout=0.0
  bench tiny-pp-nographs 90 $B4 --strategies pp $T --set train.cuda_graphs=false
  for f in $W/*/pp.log; do echo "== $f"; grep -E "^[A-Za-z.]*Error|failed in" $f | head -3; done
  collect wave8_$CALL
elif [ "$CALL" = 3 ]; then
  bench 4b-pp-v3 200 $B4 --strategies pp $S $V3
  if ! grep -q '"tokens_per_sec"' $W/4b-pp-v3/bench.json 2>/dev/null; then
    grep -E "^[A-Za-z.]*Error|failed in" $W/4b-pp-v3/pp.log | head -3
    bench 4b-pp-v3-noval 150 $B4 --strategies pp $S $V3 --set data.synthetic_validation=0
  fi
  bench 4b-pp-v3-shared 120 $B4 --strategies pp $S $V3 $SHARED
  bench 4b-ddp-shared 80 $B4 --strategies ddp $S $SHARED
  collect wave8_$CALL
elif [ "$CALL" = 4 ]; then
  bench 4b-ddp-shared 80 $B4 --strategies ddp $S $SHARED
  bench 4b-pp-v3-shared 120 $B4 --strategies pp $S $V3 $SHARED
  [ "${TINY:-0}" != 1 ] && baselines 20 100 90 1
  [ "${TINY:-0}" != 1 ] && bench 4b-pp-v4-shared 110 $B4 --strategies pp $S $SHARED --set parallel.schedule=\"interleaved_1f1b\" \
    --set parallel.stages_per_rank=$((V + 1))
  collect wave8_$CALL
elif [ "$CALL" = 5 ]; then
  T="--set model.name=\"tiny-qwen3\" --set data.synthetic_train=64 --steps 2 --warmup 1"
  bench tiny-tp 60 $B4 --strategies tp $T --set parallel.pp=1 --set parallel.tp=2 --set parallel.n_microbatches=1
  bench tiny-pp-plainloss 60 $B4 --strategies pp $T --set train.fused_loss=false
  collect wave8_$CALL
fi
echo "call $CALL done in $(( $(date +%s) - START )) s"
