#!/usr/bin/env bash
# A command's end on ONE H200 (cli.run: exit handlers, then out without the interpreter's teardown): a compiled,
# CUDA-graphed bf16 run of the tiny model in one process, and the same through `pipetune bench` (a worker under
# the bench's subprocess), each checked for exit code 0, its files, and the seconds from "done" to the exit.
# Usage (device machine, repo root, .whl carried): OUT=dir bash benchmarks/journal/scripts/run_exit_check_h200.sh
# CPU dry run: GPU="--set parallel.pp=1" OUT=dir bash benchmarks/journal/scripts/run_exit_check_h200.sh
source benchmarks/h200_common.sh
W=/tmp/exit-check; rm -rf $W; mkdir -p $W
GPU=${GPU:-"--set parallel.pp=1 --set model.dtype=\"bfloat16\" --set train.compile=true --set train.cuda_graphs=true"}
python3 - <<'PY' "$W" "$GPU" 2>&1 | grep -v -i warn | tee "$OUT/exit_check.txt"
import json, shlex, subprocess, sys, time
w, gpu = sys.argv[1], shlex.split(sys.argv[2])
cmd = [sys.executable, "-m", "pipetune", "train", "--config", "configs/demo.toml", "--quiet", "--set",
       f'output.dir="{w}/train"', "--set", "train.max_steps=30", *gpu]
started = time.time()
result = subprocess.run(cmd, capture_output=True, text=True)
ended = time.time()
print(result.stdout[-1500:], result.stderr[-1500:])
done = [json.loads(l) for l in open(f"{w}/train/progress.jsonl")][-1]
print(f"train: exit code {result.returncode}, {ended - started:.1f} s in all, {ended - done['time']:.2f} s from "
      f"'{done['phase']}' to the exit")
PY
ls -la $W/train $W/train/adapter | tee -a "$OUT/exit_check.txt"
python3 -m pipetune bench --config configs/demo.toml --out $W/bench --strategies single --steps 10 --warmup 3 \
  --timeout 150 $GPU 2>&1 | grep -v -i warn | tail -15 | tee -a "$OUT/exit_check.txt"
echo "bench exit code ${PIPESTATUS[0]}" | tee -a "$OUT/exit_check.txt"
echo "exit check done in $(( $(date +%s) - START )) s"
