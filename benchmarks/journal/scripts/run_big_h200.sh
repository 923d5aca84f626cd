#!/usr/bin/env bash
# Models larger than one GPU, on 2x H200, in parts that each fit one 10-minute device call.
#   A: the Qwen2.5-72B shape (145 GB of bf16 weights): pp 1F1B 8 x 2, pp interleaved v=2, fsdp dp=2 (built
#      sharded), and plain FSDP2 + PEFT (../shared/baselines/fsdp2_lora.py) in the same call; effective batch 16.
#   B: Qwen3-32B pp vs ddp (effective batch 16); Qwen3-4B at 16,384 tokens, pp with activation_checkpointing
#      "auto" vs ddp with every layer checkpointed (4 sequences); the seed script and DDP + PEFT (Qwen3-4B, 512).
# Usage (device machine, repo root, ../shared/baselines copied to .baselines):
#   OUT=dir bash benchmarks/journal/scripts/run_big_h200.sh A|B
# CPU dry run of the commands with a tiny model (no GPU): TINY=1 OUT=dir bash benchmarks/journal/scripts/run_big_h200.sh A|B
source benchmarks/h200_common.sh
PART=${1:-A}; W=/tmp/big$PART; rm -rf $W; mkdir -p $W
if [ "${TINY:-0}" = 1 ]; then  # the same commands on the CPU: tiny model, 2 steps
  SHAPE72="--set model.name=tiny-qwen3 --set model.dtype=float32 --set train.compile=false --set train.cuda_graphs=false"
  SHAPE32=$SHAPE72; SHAPE4=$SHAPE72; STEPS="--steps 1 --warmup 1"; LONGLEN=512; LONGSUM=128; SEED=0
else
  SHAPE72=""; SHAPE32="--set model.name=qwen3-32b"; SHAPE4=""; STEPS="--steps 4 --warmup 2"
  LONGLEN=16384; LONGSUM=1024; SEED=1
fi
# Two whole-model replicas at the same effective batch of 16: 2 sequences each, 4 accumulation steps.
REPLICAS="--set parallel.pp=1 --set parallel.dp=2 --set train.batch_size=2 --set train.grad_accum=4 \
  --set parallel.n_microbatches=1"
if [ "$PART" = A ]; then
  bench pp-1f1b 170 $B72 --strategies pp $STEPS $SHAPE72
  bench pp-interleaved-v2 150 $B72 --strategies pp $STEPS $SHAPE72 \
    --set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=2
  bench fsdp 170 $B72 --strategies fsdp $STEPS $SHAPE72 $REPLICAS --set parallel.strategy=\"fsdp\"
  echo "== plain FSDP2 + PEFT, compiled, MB=2 GA=4 ($(date +%T), limit $(left) s)"
  if [ "$SEED" = 1 ]; then
    (cd $W && CONFIG=qwen2.5-72b MB=2 GA=4 MAX_STEPS=6 WARM=2 COMPILE=1 timeout $(left) \
      torchrun --nproc_per_node=2 $OLDPWD/.baselines/fsdp2_lora.py 2>&1 | grep -E "RESULT|init_peak|rror" | tail -4)
  else
    (cd $W && TINY=1 DTYPE=float32 MB=2 GA=4 MAX_STEPS=3 WARM=1 OMP_NUM_THREADS=1 timeout 120 \
      torchrun --nproc_per_node=2 $OLDPWD/.baselines/fsdp2_lora.py 2>&1 | grep -E "RESULT|rror" | tail -4)
  fi
elif [ "$PART" = B ]; then
  bench 32b-pp 170 $B4 --strategies pp $STEPS $SHAPE32 --set parallel.n_microbatches=8 \
    --set data.synthetic_validation=0
  bench 32b-ddp 150 $B4 --strategies ddp $STEPS $SHAPE32 $REPLICAS --set parallel.strategy=\"ddp\" \
    --set data.synthetic_validation=0
  LONG="--set data.max_length=$LONGLEN --set data.max_summary_tokens=$LONGSUM --set data.synthetic_train=32 \
    --set data.synthetic_validation=0 --set train.batch_size=4 --set train.compile=false --set train.cuda_graphs=false"
  bench long-pp-auto 110 $B4 --strategies pp $STEPS $SHAPE4 $LONG --set parallel.n_microbatches=4 \
    --set train.activation_checkpointing=\"auto\"
  bench long-ddp-ckpt 110 $B4 --strategies ddp $STEPS $SHAPE4 $LONG --set parallel.strategy=\"ddp\" \
    --set parallel.pp=1 --set parallel.dp=2 --set train.batch_size=2 --set parallel.n_microbatches=1 \
    --set train.activation_checkpointing=true
  if [ "$SEED" = 1 ]; then baselines 8 100 90; fi
fi
collect big_$PART
echo "part $PART done in $(( $(date +%s) - START )) s"
