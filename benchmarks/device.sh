#!/usr/bin/env bash
# One device call: the steps named on the command line, in order, within a time budget, under the environment
# every device run needs (benchmarks/h200_common.sh: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NVSHMEM_DISABLE_NVLS=1, the wheels carried in .whl/, $OUT/env.txt, the compile cache carried in .carry/); each
# bench's output and JSON are copied to $OUT/NAME.out and $OUT/bench-NAME.json as soon as it ends; at the end every
# bench.json is merged into $OUT/bench_<tag>.json (printed as a table) and the runs' small files go to
# $OUT/runs_<tag>.tar.gz.
#
#   OUT=dir bash benchmarks/device.sh [--budget S] [--tag TAG] [--tiny] [--dry-run] STEP [:: STEP ...]
#
#   --budget S   seconds the call may take (default 540); a bench step is cut to what is left, skipped under 60 s
#   --tag TAG    names the work directory /tmp/device-TAG and the collected files (default: device)
#   --tiny       a CPU rehearsal: every bench on the tiny model in float32, eager, 1 warm-up + 1 timed step;
#                baselines skipped (they need GPUs)
#   --dry-run    print each step's command and run nothing (no install, no files)
#
# A STEP is one of
#   bench NAME LIMIT CONFIG [ARGS...]   `pipetune bench --config CONFIG --out {W}/NAME --timeout LIMIT-15 ARGS`.
#              CONFIG: 4b (configs/bench-qwen3-4b.toml), 32b (the same with model.name = "qwen3-32b", no
#              validation split), 72b (configs/bench-qwen2.5-72b.toml), or a TOML path. `--quant Q` among ARGS is
#              `--set model.quantize="Q"`.
#   tool NAME [ARGS...]   python3 benchmarks/tools/NAME.py ARGS, its output also in $OUT/NAME.txt.
#   baselines SEED_STEPS SEED_TIMEOUT DDP_TIMEOUT [COMPILE]   the seed script and DDP + PEFT on 2 GPUs
#              (.baselines/train_seed.py, .baselines/lora_ddp.py: carry .baselines).
#   peers STACK LIMIT SHAPE [ARGS...]   a one-GPU peer of ../shared/baselines/peers (unsloth, hf, liger,
#              liger_compile; carry that folder as .peers) on SHAPE (qwen3-4b, qwen3-8b), e.g. `peers unsloth 200
#              qwen3-4b --seq 512 --mb 8 --ga 2 --steps 8 --warmup 3 --unsloth-gc false`; JSON in $OUT/peers-STACK.json.
#              With `--docs F` among ARGS (a packer's rows, .peers/doc_lengths.py) it runs .peers/peers_packed.py
#              (`--mode packed`: Unsloth's own padding-free packing); JSON in $OUT/peers-STACK-packed.json. A bench
#              takes the config's epoch-0 rows in order, R a step, so `--warmup W*R --steps N*R` times exactly the
#              rows of `bench ... --warmup W --steps N` (the whole-meeting config: R = 16): the same rows, to the
#              token, which a ratio needs (moving each to the epoch's rows by FLOPs added 0.7-1.6% to pipetune's).
#   sh COMMAND...   any shell command (a `pipetune train` or `demo`, a peer script under torchrun, a grep).
# A step may begin with VAR=value words, its own environment (PIPETUNE_PROFILE_STEP=6, CUDA_VISIBLE_DEVICES=1;
# PYTHONPATH=DIR is put first on the path: the code of an older commit, e.g. .baselines/pipetune-7da8567/src).
# In every word {W} is the work directory and {OUT} the output directory.
#
# What each older script in benchmarks/journal/scripts/ ran, as one call of this one (their first call or part;
# the others differ in their steps only; `A="--set ..."` stands for a shell variable of the example):
#   run_core:      sh 'python3 -m pipetune demo --out {W}/demo' :: sh 'python3 -m pipetune train --config
#                  configs/qwen3-4b-ami.toml --set model.init=random --set model.name=qwen3-4b --set train.max_steps=20
#                  --set output.dir={W}/pp2' :: sh 'MAX_STEPS=20 LOG_FILE={W}/seed.csv torchrun --nproc_per_node=2
#                  .baselines/train_seed.py' :: tool load_memory write {W}/ckpt --shape qwen3-4b :: tool load_memory
#                  measure {W}/ckpt --pp 2 --out {OUT}/load_memory.json
#   run_perf(2):   bench optimized 240 4b --strategies pp,single --steps 20 --warmup 4 :: bench plain 240 4b
#                  --strategies pp --steps 10 --warmup 2 --set train.compile=false --set lora.fast_path=false
#                  :: baselines 12 200 150
#   run_speed A-I: bench interleaved-v3 240 4b --strategies pp --steps 10 --warmup 5
#                  --set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=3 --set parallel.p2p_channels=1
#   run_resume:    sh 'PIPETUNE_TEST_KILL_AT_STEP=6 python3 -m tests.faults train --config C.toml' :: sh 'python3 -m
#                  pipetune train --config C.toml --resume' (its configs written first by a `sh 'python3 - <<PY'`)
#   run_big:       bench pp-1f1b 170 72b --strategies pp --steps 4 --warmup 2 :: bench fsdp 170 72b --strategies fsdp
#                  --steps 4 --warmup 2 --set parallel.dp=2 --set train.batch_size=2 --set train.grad_accum=4 ::
#                  sh 'cd {W} && CONFIG=qwen2.5-72b MB=2 GA=4 torchrun --nproc_per_node=2 ../.baselines/fsdp2_lora.py'
#   run_tp:        bench 4b-tp 200 4b --strategies tp --steps 8 --warmup 4 --set parallel.pp=1 --set parallel.tp=2
#   run_quant A-E: bench 72b-pp-nf4 180 72b --strategies pp --steps 4 --warmup 2 --quant nf4 ::
#                  tool quant_quality {W}/quality --steps 150 --methods none,nf4
#   run_wave2:     bench 4b-pp 110 4b --strategies pp --steps 8 --warmup 4 :: bench 72b-pp-fp8 110 72b --strategies
#                  pp --steps 4 --warmup 2 --quant fp8 :: CUDA_VISIBLE_DEVICES=1 tool smollm2_rouge --model
#                  .whl/smollm2-135m --out {OUT}/smollm2
#   run_wave3:     bench 72b-tp 150 72b --strategies tp --steps 4 --warmup 2 :: sh 'python3 -m pipetune plan --config
#                  configs/bench-qwen3-4b.toml --gpus 2 --calibrate' :: tool layer_levers --config
#                  configs/bench-qwen3-4b.toml --microbatch 8 --out {OUT}/layer-levers.json
#   run_wave4:     bench 32b-pp 140 32b --strategies pp --steps 4 --warmup 2 --set parallel.n_microbatches=8 ::
#                  bench 4b-curve-nf4 120 4b --strategies ddp --steps 96 --warmup 4 --quant nf4 :: tool
#                  plot_loss_curves {OUT}/loss_curves_4b.png nf4={W}/4b-curve-nf4/ddp/metrics.csv
#   run_wave5:     PIPETUNE_PROFILE_STEP=8 PIPETUNE_PROFILE_TRACE={W}/trace bench 4b-ddp-shared 120 4b --strategies
#                  ddp --steps 10 --warmup 4 --set lora.shared_dropout=true :: tool trace_gaps {W}/trace/trace-rank0.json.gz
#   run_wave6:     bench 72b-single-nf4-pick 170 72b --strategies single --steps 3 --warmup 2 --quant nf4 --set
#                  parallel.pp=1 --set parallel.n_microbatches=1 --set train.batch_size=4 --set train.grad_accum=2
#   run_wave8:     bench 4b-pp-v3 200 4b --strategies pp --steps 6 --warmup 4 $V3 :: bench 4b-ddp-shared 80 4b
#                  --strategies ddp --steps 6 --warmup 4 --set lora.shared_dropout=true :: sh 'OUT={W}/calib python3
#                  benchmarks/tools/plan_calibrate.py --budget 300'
#   run_wave9:     PYTHONPATH=.baselines/pipetune-7da8567/src bench a1-old-rows1 150 4b --strategies single --steps 20
#                  --warmup 5 $ONE8 :: bench b1-new-rows5 90 4b --strategies single --steps 20 --warmup 5 $ONE8
#   run_wave10:    bench 4b-ddp32 90 4b --strategies ddp --steps 6 --warmup 4 --set lora.shared_dropout=true
#                  --set train.batch_size=32 :: baselines 20 100 90 1 :: sh 'OUT={W}/calib python3
#                  benchmarks/tools/plan_calibrate.py --only tp=2 --budget 170'
#   run_wave10_one: bench k1-a 120 4b --strategies single --steps 20 --warmup 5 $ONE8 --set train.layers_per_graph=1
#                  :: bench k4 150 4b --strategies single --steps 20 --warmup 5 $ONE8 --set train.layers_per_graph=4
#   run_exit_check: sh 'python3 -m pipetune bench --config configs/demo.toml --out {W}/bench --strategies single
#                  --steps 10 --warmup 3'
# with ONE8="--set parallel.pp=1 --set parallel.n_microbatches=1 --set train.batch_size=8 --set lora.shared_dropout=true"
# and V3="--set parallel.schedule=interleaved_1f1b --set parallel.stages_per_rank=3".
#
# Example (device machine, repo root, .whl carried): the 4B shape as ddp and as a v=4 pipeline, then the baselines:
#   OUT=out bash benchmarks/device.sh --tag 4b --budget 540 bench 4b-ddp 90 4b --strategies ddp --steps 6 --warmup 4 \
#     :: bench 4b-pp-v4 180 4b --strategies pp --steps 6 --warmup 4 --set parallel.schedule=interleaved_1f1b \
#        --set parallel.stages_per_rank=4 :: baselines 20 100 90 1
set -uo pipefail
BUDGET=540 TAG=device TINY=0 DRY_RUN=0
while [ $# -gt 0 ]; do
  case $1 in
    --budget) BUDGET=$2; shift 2 ;;
    --tag) TAG=$2; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    --*) echo "benchmarks/device.sh: error: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [ $# -eq 0 ]; then echo "benchmarks/device.sh: error: no step given (see --help)" >&2; exit 2; fi
