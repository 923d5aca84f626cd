#!/usr/bin/env bash
# Tensor parallelism, the quantized base and the real model on 2x H200, in three device calls of < 10 minutes.
# Random weights unless noted, seq 512, effective batch 16, LoRA r16 on 7 projections, every speed switch of the
# bench configs on (compile, CUDA graphs, fused loss; the 72B shape with checkpointing "auto").
#   1: Qwen3-4B pp=2 (1F1B 4 x 4) / tp=2 (one replica, the same microbatches) / ddp (2 x 8); the 72B shape pp=2
#      (1F1B 8 x 2) / tp=2; fp8 pp at 72B and at 4B. Also stashes the first half of the SmolLM2 GGUF file.
#   2: SmolLM2-135M-Instruct (the real model, from its GGUF) fine-tuned and scored on GPU 1
#      (benchmarks/tools/smollm2_rouge.py) while GPU 0 trains the 72B shape in NF4 alone (single); then NF4 pp and
#      NF4 ddp of the 72B shape on both GPUs.
#   3: the 72B shape tp=2; Qwen3-4B tp=2 with one microbatch of 16; fp8 pp at 72B; NF4 72B on one GPU.
#   4 (ONE H200): the 72B shape in NF4 and in FP8 on one GPU (single); Qwen3-4B single bf16 against fp8.
#   5 (ONE H200): the 72B shape in FP8 on one GPU again, after a fix that call 4 called for.
# Each run is `pipetune bench` with its own --timeout; a run that would not fit the call's budget is skipped and
# said so. Usage (device machine, repo root; carry .whl, .baselines and in call 1 .carry/smollm2.gguf.partaa, in
# call 2 .carry/smollm2.gguf.partab): OUT=dir bash benchmarks/journal/scripts/run_wave2_h200.sh 1|2|3
# CPU dry run with the tiny model (no GPU; fp8 and the real model left out): TINY=1 OUT=dir bash ... 1|2|3
CALL=${1:-1}
source benchmarks/h200_common.sh
W=/tmp/wave2-$CALL; rm -rf $W; mkdir -p $W
BUDGET=${BUDGET:-560}
if [ "${TINY:-0}" = 1 ]; then
  BENCH_ARGS=$TINY_ARGS
  S4="--steps 1 --warmup 1"; S72=$S4; CURVE=$S4; FP8=""
else
  BENCH_ARGS=""; S4="--steps 8 --warmup 4"; S72="--steps 4 --warmup 2"; CURVE="--steps 96 --warmup 4"; FP8=fp8
fi
q() { echo "--set model.quantize=\"$1\""; }
TP="--strategies tp"
REPLICAS="--set parallel.pp=1 --set parallel.dp=2 --set train.batch_size=2 --set train.grad_accum=4 \
  --set parallel.n_microbatches=1"
if [ "$CALL" = 1 ]; then
  mkdir -p /tmp/keep && cp .carry/smollm2.gguf.partaa /tmp/keep/ 2>/dev/null && echo "stashed GGUF part aa"
  bench 4b-pp 110 $B4 --strategies pp $S4
  bench 4b-tp 130 $B4 $TP $S4
  bench 4b-ddp 100 $B4 --strategies ddp $S4
  bench 72b-pp 120 $B72 --strategies pp $S72
  bench 72b-tp 140 $B72 $TP $S72
  [ -n "$FP8" ] && bench 72b-pp-fp8 110 $B72 --strategies pp $S72 $(q fp8)
  [ -n "$FP8" ] && bench 4b-pp-fp8 90 $B4 --strategies pp $S4 $(q fp8)
elif [ "$CALL" = 2 ]; then
  if [ "${TINY:-0}" != 1 ]; then
    GGUF=/tmp/keep/smollm2.gguf
    cat /tmp/keep/smollm2.gguf.partaa .carry/smollm2.gguf.partab > $GGUF 2>/dev/null
    echo "GGUF $(sha256sum $GGUF | cut -c1-16) (expected b179c9523d0e6a0f)"
    (CUDA_VISIBLE_DEVICES=1 timeout $(( $(left) - 20 )) python3 benchmarks/tools/smollm2_rouge.py --model $GGUF \
      --out $W/smollm2 --meetings 64 > $OUT/smollm2.log 2>&1; echo "smollm2 exit $?" >> $OUT/smollm2.log) &
    SMOL=$!
  fi
  # One GPU: all 80 layers in NF4 (~41 GB), checkpointing planned for the rest ("auto"), 8 microbatches of 2.
  CUDA_VISIBLE_DEVICES=0 bench 72b-single-nf4 260 $B72 --strategies single $S72 $(q nf4)
  [ -n "${SMOL:-}" ] && wait $SMOL
  cp -r $W/smollm2/eval.json $W/smollm2/result.json $W/smollm2/metrics.csv $OUT/ 2>/dev/null
  tail -25 $OUT/smollm2.log 2>/dev/null
  bench 72b-pp-nf4 120 $B72 --strategies pp $S72 $(q nf4)
  bench 72b-ddp-nf4 150 $B72 --strategies ddp $S72 $(q nf4) --set parallel.strategy=\"ddp\" $REPLICAS
elif [ "$CALL" = 3 ]; then
  # What calls 1 and 2 could not finish: their 4B pp / tp warm-ups (cold compile, then 86 s of graph recording
  # on a tp rank) outlasted their limits, and NF4 ran out of memory compiled (fixed since: model/quantize.py).
  bench 72b-tp 150 $B72 $TP $S72
  # tp=2 as tensor parallelism usually runs: the batch of 16 in one microbatch, compiled without graphs.
  bench 4b-tp-mb16 120 $B4 $TP $S4 --set parallel.n_microbatches=1 --set train.cuda_graphs=false
  [ -n "$FP8" ] && bench 72b-pp-fp8 130 $B72 --strategies pp $S72 $(q fp8)
  CUDA_VISIBLE_DEVICES=0 bench 72b-single-nf4 200 $B72 --strategies single $S72 $(q nf4)
elif [ "$CALL" = 4 ]; then  # ONE H200 (when two were not lent): a quantized base on a single GPU
  bench 72b-single-nf4 200 $B72 --strategies single $S72 $(q nf4)
  [ -n "$FP8" ] && bench 72b-single-fp8 200 $B72 --strategies single $S72 $(q fp8)
  # Qwen3-4B on one GPU, the batch of 16 in one microbatch, compiled without graphs: bf16 against fp8.
  SINGLE4="--set parallel.pp=1 --set parallel.strategy=\"single\" --set parallel.n_microbatches=1 \
    --set train.cuda_graphs=false"
  bench 4b-single-bf16 85 $B4 --strategies single $S4 $SINGLE4
  [ -n "$FP8" ] && bench 4b-single-fp8 85 $B4 --strategies single $S4 $SINGLE4 $(q fp8)
elif [ "$CALL" = 5 ]; then  # ONE H200, after the fix to auto checkpointing's layer dtype: the 72B shape in FP8
  bench 72b-single-fp8 220 $B72 --strategies single $S72 $(q fp8)
fi
collect wave2_$CALL
echo "call $CALL done in $(( $(date +%s) - START )) s"
