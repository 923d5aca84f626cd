#!/usr/bin/env bash
# What ONE H200 can measure of what is still open (and call 4 on two), in device calls of
# < 10 minutes each. Random weights, seq 512, effective batch 16, LoRA r16 / dropout 0.15 on 7 projections.
#   1: 100 optimizer steps of Qwen3-4B `single` eager (2 microbatches of 8) with a bf16, an FP8 and an NF4 base,
#      and the three loss curves in one PNG with their largest relative gap.
#   2: Qwen3-4B `single` compiled with CUDA graphs, 2 microbatches of 8 (one GPU's share of `ddp` 1 x 8 on two):
#      step 6 profiled with its Chrome trace (where the GPU idles); the same run with lora.shared_dropout, and
#      with an NF4 base; the 72B shape with an NF4 base as the plan picks it for one GPU (4 x 4 accumulation);
#      DDP + PEFT on one GPU beside them; one decoder layer under each lever (layer_levers.py) if time is left.
#   3: the 72B shape with an NF4 base on one GPU (`single`, 8 microbatches of 2), its 4th step profiled with its
#      trace (the ~5.4 s step of 72B NF4 ddp against ~2.9 s modelled); run before and after the NF4 linear
#      became one operator inside the compiled layer. Then (after) Qwen3-4B NF4 compiled with CUDA graphs, and
#      the 72B NF4 shape in one microbatch of 16 with every layer checkpointed (3 dequantizations a layer and
#      step instead of 16).
#   4 (2 GPUs, when lent): Qwen3-4B tp=2 1 x 16 with the fused (vocabulary-parallel) loss and with the plain one;
#      `ddp` 1 x 8 with and without lora.shared_dropout; DDP + PEFT eager beside them.
# Usage (device machine, repo root, .whl and .baselines carried): OUT=dir bash benchmarks/journal/scripts/run_wave6_h200.sh 1|2|3|4
# CPU dry run with the tiny model (no GPU; fp8 left out): TINY=1 OUT=dir bash benchmarks/journal/scripts/run_wave6_h200.sh 1|2|3
CALL=${1:-1}
source benchmarks/h200_common.sh
W=/tmp/wave6-$CALL; rm -rf $W; mkdir -p $W
BUDGET=${BUDGET:-520}
if [ "${TINY:-0}" = 1 ]; then
  BENCH_ARGS=$TINY_ARGS; S="--steps 1 --warmup 1"; CURVE="--steps 2 --warmup 1"; FP8=""; LEVERS="--set model.name=\"tiny-qwen3\" --set model.dtype=\"float32\""
else
  BENCH_ARGS=""; S="--steps 6 --warmup 4"; CURVE="--steps 96 --warmup 4"; FP8=fp8; LEVERS=""
fi
M2="--set parallel.n_microbatches=2"  # single: 2 microbatches of 8
if [ "$CALL" = 1 ]; then
  EAGER="--set train.compile=false --set train.cuda_graphs=false --set data.synthetic_validation=0"
  for q in none $FP8 nf4; do
    bench 4b-curve-$q 170 $B4 --strategies single $CURVE $EAGER $M2 $(quant $q)
    cp $W/4b-curve-$q/single/metrics.csv $OUT/curve-4b-$q-metrics.csv 2>/dev/null
  done
  curves=""; for q in none $FP8 nf4; do [ -f $OUT/curve-4b-$q-metrics.csv ] && curves="$curves $q=$OUT/curve-4b-$q-metrics.csv"; done
  python3 benchmarks/tools/plot_loss_curves.py $OUT/loss_curves_4b.png $curves 2>&1 | tee $OUT/loss_curves_4b.txt
