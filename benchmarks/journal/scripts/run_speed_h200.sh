#!/usr/bin/env bash
# Speed levers on 2x H200 (issue: 40k tokens/s), in parts that each fit one 10-minute device call.
#   A: CUDA graphs + fused loss vs compile alone at 4 x 4; 8 x 2; interleaved 1F1B v=2, v=3;
#      the seed and DDP baselines of the same run.
#   B: the same after the fused loss skips unsupervised rows; the plain path's loss curve at the same
#      step count (same seed, data, schedule); seed and DDP baselines again; long context (8192) with and
#      without activation checkpointing.
#   C: long context with and without activation checkpointing; FSDP vs DDP.
#   D: the split balanced with the fused loss (18/18): 1F1B 4 x 4 and 8 x 2, interleaved v=2 and v=3 at 4
#      microbatches and v=2 at 8; the seed and DDP baselines of the same run.
#   E: long context with and without activation checkpointing; interleaved v=3 and v=6 at 4 microbatches
#      with the split that weighs the fused loss as measured in D; the seed and DDP baselines.
#   F: NCCL's point-to-point channels (NCCL_MAX_P2P_NCHANNELS): interleaved v=3 at NCCL's default, 4 and 1,
#      1F1B at 4. The interleaved runtime posts each receive early, and a waiting receive kernel holds one SM
#      per channel while the stage computes (NCCL's channel counts are printed from its INIT log).
#   G: after F's capped runs trained on corrupted gradients: the same cap once stages send copies of their
#      outputs and input gradients instead of CUDA-graph pool memory; the default cap as control; the seed and
#      DDP baselines. No validation (its forward-only graphs are not timed and cost a minute per run).
#   H: the cap as a setting (parallel.p2p_channels = 1): interleaved v=3 with the seed and DDP baselines of the
#      same run; the plain path (PEFT eager, NCCL's channels) on the same schedule for the loss curve; 1F1B at 1.
#   I: interleaved v=3 at 2 channels (one run: what was left of the session's device time).
# Usage (device machine, repo root): OUT=dir bash benchmarks/journal/scripts/run_speed_h200.sh A|B|C|D|E|F|G|H|I
# Each part ran at the commit named in benchmarks/journal/2026-11-29-speed-h200.md; the bench config has changed since
# (parallel.p2p_channels = 1 after part H), so an earlier part rerun here is not the same run.
source benchmarks/h200_common.sh
PART=${1:-A}; W=/tmp/speed$PART; mkdir -p $W
START=$(date +%s); BUDGET=${BUDGET:-560}
left() { echo $((BUDGET - $(date +%s) + START)); }
bench() {  # name, timeout, args...: skipped when the part's budget cannot hold it
  local name=$1 limit=$2; shift 2
  if [ "$(left)" -lt "$limit" ]; then limit=$(left); fi
  if [ "$limit" -lt 40 ]; then echo "== $name: skipped, $(left) s left"; return; fi
  echo "== $name ($(date +%T), limit $limit s): $*"
  timeout "$limit" python3 -m pipetune bench --config $CFG --out $W/$name "$@" > $W/$name.log 2>&1
  grep -v -i warn $W/$name.log | tail -8
}
CG="--set train.cuda_graphs=true --set train.fused_loss=true"
# Long context: eager fast path (8192-token microbatches: large matmuls, GPU-bound), fused loss.
LONG="--set data.max_length=8192 --set data.max_summary_tokens=1024 --set data.synthetic_train=64 \
  --set train.batch_size=4 --set parallel.n_microbatches=4 --set train.fused_loss=true --set train.compile=false \
  --set train.cuda_graphs=false"
if [ "$PART" = A ]; then  # first call (fused loss then ran the head on every token)
  bench graphs 170 --strategies pp --steps 20 --warmup 6 $CG
  bench compiled 130 --strategies pp --steps 20 --warmup 4 --set train.fused_loss=true
  OPT=$CG; [ -f $W/graphs/bench.json ] && grep -q tokens_per_sec $W/graphs/bench.json || OPT="--set train.fused_loss=true"
  baselines 12 120 100
  bench interleaved-v2 130 --strategies pp --steps 20 --warmup 6 $OPT \
    --set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=2
  bench m8 130 --strategies pp --steps 20 --warmup 6 $OPT --set parallel.n_microbatches=8
  bench interleaved-v3 130 --strategies pp --steps 20 --warmup 6 $OPT \
    --set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=3
elif [ "$PART" = B ]; then  # fused loss on supervised rows only; plain loss curve at the same step count
  bench graphs 170 --strategies pp --steps 10 --warmup 6 $CG
  baselines 8 120 100
  bench interleaved-v2 130 --strategies pp --steps 10 --warmup 6 $CG \
    --set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=2
  bench curve-plain 100 --strategies pp --steps 10 --warmup 6 --set lora.fast_path=false --set train.compile=false
  bench long 80 --strategies pp --steps 2 --warmup 1 $LONG
  bench long-ckpt 80 --strategies pp --steps 2 --warmup 1 $LONG --set train.activation_checkpointing=true
  bench m8 130 --strategies pp --steps 10 --warmup 6 $CG --set parallel.n_microbatches=8
