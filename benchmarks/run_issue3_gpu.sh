#!/usr/bin/env bash
# GPU check + benchmark lines for issues 3 and 4 (hook surface, reads, conditional writes). Runs on the H200 with the kit
# from ../shared/gpu (source /root/xmix-env.sh first). Usage: run_issue3_gpu.sh llama|llama_bench|llama_cond_bench|mixtral|mixtral_bench
# Logs and JSON in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/xmix-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true  # NB: the device copy's .git may be stale; record the local HEAD
check() {  # $1 model dir, $2 tag: graphs vs eager for every hook, write and read kind
  timeout 280 python3 benchmarks/hooks_check.py --model "$1" --out "$OUT/$2_graphs.json" > "$OUT/$2_graphs.log" 2>&1; echo "$2 graphs rc=$?"
  grep -E "TEACHER|DONE|Error" "$OUT/$2_graphs.log" | tail -3
  timeout 280 python3 benchmarks/hooks_check.py --model "$1" --eager --out "$OUT/$2_eager.json" > "$OUT/$2_eager.log" 2>&1; echo "$2 eager rc=$?"
  grep -E "TEACHER|DONE|Error" "$OUT/$2_eager.log" | tail -3
  python3 benchmarks/hooks_check.py --compare "$OUT/$2_graphs.json" "$OUT/$2_eager.json" | tee "$OUT/$2_compare.txt"
}
bench() {  # decode step time at batch 1/8/64: installed-inactive vs probe at one layer vs add at all layers (+ $3)
  timeout 400 python3 benchmarks/spine_check.py --model "$1" --mode xmix --with-probe ${3:-} --on-scales 0.5 --repeats 2 \
      --check-prompts 4 --check-tokens 4 --skip-throughput --out "$OUT/$2_bench.json" > "$OUT/$2_bench.log" 2>&1; echo "$2 bench rc=$?"
  grep -E "RESULT|Error" "$OUT/$2_bench.log" | tail -2
}
case "${1:-llama}" in
  llama)
    python3 -m pytest -q tests/test_kernels.py 2>&1 | tail -3 | tee "$OUT/kernels.log"
    check benchmarks/models/llama31_8b llama ;;
  llama_bench) bench benchmarks/models/llama31_8b llama ;;
  llama_cond_bench) bench benchmarks/models/llama31_8b llama_cond --with-cond ;;
  mixtral) check benchmarks/models/mixtral_8x7b mixtral ;;
  mixtral_bench) bench benchmarks/models/mixtral_8x7b mixtral ;;
esac