elif [ "$CALL" = 2 ]; then
  PIPETUNE_PROFILE_STEP=6 PIPETUNE_PROFILE_TRACE=$OUT/trace-4b-single bench 4b-single 150 $B4 --strategies single $S $M2
  python3 benchmarks/tools/trace_gaps.py $OUT/trace-4b-single/trace-rank0.json.gz 2>&1 | tee $OUT/gaps-4b-single.txt
  rm -rf $OUT/trace-4b-single
  grep -q shared_dropout src/pipetune/config.py && \
    bench 4b-single-shared-dropout 120 $B4 --strategies single $S $M2 --set lora.shared_dropout=true
  bench 4b-single-nf4-graphs 120 $B4 --strategies single $S $M2 $(quant nf4)
  PICK="--set parallel.pp=1 --set parallel.n_microbatches=1 --set train.batch_size=4 --set train.grad_accum=4"
  bench 72b-single-nf4-pick 170 $B72 --strategies single --steps 3 --warmup 2 $PICK $(quant nf4)
  if [ "${TINY:-0}" != 1 ] && [ "$(left)" -gt 70 ]; then
    echo "== DDP + PEFT compiled per layer, one GPU, micro-batch 8 x 2 accumulation ($(date +%T))"
    (cd $W && MB=8 GA=2 MAX_STEPS=10 COMPILE=1 timeout $(( $(left) - 10 )) torchrun --nproc_per_node=1 \
      $OLDPWD/.baselines/lora_ddp.py 2>&1 | grep -E "RESULT|rror" | tail -3) | tee $OUT/ddp-peft-1gpu.txt
  fi
  if [ "$(left)" -gt 50 ]; then
    timeout $(( $(left) - 10 )) python3 benchmarks/tools/layer_levers.py --config $B4 --microbatch 8 $LEVERS \
      --out $OUT/levers-4b.json 2>&1 | grep -v -i warn | tail -40 | tee $OUT/levers-4b.txt
  fi
elif [ "$CALL" = 3 ]; then
  M8="--set parallel.n_microbatches=8"
  [ "${TINY:-0}" = 1 ] && M8=""
  PIPETUNE_PROFILE_STEP=4 PIPETUNE_PROFILE_TRACE=$OUT/trace-72b-nf4 bench 72b-single-nf4 420 $B72 --strategies single \
    --steps 3 --warmup 2 $M8 $(quant nf4)
  grep -A28 "rank 0 profile of step 4 by self_device" $W/72b-single-nf4/single.log | head -30 > $OUT/profile-72b-nf4.txt
  python3 benchmarks/tools/trace_gaps.py $OUT/trace-72b-nf4/trace-rank0.json.gz 2>&1 | tee $OUT/gaps-72b-nf4.txt
  rm -rf $OUT/trace-72b-nf4  # over the 16 MB a file may bring back; the gaps above are its digest
  bench 4b-single-nf4-graphs 110 $B4 --strategies single $S $M2 $(quant nf4)
  bench 72b-single-nf4-1x16-ckpt 170 $B72 --strategies single --steps 3 --warmup 2 --set parallel.pp=1 --set parallel.n_microbatches=1 \
    --set train.activation_checkpointing=true $(quant nf4)
elif [ "$CALL" = 4 ]; then  # on 2 GPUs (nvidia-h200-x2)
  TP16="--set parallel.pp=1 --set parallel.strategy=\"tp\" --set parallel.tp=2 --set parallel.n_microbatches=1 \
    --set train.cuda_graphs=false"
  bench 4b-tp-fused-loss 130 $B4 --strategies tp --steps 8 --warmup 4 $TP16 --set train.fused_loss=true
  bench 4b-tp-plain-loss 100 $B4 --strategies tp --steps 8 --warmup 4 $TP16 --set train.fused_loss=false
  bench 4b-ddp 120 $B4 --strategies ddp $S
  bench 4b-ddp-shared-dropout 110 $B4 --strategies ddp $S --set lora.shared_dropout=true
  if [ "${TINY:-0}" != 1 ] && [ "$(left)" -gt 80 ]; then
    echo "== DDP + PEFT eager, micro-batch 8 ($(date +%T))"
    (cd $W && MB=8 GA=1 MAX_STEPS=20 timeout $(( $(left) - 10 )) torchrun --nproc_per_node=2 $OLDPWD/.baselines/lora_ddp.py \
      2>&1 | grep -E "RESULT|rror" | tail -3) | tee $OUT/ddp-peft-2gpu.txt
  fi
fi
collect wave6_$CALL
echo "call $CALL done in $(( $(date +%s) - START )) s"
