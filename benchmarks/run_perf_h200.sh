#!/usr/bin/env bash
# Performance run on 2x H200: pipetune variants through `pipetune bench`, and the seed and DDP
# baselines in the same run. Usage (device machine, repo root): OUT=dir bash benchmarks/run_perf_h200.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src PIPETUNE_CACHE=/tmp/pipetune-cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=/tmp/perf; mkdir -p $W
CFG=configs/bench-qwen3-4b.toml
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"; } > "$OUT/env.txt" 2>&1
bench() {  # name, extra args...
  local name=$1; shift
  echo "== $name: $*"
  timeout 240 python3 -m pipetune bench --config $CFG --out $W/$name "$@" 2>&1 | grep -v -i warn | tail -12
}
bench optimized --strategies pp,single --steps 20 --warmup 4
bench optimized-m8 --strategies pp --steps 20 --warmup 4 --set parallel.n_microbatches=8
bench eager-fast --strategies pp --steps 10 --warmup 2 --set train.compile=false
bench plain --strategies pp --steps 10 --warmup 2 --set train.compile=false --set lora.fast_path=false \
  --set train.batch_size=8 --set parallel.n_microbatches=8 --set train.grad_accum=2
echo "== seed script (batch 8, 8 microbatches, grad accum 2)"
(cd $W && MAX_STEPS=12 LOG_FILE=$W/seed.csv timeout 200 torchrun --nproc_per_node=2 $OLDPWD/.baselines/train_seed.py 2>&1 | tail -4)
echo "== DDP + PEFT eager, micro-batch 8"
(cd $W && MB=8 GA=1 MAX_STEPS=20 timeout 150 torchrun --nproc_per_node=2 $OLDPWD/.baselines/lora_ddp.py 2>&1 | grep -E "RESULT|rror" | tail -3)
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
