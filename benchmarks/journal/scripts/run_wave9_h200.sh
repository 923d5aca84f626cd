#!/usr/bin/env bash
# Wave 9 on ONE H200 (the 2-GPU kinds were not lent). Qwen3-4B shape, random weights, seq 512, LoRA r16 on 7
# projections, shared dropout, every speed switch of the bench config.
#   1: the step's host synchronizations (issue 22): `single` 1 x 8 (one GPU's share of `ddp` 1 x 8 on two) with
#      the code before the change (.baselines/pipetune-7da8567: the non-finite flags read at every step's end, a
#      metrics row every step) against now (a skip decided on the device, the flags read one step late; rows of
#      5 steps), and now with a row every step (warm-up 4, 21 steps: the row's own synchronization alone), in
#      A B C A B order; DDP + PEFT compiled per layer on one GPU beside them. Then, if the budget holds it, the
#      72B shape with an NF4 base in the layout the plan picks for `ddp` on two GPUs (microbatches of 4, 2
#      accumulated), here `single`: its memory per GPU (issue 20; the 2-GPU run recomputed 10 layers by a bug
#      since fixed).
#   2: call 1's three variants again, three runs each of 40 timed steps in a Latin square; then the 72B NF4 run
#      that call 1's budget left out.
#   3: rows of 5 and a row every step once more each, step 30 traced, the GPU's clock and power sampled; then the
#      72B NF4 run.
#   4: after call 3's finding (the flags' read-back drained the GPU): rows of 5 twice, a row every step, and the
#      code before.
#   5: a non-finite step skipped on the GPU (tiny model, bf16, CUDA graphs, NaN gradients at step 3).
# Old code: git archive 7da8567 src | tar x -C .baselines/pipetune-7da8567 (carried with .baselines).
# Usage (device machine, repo root, .whl and .baselines carried): OUT=dir bash benchmarks/journal/scripts/run_wave9_h200.sh 1
# CPU dry run with the tiny model: TINY=1 OUT=dir bash benchmarks/journal/scripts/run_wave9_h200.sh 1
CALL=${1:-1}
source benchmarks/h200_common.sh
W=/tmp/wave9-$CALL; rm -rf $W; mkdir -p $W
BUDGET=${BUDGET:-540}
OLD=$PWD/.baselines/pipetune-7da8567/src
if [ "${TINY:-0}" = 1 ]; then
  BENCH_ARGS=$TINY_ARGS; S="--steps 5 --warmup 5"; S1="--steps 6 --warmup 4"
else
  BENCH_ARGS=""; S="--steps 20 --warmup 5"; S1="--steps 21 --warmup 4"
fi
ONE8="--set parallel.pp=1 --set parallel.n_microbatches=1 --set train.batch_size=8 --set lora.shared_dropout=true"
old() { PYTHONPATH=$OLD:$PYTHONPATH "$@"; }  # a command on the code before the change
NF4_PICK="--set parallel.pp=1 --set parallel.n_microbatches=1 --set train.batch_size=4 --set train.grad_accum=2"
if [ "$CALL" = 1 ]; then
  old bench a1-old-rows1 150 $B4 --strategies single $S $ONE8
  bench b1-new-rows5 90 $B4 --strategies single $S $ONE8
  bench c1-new-rows1 90 $B4 --strategies single $S1 $ONE8
  old bench a2-old-rows1 90 $B4 --strategies single $S $ONE8
  bench b2-new-rows5 90 $B4 --strategies single $S $ONE8
  if [ "${TINY:-0}" != 1 ]; then
    echo "== DDP + PEFT compiled per layer, one GPU, micro-batch 8 ($(date +%T))"
    (cd $W && MB=8 GA=1 MAX_STEPS=20 COMPILE=1 timeout 100 torchrun --nproc_per_node=1 \
      $OLDPWD/.baselines/lora_ddp.py 2>&1 | grep -E "RESULT|rror" | tail -3) | tee $OUT/ddp-peft-1gpu.txt
    [ "$(left)" -gt 190 ] && bench 72b-nf4-ddp-layout 200 $B72 --strategies single --steps 3 --warmup 2 $NF4_PICK $(quant nf4)
  fi
  collect wave9_$CALL
