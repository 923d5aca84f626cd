#!/usr/bin/env bash
# Performance run on 2x H200: pipetune variants through `pipetune bench`, and the seed and DDP
# baselines in the same run. Usage (device machine, repo root): OUT=dir bash benchmarks/journal/scripts/run_perf_h200.sh
source benchmarks/h200_common.sh
W=/tmp/perf; mkdir -p $W
BEFORE="--set train.cuda_graphs=false --set train.fused_loss=false"  # the config's switches then
bench() {  # name, extra args...
  local name=$1; shift
  echo "== $name: $*"
  timeout 240 python3 -m pipetune bench --config $CFG $BEFORE --out $W/$name "$@" 2>&1 | grep -v -i warn | tail -12
}
bench optimized --strategies pp,single --steps 20 --warmup 4
bench optimized-m8 --strategies pp --steps 20 --warmup 4 --set parallel.n_microbatches=8
bench eager-fast --strategies pp --steps 10 --warmup 2 --set train.compile=false
bench plain --strategies pp --steps 10 --warmup 2 --set train.compile=false --set lora.fast_path=false \
  --set train.batch_size=8 --set parallel.n_microbatches=8 --set train.grad_accum=2
baselines 12 200 150
python3 - "$W" "$OUT" <<'PY'
import json, pathlib, shutil, sys
w, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
merged = {}
for b in sorted(w.glob("*/bench.json")):
    merged[b.parent.name] = json.loads(b.read_text())
(out / "bench_all.json").write_text(json.dumps(merged, indent=1))
for name in ("optimized", "plain"):
    for src, dst in ((f"{name}/pp/timeline.png", f"timeline_{name}.png"), (f"{name}/pp/metrics.csv", f"metrics_{name}.csv")):
        if (w / src).is_file(): shutil.copy(w / src, out / dst)
if (w / "seed.csv").is_file(): shutil.copy(w / "seed.csv", out / "seed.csv")
PY
