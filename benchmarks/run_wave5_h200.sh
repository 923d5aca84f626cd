#!/usr/bin/env bash
# What wave 4 left unmeasured, on 2x H200, in three device calls of < 10 minutes each (not yet run). Random
# weights, seq 512, effective batch 16, LoRA r16 on 7 projections, every speed switch of the bench configs.
#   1 (Qwen3-4B): tp=2 with one microbatch of 16, compiled without graphs, with the fused (vocabulary-parallel)
#     loss and with the plain one (logits gathered); 100 optimizer steps of ddp eager with a bf16 and an FP8 base
#     (wave 4's limits cut them at 81 and 64 steps).
#   2: the same 100 steps with an NF4 base, and all three curves in one PNG with their largest relative gap;
#     Qwen3-32B pp 1F1B 4 x 4 in bf16 and with an FP8 base (CUDA graphs kept: ~77 s of recording a rank), where
#     8 x 2 without graphs left FP8's layers host-bound (0.85x).
#   3: the 72B shape: pp 1F1B 8 x 2 with an NF4 base (dequantization compiled); tp=2 8 x 2 with its 4th step
#     profiled (the plan models its layer calls as host-bound); Qwen3-4B at 16,384 tokens: the plan's pick
#     (ddp 1 x 2 accumulation steps, no checkpointing) beside pp 1F1B 4 x 1 with checkpointing "auto".
# Each run is `pipetune bench` with its own --timeout; a run that would not fit the call's budget is skipped and
# said so. Usage (device machine, repo root, .whl carried): OUT=dir bash benchmarks/run_wave5_h200.sh 1|2|3
# CPU dry run with the tiny model (no GPU; fp8 left out): TINY=1 OUT=dir bash benchmarks/run_wave5_h200.sh 1|2|3
CALL=${1:-1}
source benchmarks/h200_common.sh
W=/tmp/wave5-$CALL; rm -rf $W; mkdir -p $W
BUDGET=${BUDGET:-540}
if [ "${TINY:-0}" = 1 ]; then
  BENCH_ARGS=$TINY_ARGS; S="--steps 1 --warmup 1"; CURVE="--steps 2 --warmup 1"; FP8=""; M32=""; LONGLEN=512; LONGSUM=128
else
  BENCH_ARGS=""; S="--steps 4 --warmup 2"; CURVE="--steps 96 --warmup 4"; FP8=fp8; LONGLEN=16384; LONGSUM=1024
  M32="--set model.name=\"qwen3-32b\" --set data.synthetic_validation=0"
fi
EAGER="--set train.compile=false --set train.cuda_graphs=false --set data.synthetic_validation=0"
curve() {  # method, limit s: 100 steps of ddp eager on the 4B shape
  bench 4b-curve-$1 $2 $B4 --strategies ddp $CURVE $EAGER $(quant $1)
}
if [ "$CALL" = 1 ]; then
  TP16="--set parallel.pp=1 --set parallel.strategy=\"tp\" --set parallel.tp=2 --set parallel.n_microbatches=1 \
    --set train.cuda_graphs=false"
  bench 4b-tp-fused-loss 130 $B4 --strategies tp --steps 8 --warmup 4 $TP16 --set train.fused_loss=true
  bench 4b-tp-plain-loss 100 $B4 --strategies tp --steps 8 --warmup 4 $TP16 --set train.fused_loss=false
  curve none 140
  [ -n "$FP8" ] && curve fp8 150
  for f in $W/4b-curve-*/ddp/metrics.csv; do cp $f $OUT/curve-$(basename $(dirname $(dirname $f)))-metrics.csv; done
elif [ "$CALL" = 2 ]; then
  curve nf4 150
  cp $W/4b-curve-nf4/ddp/metrics.csv $OUT/curve-4b-curve-nf4-metrics.csv 2>/dev/null
  # The other two curves come from call 1's $OUT (carry them as .carry/curve-*.csv).
  curves=""; for q in none $FP8 nf4; do
    f=$OUT/curve-4b-curve-$q-metrics.csv; [ -f $f ] || f=.carry/curve-4b-curve-$q-metrics.csv
    [ -f $f ] && curves="$curves $q=$f"; done
  python3 benchmarks/plot_loss_curves.py $OUT/loss_curves_4b.png $curves 2>&1 | tee $OUT/loss_curves_4b.txt
  P44="--set parallel.n_microbatches=4"
  bench 32b-pp-4x4 190 $B4 --strategies pp $S $M32 $P44
  [ -n "$FP8" ] && bench 32b-pp-4x4-fp8 190 $B4 --strategies pp $S $M32 $P44 $(quant fp8)
elif [ "$CALL" = 3 ]; then
  bench 72b-pp-nf4 170 $B72 --strategies pp $S $(quant nf4)
  PIPETUNE_PROFILE_STEP=4 bench 72b-tp 180 $B72 --strategies tp $S
  grep -A22 "rank 0 profile of step 4 by self_device" $W/72b-tp/tp.log | head -24 > $OUT/profile-72b-tp.txt
  LONG="--set data.max_length=$LONGLEN --set data.max_summary_tokens=$LONGSUM --set data.synthetic_train=32 \
    --set data.synthetic_validation=0 --set train.batch_size=4 --set train.compile=false --set train.cuda_graphs=false"
  bench long-ddp-pick 100 $B4 --strategies ddp $S $LONG --set parallel.strategy=\"ddp\" --set parallel.pp=1 \
    --set parallel.dp=2 --set train.batch_size=1 --set train.grad_accum=2 --set parallel.n_microbatches=1
  bench long-pp-auto 100 $B4 --strategies pp $S $LONG --set parallel.n_microbatches=4 \
    --set train.activation_checkpointing=\"auto\"
fi
collect wave5_$CALL
echo "call $CALL done in $(( $(date +%s) - START )) s"