export BUDGET DRY_RUN
source benchmarks/h200_common.sh
W=/tmp/device-$TAG
[ "$DRY_RUN" = 1 ] || { rm -rf "$W"; mkdir -p "$W"; }
BENCH_ARGS=""
[ "$TINY" = 1 ] && BENCH_ARGS="$TINY_ARGS --steps 1 --warmup 1"

peers() {  # STACK LIMIT SHAPE [ARGS...]: one one-GPU peer (.peers/peers_1gpu.py, carried from the baselines'
  # peers/ folder with its wheels) on a random-weight model of SHAPE (.peers/configs/SHAPE); its JSON in
  # $OUT/peers-STACK.json. The peers' wheels go to their own folder, so they never shadow pipetune's.
  local stack=$1 limit=$2 shape=$3 model=/tmp/peers-$3 script=peers_1gpu.py name=$1; shift 3
  [[ " $* " == *" --docs "* ]] && { script=peers_packed.py; name=$stack-packed; }  # a packer's rows (--docs F)
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  local run="python3 .peers/$script --stack $stack --config-dir $model $* --out $OUT/peers-$name.json"
  if [ "$DRY_RUN" = 1 ]; then echo "$run"; return; fi
  if [ "$limit" -lt 45 ]; then echo "== peers $stack: skipped, $(left) s left"; return; fi
  [ -d /tmp/site-peers ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site-peers .peers/wheels/*.whl
  export PYTHONPATH=/tmp/site-peers:$PYTHONPATH UNSLOTH_DISABLE_STATISTICS=1 TRANSFORMERS_OFFLINE=1
  if [ ! -f "$model/model.safetensors" ] && [ ! -f "$model/model.safetensors.index.json" ]; then
    mkdir -p "$model" && cp ".peers/configs/$shape/config.json" "$model/"
    (cd /tmp && timeout 180 python3 "$OLDPWD/.peers/peers_1gpu.py" --make-weights --config-dir "$model" 2>&1 | tail -2)
  fi
  echo "== peers $stack ($(date +%T), limit $limit s): $*"
  (cd /tmp && timeout -k 15 "$limit" python3 "$OLDPWD/.peers/$script" --stack "$stack" --config-dir "$model" "$@" \
    --out "$OUT/peers-$name.json" 2>&1 | grep -E "^step|^RESULT|Error" | grep -v -i warn | tail -6)
}

config_args() {  # a CONFIG word: the --config value and the overrides that come with it
  case $1 in
    4b) echo "$B4" ;;
    32b) echo "$B4 --set model.name=\"qwen3-32b\" --set data.synthetic_validation=0" ;;
    72b) echo "$B72" ;;
    *) echo "$1" ;;
  esac
}

step() {  # one step's words, VAR=value words first
  local words=() envs=() word
  for word in "$@"; do
    word=${word//\{W\}/$W}; words+=("${word//\{OUT\}/$OUT}")
  done
  while [ ${#words[@]} -gt 0 ] && [[ ${words[0]} =~ ^[A-Z_][A-Z0-9_]*= ]]; do
    envs+=("${words[0]}"); words=("${words[@]:1}")
  done
  [ ${#words[@]} -gt 0 ] || { echo "benchmarks/device.sh: error: an empty step" >&2; return 2; }
  local kind=${words[0]} rest=("${words[@]:1}")
  if [ "$DRY_RUN" = 1 ] && [ ${#envs[@]} -gt 0 ]; then printf '%s ' "${envs[@]}"; fi
  (
    for word in "${envs[@]}"; do
      if [[ $word == PYTHONPATH=* ]]; then export PYTHONPATH="${word#PYTHONPATH=}:$PYTHONPATH"; else export "$word"; fi
    done
    case $kind in
      bench)
        [ ${#rest[@]} -ge 3 ] || { echo "benchmarks/device.sh: error: bench needs NAME LIMIT CONFIG" >&2; exit 2; }
        local args=() i=3
        while [ $i -lt ${#rest[@]} ]; do
          if [ "${rest[$i]}" = --quant ]; then args+=(--set "model.quantize=\"${rest[$((i + 1))]}\""); i=$((i + 2))
          else args+=("${rest[$i]}"); i=$((i + 1)); fi
        done
        # shellcheck disable=SC2046
        bench "${rest[0]}" "${rest[1]}" $(config_args "${rest[2]}") "${args[@]}" ;;
      tool)
        local tool=benchmarks/tools/${rest[0]}.py
        [ -f "$tool" ] || { echo "benchmarks/device.sh: error: no tool $tool" >&2; exit 2; }
        if [ "$DRY_RUN" = 1 ]; then echo "python3 $tool ${rest[*]:1}"; exit 0; fi
        echo "== tool ${rest[0]} ($(date +%T), $(left) s left)"
        timeout "$(left)" python3 "$tool" "${rest[@]:1}" 2>&1 | grep -v -i warn | tee -a "$OUT/${rest[0]}.txt" ;;
      baselines)
        if [ "$TINY" = 1 ]; then echo "== baselines: skipped (--tiny)"; exit 0; fi
        baselines "${rest[@]}" ;;
      peers)
        [ ${#rest[@]} -ge 3 ] || { echo "benchmarks/device.sh: error: peers needs STACK LIMIT SHAPE" >&2; exit 2; }
        peers "${rest[@]}" ;;
      sh)
        if [ "$DRY_RUN" = 1 ]; then echo "${rest[*]}"; exit 0; fi
        echo "== sh ($(date +%T), $(left) s left): ${rest[*]}"
        bash -c "${rest[*]}" ;;
      *) echo "benchmarks/device.sh: error: unknown step '$kind' (bench, tool, baselines, peers or sh)" >&2; exit 2 ;;
    esac
  )
}

current=()
for word in "$@" ::; do
  if [ "$word" = "::" ]; then
    [ ${#current[@]} -gt 0 ] && { step "${current[@]}" || [ $? != 2 ] || exit 2; }
    current=()
  else
    current+=("$word")
  fi
done
[ "$DRY_RUN" = 1 ] && exit 0
collect "$TAG"
echo "device call $TAG done in $(( $(date +%s) - START )) s"
