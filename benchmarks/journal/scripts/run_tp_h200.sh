#!/usr/bin/env bash
# Tensor parallelism against the pipeline and data parallelism on 2x H200, in parts that each fit one 10-minute
# device call. Random weights, seq 512, LoRA r16 on 7 projections, every speed switch of the bench configs on,
# effective batch 16; each row prints tokens/s, MFU and peak memory per rank (bench.json: peak_gb_per_rank).
#   A: Qwen3-4B: pp=2 (1F1B, 4 microbatches of 4), tp=2 (one replica, the same microbatches), ddp (2 x 8).
#   B: Qwen3-4B, tp=2 variants: 1 microbatch of 16; sequence parallelism; the plain loss (logits all-gathered
#      over the tp ranks) instead of the vocabulary-parallel fused loss; compiled without CUDA graphs.
#   C: the Qwen2.5-72B shape (145 GB of bf16 weights): pp=2 (1F1B, 8 microbatches of 2), tp=2 (one replica, the
#      same microbatches), fsdp (2 replicas x 2 sequences x 4 accumulation steps, as benchmarks/journal/scripts/run_big_h200.sh).
#   D: the 72B shape, tp=2 variants: sequence parallelism; 4 microbatches of 4.
# Usage (device machine, repo root):
#   OUT=dir bash benchmarks/journal/scripts/run_tp_h200.sh A|B|C|D
# CPU dry run of the same commands with a tiny model (no GPU): TINY=1 OUT=dir bash benchmarks/journal/scripts/run_tp_h200.sh A|B|C|D
source benchmarks/h200_common.sh
PART=${1:-A}; W=/tmp/tp$PART; rm -rf $W; mkdir -p $W
if [ "${TINY:-0}" = 1 ]; then  # the same commands on the CPU: tiny model, 1 + 1 steps
  SHAPE="--set model.name=tiny-qwen3 --set model.dtype=float32 --set train.compile=false --set train.cuda_graphs=false \
    --set train.activation_checkpointing=false --set data.synthetic_train=64"
  STEPS="--steps 1 --warmup 1"
else
  SHAPE=""; STEPS="--steps 8 --warmup 4"
fi
TP="--strategies tp"  # from a pp=2 config: one replica split over both ranks, the config's microbatches
# Variants set the tp layout in the config itself (the pp config must validate as it is, e.g. 1F1B's microbatches).
TP2="--set parallel.strategy=\"tp\" --set parallel.pp=1 --set parallel.tp=2"
# Two whole-model replicas at the same effective batch of 16: 2 sequences each, 4 accumulation steps.
REPLICAS="--set parallel.pp=1 --set parallel.dp=2 --set train.batch_size=2 --set train.grad_accum=4 \
  --set parallel.n_microbatches=1 --set parallel.strategy=\"fsdp\""
if [ "$PART" = A ]; then
  bench 4b-pp 150 $B4 --strategies pp $STEPS $SHAPE
  bench 4b-tp 200 $B4 $TP $STEPS $SHAPE
  bench 4b-ddp 150 $B4 --strategies ddp $STEPS $SHAPE
elif [ "$PART" = B ]; then
  bench 4b-tp-mb16 130 $B4 $TP $STEPS $SHAPE $TP2 --set parallel.n_microbatches=1
  bench 4b-tp-sp 150 $B4 $TP $STEPS $SHAPE $TP2 --set parallel.sequence_parallel=true
  bench 4b-tp-plain-loss 150 $B4 $TP $STEPS $SHAPE --set train.fused_loss=false
  bench 4b-tp-no-graphs 120 $B4 $TP $STEPS $SHAPE --set train.cuda_graphs=false
elif [ "$PART" = C ]; then
  bench 72b-pp 170 $B72 --strategies pp $STEPS $SHAPE
  bench 72b-tp 200 $B72 $TP $STEPS $SHAPE
  bench 72b-fsdp 170 $B72 --strategies fsdp $STEPS $SHAPE $REPLICAS
elif [ "$PART" = D ]; then
  bench 72b-tp-sp 200 $B72 $TP $STEPS $SHAPE $TP2 --set parallel.sequence_parallel=true
  bench 72b-tp-mb4 200 $B72 $TP $STEPS $SHAPE --set parallel.n_microbatches=4
fi
collect tp_$PART
echo "part $PART done in $(( $(date +%s) - START )) s"
