# Sourced by benchmarks/run_*_h200.sh on the device machine, from the repo root: the environment,
# $OUT/env.txt (date, GPUs, library versions), $CFG, and `baselines` (needs $W, the work directory).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PIPETUNE_CACHE=/tmp/pipetune-cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CFG=configs/bench-qwen3-4b.toml
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"; } > "$OUT/env.txt" 2>&1
baselines() {  # seed steps, seed timeout s, DDP timeout s: the seed script and DDP + PEFT eager, in this run
  echo "== seed script (batch 8, 8 microbatches, grad accum 2) ($(date +%T))"
  (cd $W && MAX_STEPS=$1 LOG_FILE=$W/seed.csv timeout $2 torchrun --nproc_per_node=2 $OLDPWD/.baselines/train_seed.py 2>&1 | tail -3)
  echo "== DDP + PEFT eager, micro-batch 8 ($(date +%T))"
  (cd $W && MB=8 GA=1 MAX_STEPS=20 timeout $3 torchrun --nproc_per_node=2 $OLDPWD/.baselines/lora_ddp.py 2>&1 | grep -E "RESULT|rror" | tail -3)
}