elif [ "$CALL" = 2 ]; then
  # Call 1's five runs differed by no more than runs of the same code did (153 and 156 ms a step): three of each,
  # 40 timed steps, in a Latin square (A B C, B C A, C A B), on call 1's compile cache (.carry).
  L="--steps 40 --warmup 5"; L1="--steps 41 --warmup 4"
  [ "${TINY:-0}" = 1 ] && { L="--steps 5 --warmup 5"; L1="--steps 6 --warmup 4"; }
  for round in 1 2 3; do
    for v in $(echo "a b c b c a c a b" | cut -d' ' -f$((3 * round - 2))-$((3 * round))); do
      case $v in
        a) old bench a$round-old-rows1 80 $B4 --strategies single $L $ONE8 ;;
        b) bench b$round-new-rows5 80 $B4 --strategies single $L $ONE8 ;;
        c) bench c$round-new-rows1 80 $B4 --strategies single $L1 $ONE8 ;;
      esac
    done
  done
  [ "${TINY:-0}" != 1 ] && [ "$(left)" -gt 170 ] && \
    bench 72b-nf4-ddp-layout $(( $(left) - 20 )) $B72 --strategies single --steps 3 --warmup 2 $NF4_PICK $(quant nf4)
  collect wave9_$CALL
elif [ "$CALL" = 4 ]; then
  # Call 3's trace: the flags' read-back (`.tolist()`) queued behind the next step's forward and backward and
  # drained the GPU; now they are copied to pinned memory when made and waited for by an event. Rows of 5 twice,
  # a row every step, the code before, in that order.
  L="--steps 40 --warmup 5"; L1="--steps 41 --warmup 4"
  [ "${TINY:-0}" = 1 ] && { L="--steps 5 --warmup 5"; L1="--steps 6 --warmup 4"; }
  bench b1-event-rows5 80 $B4 --strategies single $L $ONE8
  bench c1-event-rows1 80 $B4 --strategies single $L1 $ONE8
  old bench a1-old-rows1 80 $B4 --strategies single $L $ONE8
  bench b2-event-rows5 80 $B4 --strategies single $L $ONE8
  collect wave9_$CALL
elif [ "$CALL" = 5 ]; then
  # The skip on the GPU: the tiny model in bf16, compiled with CUDA graphs, one GPU, NaN gradients at step 3 (the
  # tests' fault entry); step 3's checkpoint must hold step 2's adapter, step 4 must change it, and step 4 must run
  # at the lr step 3 would have had.
  R=/tmp/w9-nan; rm -rf $R; mkdir -p $R
  FAST='"train.compile=true", "train.cuda_graphs=true", "model.dtype=\"bfloat16\""'
  [ "${TINY:-0}" = 1 ] && FAST='"train.compile=false"'
  PYTHONPATH=$PWD:$PYTHONPATH python3 -c "
from pathlib import Path
from tests.conftest import tiny_config, write_config
write_config(tiny_config(Path('$R/run'), 'parallel.pp=1', 'parallel.n_microbatches=1', 'train.max_steps=6',
    'train.save_every=1', 'train.keep_checkpoints=10', 'train.warmup_steps=0', $FAST), Path('$R/c.toml'))"
  PIPETUNE_TEST_NAN_AT=0:3 PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python3 -m tests.faults train --config $R/c.toml \
    --quiet 2>&1 | grep -v "Warning\|warnings.warn\|W1201\|_C_" | tail -8 | tee $OUT/nan-gpu.txt
  python3 - $R/run <<'PY' 2>&1 | tee -a $OUT/nan-gpu.txt
import csv, sys, torch
from pathlib import Path
from safetensors.torch import load_file
run = Path(sys.argv[1])
a = {s: load_file(run / "checkpoints" / f"step-{s}" / "adapter.rank0.safetensors") for s in (2, 3, 4)}
same = all(torch.equal(a[2][k], a[3][k]) for k in a[2])
moved = any(not torch.equal(a[3][k], a[4][k]) for k in a[3])
rows = {int(r["step"]): r for r in csv.DictReader(open(run / "metrics.csv")) if r["loss"]}
print(f"step 3 changed no adapter weight: {same}; step 4 changed them: {moved}")
print("lr by step:", {s: float(r["lr"]) for s, r in sorted(rows.items())})
print("loss by step:", {s: r["loss"] for s, r in sorted(rows.items())})
PY
fi
echo "call $CALL done in $(( $(date +%s) - START )) s"
