#!/usr/bin/env bash
# GPU check + first throughput A/B for the spine (issue 2). Runs on the H200 with the kit from
# ../shared/gpu (source /root/xmix-env.sh first). Usage: run_spine_gpu.sh part1|part2 ; logs in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/xmix-out}; mkdir -p "$OUT"
M=benchmarks/models/llama31_8b
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
case "${1:-part1}" in
  part1)
    [ -n "${SKIP_KERNELS:-}" ] || python3 -m pytest -q tests/test_kernels.py 2>&1 | tail -5 | tee "$OUT/kernels.log"
    [ -n "${SKIP_PLAIN:-}" ] || VLLM_PLUGINS= timeout 290 python3 benchmarks/spine_check.py --model $M --mode plain --out "$OUT/plain_graphs.json" > "$OUT/plain_graphs.log" 2>&1; echo "plain_graphs rc=$?"
    grep RESULT "$OUT/plain_graphs.log"
    timeout 290 python3 benchmarks/spine_check.py --model $M --mode xmix --out "$OUT/xmix_graphs.json" > "$OUT/xmix_graphs.log" 2>&1; echo "xmix_graphs rc=$?"
    grep -E "RESULT|vllm_xmix|Error" "$OUT/xmix_graphs.log" | tail -5
    ;;
  part2)
    timeout 250 python3 benchmarks/spine_check.py --model $M --mode xmix --eager --out "$OUT/xmix_eager.json" > "$OUT/xmix_eager.log" 2>&1; echo "xmix_eager rc=$?"
    VLLM_PLUGINS= timeout 250 python3 benchmarks/spine_check.py --model $M --mode plain --eager --out "$OUT/plain_eager.json" > "$OUT/plain_eager.log" 2>&1; echo "plain_eager rc=$?"
    grep RESULT "$OUT"/*eager.log
    ;;
  part3)  # diagnosis: the kernel alone, and per-request scale (same kernel work, data regime kept)
    python3 benchmarks/kernel_bench.py "$OUT/kernel_bench.json" 2>&1 | tail -2
    timeout 400 python3 benchmarks/spine_check.py --model $M --mode xmix --on-scales 0.0001,0.5 --repeats 3 \
        --out "$OUT/xmix_scales.json" > "$OUT/xmix_scales.log" 2>&1; echo "xmix_scales rc=$?"
    grep RESULT "$OUT/xmix_scales.log"
    ;;
  part4)  # re-measure decode after the per-request hashing fix (short: decode only)
    timeout 230 python3 benchmarks/spine_check.py --model $M --mode xmix --on-scales 0.0001 --repeats 2 \
        --check-prompts 4 --check-tokens 4 --skip-throughput --out "$OUT/xmix_fix.json" > "$OUT/xmix_fix.log" 2>&1; echo "xmix_fix rc=$?"
    grep RESULT "$OUT/xmix_fix.log"
    ;;
esac
case "${1:-part1}" in part1|part2) ls "$OUT"/*.json 2>/dev/null && python3 benchmarks/summarize_spine.py "$OUT"/*.json | tee "$OUT/summary.txt";; esac