elif [ "$PART" = D ]; then  # the 18/18 split; microbatch count and virtual stages, all with every switch on
  bench graphs 170 --strategies pp --steps 10 --warmup 5 $CG
  baselines 6 100 100
  bench m8 130 --strategies pp --steps 10 --warmup 5 $CG --set parallel.n_microbatches=8
  bench interleaved-v2 130 --strategies pp --steps 10 --warmup 5 $CG \
    --set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=2
  bench interleaved-v3 130 --strategies pp --steps 10 --warmup 5 $CG \
    --set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=3
  bench interleaved-v2-m8 130 --strategies pp --steps 10 --warmup 5 $CG --set parallel.n_microbatches=8 \
    --set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=2
elif [ "$PART" = E ]; then
  bench long 110 --strategies pp --steps 2 --warmup 1 $LONG
  bench long-ckpt 110 --strategies pp --steps 2 --warmup 1 $LONG --set train.activation_checkpointing=true
  baselines 6 100 100
  bench interleaved-v3 160 --strategies pp --steps 10 --warmup 5 $CG \
    --set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=3
  bench interleaved-v6 130 --strategies pp --steps 10 --warmup 5 $CG \
    --set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=6
elif [ "$PART" = F ]; then
  V3="--set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=3"
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT bench interleaved-v3 180 --strategies pp --steps 10 --warmup 5 $CG $V3
  grep -h -o "[0-9]* coll channels.*p2p channels per peer" $W/interleaved-v3.log | sort | uniq -c
  export NCCL_MAX_P2P_NCHANNELS=4
  bench interleaved-v3-p2p4 120 --strategies pp --steps 10 --warmup 5 $CG $V3
  bench 1f1b-p2p4 110 --strategies pp --steps 10 --warmup 5 $CG
  export NCCL_MAX_P2P_NCHANNELS=1
  bench interleaved-v3-p2p1 120 --strategies pp --steps 10 --warmup 5 $CG $V3
  unset NCCL_MAX_P2P_NCHANNELS
elif [ "$PART" = G ]; then
  V3="--set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=3 --set data.synthetic_validation=0"
  NCCL_MAX_P2P_NCHANNELS=1 bench interleaved-v3-p2p1 200 --strategies pp --steps 10 --warmup 5 $CG $V3
  baselines 6 100 100
  bench interleaved-v3 140 --strategies pp --steps 10 --warmup 5 $CG $V3
elif [ "$PART" = H ]; then
  V3="--set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=3 --set data.synthetic_validation=0"
  bench interleaved-v3-p2p1 200 --strategies pp --steps 10 --warmup 5 $CG $V3 --set parallel.p2p_channels=1
  baselines 6 100 100
  bench curve-plain-v3 110 --strategies pp --steps 10 --warmup 5 $V3 --set lora.fast_path=false \
    --set train.compile=false --set train.cuda_graphs=false --set train.fused_loss=false
  bench 1f1b-p2p1 120 --strategies pp --steps 10 --warmup 5 $CG --set data.synthetic_validation=0 \
    --set parallel.p2p_channels=1
elif [ "$PART" = I ]; then
  bench interleaved-v3-p2p2 230 --strategies pp --steps 10 --warmup 5 $CG --set parallel.p2p_channels=2 \
    --set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=3 --set data.synthetic_validation=0
else  # C: long context, eager fast path (large matmuls: GPU-bound), with and without checkpointing; FSDP vs DDP
  bench long 110 --strategies pp --steps 3 --warmup 1 $LONG
  bench long-ckpt 110 --strategies pp --steps 3 --warmup 1 $LONG --set train.activation_checkpointing=true
  bench fsdp 170 --strategies ddp,fsdp --steps 8 --warmup 3 --set train.compile=false --set train.cuda_graphs=false
fi
python3 - "$W" "$OUT" "$PART" <<'PY'
import json, pathlib, shutil, sys, tarfile
w, out, part = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
merged = {b.parent.name: json.loads(b.read_text()) for b in sorted(w.glob("*/bench.json"))}
(out / f"bench_{part}.json").write_text(json.dumps(merged, indent=1))
with tarfile.open(out / f"runs_{part}.tar.gz", "w:gz") as tar:
    for f in sorted(w.rglob("*")):
        if f.is_file() and (f.suffix in (".png", ".csv", ".log", ".toml") or f.name == "timeline.json"):
            tar.add(f, arcname=str(f.relative_to(w)))
PY
echo "part $PART done in $(( $(date +%s) - START )) s"
