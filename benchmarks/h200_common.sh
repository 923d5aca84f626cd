# Sourced by benchmarks/device.sh (and the older benchmarks/journal/scripts/run_*_h200.sh) on the device machine,
# from the repo root: the environment, $OUT/env.txt (date, GPUs, library versions), $B4 / $B72 / $CFG, `quant`,
# `baselines`, and for the scripts that run `pipetune bench` in a time budget `left`, `bench` and `collect` (they
# need $W, the work directory, and $BUDGET, seconds). With DRY_RUN=1 nothing is installed, written or run: `bench`
# and `baselines` print the commands they would run.
set -uo pipefail
DRY_RUN=${DRY_RUN:-0}
# Wheels the device image lacks (torchao, gguf, rouge-score), when carried in .whl/.
if [ "$DRY_RUN" != 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# A CPU dry run's switches (TINY=1): the tiny model in float32, eager, a little data.
TINY_ARGS="--set model.name=\"tiny-qwen3\" --set model.dtype=\"float32\" --set train.compile=false \
  --set train.cuda_graphs=false --set data.synthetic_train=64"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PIPETUNE_CACHE=/tmp/pipetune-cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; [ "$DRY_RUN" = 1 ] || mkdir -p "$OUT"
# The compile cache (inductor's FX graphs and Triton kernels, autotuning included): a fresh machine compiles every
# kernel in the first runs (Qwen3-4B pp v=3: > 175 s to its first step). A cache an earlier call brought back
# (collect writes $OUT/inductor-cache.tar.gz when it is under 15 MB; keep it as .carry/inductor-cache.tar.gz
# and carry .carry) is unpacked first.
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache TRITON_CACHE_DIR=/tmp/inductor-cache/triton
[ "$DRY_RUN" = 1 ] || mkdir -p $TORCHINDUCTOR_CACHE_DIR
[ "$DRY_RUN" != 1 ] && [ -f .carry/inductor-cache.tar.gz ] && tar xzf .carry/inductor-cache.tar.gz -C $TORCHINDUCTOR_CACHE_DIR && \
  echo "compile cache: $(du -sh $TORCHINDUCTOR_CACHE_DIR | cut -f1) unpacked from .carry/inductor-cache.tar.gz"
B4=configs/bench-qwen3-4b.toml; B72=configs/bench-qwen2.5-72b.toml; CFG=$B4  # the bench configs
quant() { echo "--set model.quantize=\"$1\""; }  # model.quantize as a bench argument
[ "$DRY_RUN" = 1 ] || { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"; } > "$OUT/env.txt" 2>&1
baselines() {  # seed steps, seed timeout s, DDP timeout s[, 1: DDP + PEFT compiled per layer]: the seed script and
  # DDP + PEFT (micro-batch 8, eager unless compiled), in this run
  if [ "$DRY_RUN" = 1 ]; then
    echo "MAX_STEPS=$1 timeout $2 torchrun --nproc_per_node=2 .baselines/train_seed.py"
    echo "MB=8 GA=1 MAX_STEPS=20 COMPILE=${4:-0} timeout $3 torchrun --nproc_per_node=2 .baselines/lora_ddp.py"
    return
  fi
  echo "== seed script (batch 8, 8 microbatches, grad accum 2) ($(date +%T))"
  (cd $W && MAX_STEPS=$1 LOG_FILE=$W/seed.csv timeout $2 torchrun --nproc_per_node=2 $OLDPWD/.baselines/train_seed.py 2>&1 | tail -3)
  echo "== DDP + PEFT, micro-batch 8, compile ${4:-0} ($(date +%T))"
  (cd $W && MB=8 GA=1 MAX_STEPS=20 COMPILE=${4:-0} timeout $3 torchrun --nproc_per_node=2 $OLDPWD/.baselines/lora_ddp.py 2>&1 | grep -E "RESULT|rror" | tail -3)
}
START=$(date +%s)
left() {  # seconds of the call's budget left; a dry run spends none (its output must not depend on the clock)
  if [ "$DRY_RUN" = 1 ]; then echo "${BUDGET:-570}"; else echo $((${BUDGET:-570} - $(date +%s) + START)); fi
}
bench() {  # name, timeout s, config, args... (then $BENCH_ARGS): one `pipetune bench` into $W/name, skipped when the
  # budget cannot hold it; the bench's own --timeout ends a strategy that stalls
  local name=$1 limit=$2 config=$3; shift 3
  if [ "$(left)" -lt "$limit" ]; then limit=$(left); fi
  if [ "$limit" -lt 60 ]; then echo "== $name: skipped, $(left) s left"; return; fi
  if [ "$DRY_RUN" = 1 ]; then
    echo python3 -m pipetune bench --config $config --out $W/$name --timeout $((limit - 15)) "$@" ${BENCH_ARGS:-}
    return
  fi
  echo "== $name ($(date +%T), limit $limit s): $*"
  python3 -m pipetune bench --config $config --out $W/$name --timeout $((limit - 15)) "$@" ${BENCH_ARGS:-} 2>&1 | \
    grep -v -i warn | tee $W/$name.out "$OUT/$name.out" | grep -E "^bench: .*(ready|step 1/|timed step 1 |done|timed out|exit code)|│|┃|error"
  # its output (above) and its JSON kept in $OUT at once: a call the device stops at its limit never reaches `collect`
  cp $W/$name/bench.json "$OUT/bench-$name.json" 2>/dev/null
  return 0
}
collect() {  # tag: every bench.json under $W merged into $OUT/bench_<tag>.json and printed as a table; the runs'
  # small files (metrics, logs, configs, timelines, charts) and the steps' files in $OUT (under out/) in
  # $OUT/runs_<tag>.tar.gz, so that a call returns three files (a call returns at most 8); the compile cache
  tar czf /tmp/inductor-cache.tar.gz -C $TORCHINDUCTOR_CACHE_DIR . 2>/dev/null && \
    [ "$(stat -c %s /tmp/inductor-cache.tar.gz)" -lt 15000000 ] && cp /tmp/inductor-cache.tar.gz "$OUT/" && \
    echo "compile cache: $OUT/inductor-cache.tar.gz ($(du -h /tmp/inductor-cache.tar.gz | cut -f1))"
  python3 - "$W" "$OUT" "$1" <<'PY'
import json, pathlib, sys, tarfile
w, out, tag = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
merged = {b.parent.name: json.loads(b.read_text()) for b in sorted(w.glob("*/bench.json"))}
(out / f"bench_{tag}.json").write_text(json.dumps(merged, indent=1))
print(f"{'run':<18} {'tokens/s':>9} {'MFU':>6} {'waited':>6}  peak GB per rank")
for name, rows in merged.items():
    for r in rows:
        if "error" in r:
            print(f"{name:<18} {r['error'][:300]}")
        else:
            peaks = " / ".join(f"{g:.1f}" for g in r["peak_gb_per_rank"])
            waited = f"{r['host_wait_frac']:>6.1%}" if "host_wait_frac" in r else " " * 6
            print(f"{name:<18} {r['tokens_per_sec']:>9,.0f} {r['mfu']:>6.1%} {waited}  {peaks}")
kept = {f"bench_{tag}.json", f"runs_{tag}.tar.gz", "inductor-cache.tar.gz"}
folded = [f for f in sorted(out.iterdir()) if f.is_file() and f.name not in kept and f.stat().st_size < 5e6]
with tarfile.open(out / f"runs_{tag}.tar.gz", "w:gz") as tar:
    for f in sorted(w.rglob("*")):
        if f.is_file() and f.stat().st_size < 5e6 and (
            f.suffix in (".png", ".csv", ".log", ".toml", ".out", ".jsonl", ".txt") or f.name == "timeline.json"
        ):
            tar.add(f, arcname=str(f.relative_to(w)))
    for f in folded:  # the steps' own files in $OUT: a call returns at most 8 files
        tar.add(f, arcname=f"out/{f.name}")
for f in folded:
    f.unlink()
print(f"{len(folded)} files of {out} folded into runs_{tag}.tar.gz (out/): {' '.join(f.name for f in folded)}")
PY
}
