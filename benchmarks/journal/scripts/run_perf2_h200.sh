#!/usr/bin/env bash
# Second performance run on 2x H200: balance (18/18 vs the cost model's 20/16), microbatch count with
# profiles of the recorded step, and the seed and DDP baselines again in the same run.
# Usage (device machine, repo root): OUT=dir bash benchmarks/journal/scripts/run_perf2_h200.sh
source benchmarks/h200_common.sh
W=/tmp/perf; mkdir -p $W
BEFORE="--set train.cuda_graphs=false --set train.fused_loss=false"  # the config's switches then
bench() {  # name, extra args...
  local name=$1; shift
  echo "== $name: $*"
  timeout 200 python3 -m pipetune bench --config $CFG $BEFORE --out $W/$name "$@" > $W/$name.log 2>&1
  grep -c "Recompiling function" $W/$name.log | sed 's/^/recompiles: /'
  grep -E -A14 "profile of step [0-9]+ by self_cpu" $W/$name.log | head -40
  grep -v -i -E "warn|profile|^-|aten|cuda|Memcpy|Memset|c10d|Self CPU|USDT|nccl|void|triton|^$|autograd|Name|ampere|sm90|cutlass|Kernel|kernel|gemm|flash" $W/$name.log | tail -12
}
baselines 12 200 150
bench balanced18 --strategies pp --steps 20 --warmup 4 --set "parallel.layers_per_stage=[18,18]"
PIPETUNE_PROFILE_STEP=5 TORCH_LOGS=recompiles bench m8-profile --strategies pp --steps 12 --warmup 4 --set parallel.n_microbatches=8
PIPETUNE_PROFILE_STEP=5 bench m4-profile --strategies pp --steps 12 --warmup 4
python3 - "$W" "$OUT" <<'PY'
import json, pathlib, shutil, sys
w, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
merged = {b.parent.name: json.loads(b.read_text()) for b in sorted(w.glob("*/bench.json"))}
(out / "bench_all.json").write_text(json.dumps(merged, indent=1))
for name in ("balanced18", "m8-profile"):
    if (w / name / "pp/timeline.png").is_file(): shutil.copy(w / name / "pp/timeline.png", out / f"timeline_{name}.png")
for name in ("m8-profile", "m4-profile"):
    if (w / f"{name}.log").is_file(): shutil.copy(w / f"{name}.log", out / f"{name}.log")
if (w / "seed.csv").is_file(): shutil.copy(w / "seed.csv", out / "seed.csv")
PY
