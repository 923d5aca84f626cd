#!/usr/bin/env bash
# The layouts beside their baselines, on 2x H200, in three device calls of < 10 minutes each. Random weights,
# seq 512, effective batch 16, LoRA r16 on 7 projections, every speed switch of the bench configs (CUDA graphs
# where the rule keeps them: off at the 72B shape, and wherever recording would take over 2 minutes).
#   1 (the 72B shape): pp 1F1B 8 x 2 in bf16 and with an FP8 base; plain FSDP2 + PEFT compiled
#     (../shared/baselines/fsdp2_lora.py, MB=2 GA=4); pp interleaved v=4 8 x 2, `pipetune plan`'s pick.
#   2 (Qwen3-32B): pp 1F1B 8 x 2 in bf16 and FP8; ddp, 2 replicas x 4 sequences x 2 accumulation steps (the
#     plan's pick); then the 72B shape with an NF4 base under ddp, 2 replicas x 2 sequences x 4 accumulation
#     steps, its dequantization compiled.
#   3 (Qwen3-4B): ddp (its 6th step profiled: PIPETUNE_PROFILE_STEP), tp=2 with one microbatch of 16 compiled
#     without graphs; then 100 optimizer steps of ddp eager with a bf16, FP8 and NF4 base: tokens/s and the three
#     loss curves in one PNG with their largest relative gap.
# Each run is `pipetune bench` with its own --timeout; a run that would not fit the call's budget is skipped and
# said so. Usage (device machine, repo root, .whl and .baselines carried): OUT=dir bash benchmarks/journal/scripts/run_wave4_h200.sh 1|2|3
# CPU dry run with the tiny model (no GPU; fp8 left out): TINY=1 OUT=dir bash benchmarks/journal/scripts/run_wave4_h200.sh 1|2|3
CALL=${1:-1}
source benchmarks/h200_common.sh
W=/tmp/wave4-$CALL; rm -rf $W; mkdir -p $W
BUDGET=${BUDGET:-540}
if [ "${TINY:-0}" = 1 ]; then
  BENCH_ARGS=$TINY_ARGS; S="--steps 1 --warmup 1"; CURVE="--steps 2 --warmup 1"; FP8=""; M32=""; V=2
else
  BENCH_ARGS=""; S="--steps 4 --warmup 2"; CURVE="--steps 96 --warmup 4"; FP8=fp8; V=4
  M32="--set model.name=\"qwen3-32b\" --set data.synthetic_validation=0"
fi
REPLICAS="--set parallel.strategy=\"ddp\" --set parallel.pp=1 --set parallel.dp=2 --set train.batch_size=2 \
  --set train.grad_accum=4 --set parallel.n_microbatches=1"
if [ "$CALL" = 1 ]; then
  bench 72b-pp 150 $B72 --strategies pp $S
  [ -n "$FP8" ] && bench 72b-pp-fp8 140 $B72 --strategies pp $S $(quant fp8)
  echo "== plain FSDP2 + PEFT, compiled, MB=2 GA=4 ($(date +%T), limit 110 s)"
  if [ "${TINY:-0}" = 1 ]; then
    (cd $W && TINY=1 DTYPE=float32 MB=2 GA=4 MAX_STEPS=3 WARM=1 OMP_NUM_THREADS=1 timeout 120 \
      torchrun --nproc_per_node=2 $OLDPWD/.baselines/fsdp2_lora.py 2>&1 | grep -E "RESULT|rror" | tail -4)
  else
    (cd $W && CONFIG=qwen2.5-72b MB=2 GA=4 MAX_STEPS=6 WARM=2 COMPILE=1 timeout 110 \
      torchrun --nproc_per_node=2 $OLDPWD/.baselines/fsdp2_lora.py 2>&1 | grep -E "RESULT|init_peak|rror" | tail -4)
  fi | tee $OUT/fsdp2_lora.txt
  bench 72b-pp-v4 150 $B72 --strategies pp $S --set parallel.schedule=\"interleaved_1f1b\" \
    --set parallel.stages_per_rank=$V
elif [ "$CALL" = 2 ]; then
  bench 32b-pp 140 $B4 --strategies pp $S $M32 --set parallel.n_microbatches=8
  [ -n "$FP8" ] && bench 32b-pp-fp8 130 $B4 --strategies pp $S $M32 --set parallel.n_microbatches=8 $(quant fp8)
  bench 32b-ddp 150 $B4 --strategies ddp $S $M32 $REPLICAS --set train.batch_size=4 --set train.grad_accum=2
  bench 72b-ddp-nf4 170 $B72 --strategies ddp $S $REPLICAS $(quant nf4)
elif [ "$CALL" = 3 ]; then
  PIPETUNE_PROFILE_STEP=6 bench 4b-ddp 150 $B4 --strategies ddp $S --steps 8 --warmup 4
  TP16="--set parallel.pp=1 --set parallel.strategy=\"tp\" --set parallel.tp=2 --set parallel.n_microbatches=1"
  bench 4b-tp-mb16 130 $B4 --strategies tp --steps 8 --warmup 4 $TP16 --set train.cuda_graphs=false
  EAGER="--set train.compile=false --set train.cuda_graphs=false --set data.synthetic_validation=0"
  curves=""
  for q in none $FP8 nf4; do
    [ $q = nf4 ] && limit=120 || limit=85  # NF4 compiles its dequantization for each weight shape
    bench 4b-curve-$q $limit $B4 --strategies ddp $CURVE $EAGER $(quant $q)
    curves="$curves $q=$W/4b-curve-$q/ddp/metrics.csv"
  done
  python3 benchmarks/tools/plot_loss_curves.py $OUT/loss_curves_4b.png $curves 2>&1 | tee $OUT/loss_curves_4b.txt
fi
collect wave4_$CALL
echo "call $CALL done in $(( $(date +%s) - START )) s"
