#!/usr/bin/env bash
# A quantized frozen base (model.quantize = nf4 | fp8) beside bf16, on H200s, in parts that each fit one 10-minute call.
#   A (2 GPUs): the Qwen2.5-72B shape, pp 1F1B 8 x 2 (configs/bench-qwen2.5-72b.toml): bf16, fp8, nf4.
#   B (2 GPUs): the 72B shape in NF4 on ONE GPU (single, 16 sequences in 8 microbatches) and NF4 ddp on two
#      (2 replicas x 2 sequences x 4 accumulation steps); both effective batch 16, as A.
#   C (2 GPUs): Qwen3-4B pp with every switch on (configs/bench-qwen3-4b.toml): bf16, fp8, nf4, 100 optimizer steps
#      each: tokens/s and the loss curves of the three in one PNG with the largest relative gap.
#   D (2 GPUs): Qwen3-32B pp 1F1B 8 x 2 with every switch on but CUDA graphs: bf16 and fp8.
#   E (1 GPU): the demo's quality side by side (benchmarks/tools/quant_quality.py): bf16, fp8 and nf4, all bfloat16,
#      validation loss after 150 steps (and ROUGE if rouge-score is installed).
# MFU is bench's: model FLOPs over bf16's 790 TFLOP/s, for every method (FP8 runs can pass what bf16 could reach).
# Needs torchao (nf4) on the device: carry its wheel in .whl/ (pip download --no-deps -d .whl torchao==0.18.0:
# torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl, built for torch >= 2.11, no
# dependencies); it is installed from there when missing.
# Usage (device machine, repo root): OUT=dir bash benchmarks/journal/scripts/run_quant_h200.sh A|B|C|D|E
# CPU dry run of the same commands with the tiny model (no GPU; fp8 is refused on a CPU, so its runs are
# left out): TINY=1 OUT=dir bash benchmarks/journal/scripts/run_quant_h200.sh A|B|C|D|E
source benchmarks/h200_common.sh
PART=${1:-A}; W=/tmp/quant$PART; rm -rf $W; mkdir -p $W
python3 -c "import torchao" 2>/dev/null || python3 -m pip install -q --no-deps --no-index .whl/torchao-*.whl
python3 -c "import torchao, peft; print('torchao', torchao.__version__)" >> "$OUT/env.txt" 2>&1
if [ "${TINY:-0}" = 1 ]; then  # the same commands on the CPU: tiny model, float32, 1 + 1 steps (2 for the curves)
  SHAPE="--set model.name=tiny-qwen3 --set model.dtype=\"float32\" --set train.compile=false --set train.cuda_graphs=false"
  SHAPE32=$SHAPE; STEPS="--steps 1 --warmup 1"; CURVE="--steps 1 --warmup 1"; METHODS="none nf4"
else
  # 32B without CUDA graphs: recording them takes minutes at 8 microbatches (benchmarks/journal/2026-11-30-big-h200.md).
  SHAPE=""; SHAPE32="--set model.name=qwen3-32b --set parallel.n_microbatches=8 --set data.synthetic_validation=0 \
    --set train.cuda_graphs=false"
  STEPS="--steps 4 --warmup 2"; CURVE="--steps 96 --warmup 4"; METHODS="none fp8 nf4"
fi
if [ "$PART" = A ]; then
  for q in $METHODS; do bench 72b-pp-$q 180 $B72 --strategies pp $STEPS $SHAPE $(quant $q); done
elif [ "$PART" = B ]; then
  # One GPU: all 80 layers (~41 GB of NF4 and bf16 weights), checkpointing planned for the rest ("auto").
  bench 72b-single-nf4 270 $B72 --strategies single $STEPS $SHAPE $(quant nf4)
  bench 72b-ddp-nf4 270 $B72 --strategies ddp $STEPS $SHAPE $(quant nf4) --set parallel.strategy=\"ddp\" \
    --set parallel.pp=1 --set parallel.dp=2 --set train.batch_size=2 --set train.grad_accum=4 \
    --set parallel.n_microbatches=1
elif [ "$PART" = C ]; then
  for q in $METHODS; do bench 4b-pp-$q 170 $B4 --strategies pp $CURVE $SHAPE $(quant $q); done
  curves=""; for q in $METHODS; do curves="$curves $q=$W/4b-pp-$q/pp/metrics.csv"; done
  python3 benchmarks/tools/plot_loss_curves.py $OUT/loss_curves_4b.png $curves | tee $OUT/loss_curves_4b.txt
elif [ "$PART" = D ]; then
  for q in ${METHODS/nf4/}; do bench 32b-pp-$q 270 $B4 --strategies pp $STEPS $SHAPE32 $(quant $q); done
elif [ "$PART" = E ]; then
  [ "${TINY:-0}" = 1 ] && QSTEPS="--steps 2" || QSTEPS=""
  timeout $(left) python3 benchmarks/tools/quant_quality.py $W/quality $QSTEPS --methods ${METHODS// /,} \
    --set 'model.dtype="bfloat16"' 2>&1 | grep -v -i warn | tee $OUT/quality.txt | tail -5
  cp $W/quality/quality.json $OUT/ 2>/dev/null
fi
collect quant_$PART
echo "part $PART done in $(( $(date +%s) - START )) s"
