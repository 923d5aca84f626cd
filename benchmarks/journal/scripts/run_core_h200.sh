#!/usr/bin/env bash
# Core correctness run on 2x H200 (NCCL): the demo, the seed job's shape with random weights,
# the seed script itself (same machine, same run), and per-stage vs full-model load memory.
# Usage (on the device machine, repo root): OUT=dir bash benchmarks/journal/scripts/run_core_h200.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src PIPETUNE_CACHE=/tmp/pipetune-cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=/tmp/work; mkdir -p $W
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} > "$OUT/env.txt" 2>&1

echo "== demo"; python3 -m pipetune demo --out $W/demo && cp $W/demo/metrics.csv "$OUT/demo_metrics.csv"

echo "== pipetune qwen3-4b random, pp=2 1f1b, 20 steps"
python3 -m pipetune train --config configs/qwen3-4b-ami.toml --set model.name=qwen3-4b --set model.init=random \
  --set data.source=synthetic --set train.max_steps=20 --set output.dir=$W/pp2 \
  && cp $W/pp2/metrics.csv "$OUT/pp2_metrics.csv"

echo "== seed script, same shape, 20 steps"
(cd $W && MAX_STEPS=20 LOG_FILE=$W/seed.csv torchrun --nproc_per_node=2 $OLDPWD/.baselines/train_seed.py 2>&1 | tail -25) \
  && cp $W/seed.csv "$OUT/seed_metrics.csv"

echo "== load memory"
python3 benchmarks/tools/load_memory.py write $W/ckpt-4b --shape qwen3-4b && \
python3 benchmarks/tools/load_memory.py measure $W/ckpt-4b --pp 2 --out "$OUT/load_memory.json"
