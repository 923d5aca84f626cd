#!/usr/bin/env bash
# Device check of checkpoint/resume on NCCL: exact kill-and-resume (tiny, float32), checkpoint cost at Qwen3-4B shape (bf16, random weights).
# Run from the repository root: bash benchmarks/journal/scripts/run_resume_h200.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src PIPETUNE_CACHE=/tmp/ptcache HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
python -c "import torch,transformers,peft;print(torch.__version__,transformers.__version__,peft.__version__)"
python - <<'PY'
from pathlib import Path
from pipetune.config import Config, apply_override, save_config
def cfg(name, *extra):
    c = Config()
    for item in ('model.name="tiny-qwen3"','model.dtype="float32"','model.init="random"','data.source="synthetic"','data.max_length=128','data.max_summary_tokens=32','data.synthetic_train=32','data.synthetic_validation=8','lora.dropout=0.1','train.epochs=2','train.max_steps=-1','train.batch_size=4','train.grad_accum=2','train.lr=1e-3','train.save_every=3','parallel.pp=2','parallel.n_microbatches=4',f'output.dir="/tmp/g/{name}"',*extra):
        apply_override(c, item)
    save_config(c, f"/tmp/g/{name}.toml")
Path("/tmp/g").mkdir()
cfg("ref"); cfg("kill")
cfg("big",'model.name="qwen3-4b"','model.dtype="bfloat16"','data.max_length=512','data.max_summary_tokens=128','data.synthetic_train=64','train.batch_size=8','parallel.n_microbatches=8','train.max_steps=4','train.save_every=2','train.epochs=1')
PY
python -m pipetune train --config /tmp/g/ref.toml --quiet 2>&1 | grep -v warn
PIPETUNE_TEST_KILL_AT_STEP=6 python -m tests.faults train --config /tmp/g/kill.toml --quiet 2>&1 | grep "pipetune:"
python -m pipetune train --config /tmp/g/kill.toml --resume 2>&1 | grep -i "resumed\|error"
diff <(cut -d, -f2-4 /tmp/g/ref/metrics.csv) <(cut -d, -f2-4 /tmp/g/kill/metrics.csv) && echo LOSSES_SAME
cmp /tmp/g/ref/adapter/adapter_model.safetensors /tmp/g/kill/adapter/adapter_model.safetensors && echo ADAPTER_SAME
cut -d, -f2-4 /tmp/g/ref/metrics.csv
python -m pipetune train --config /tmp/g/big.toml 2>&1 | grep -i "checkpoint\|step \|error\|Traceback" 
du -sh /tmp/g/big/checkpoints/*
