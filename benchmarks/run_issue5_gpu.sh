#!/usr/bin/env bash
# Issue 5 on the H200 (kit sourced: source /root/xmix-env.sh). One part per `run` call (each
# must finish in 10 minutes); results accumulate in /root/xmix-serve/<model>/results.json on the
# warm machine and come back as $OUT/serve_results_<model>.json; locally, put it in a folder as
# results.json and `python3 benchmarks/serve_bench.py --out <folder> --summarize` writes
# summary.md + overhead.png. Usage: run_issue5_gpu.sh kernels|rate_inf|rate_16|k|decode
set -uo pipefail
OUT=${OUT:-/tmp/xmix-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
M=${MODEL:-benchmarks/models/llama31_8b}
S="/root/xmix-serve/$(basename $M)"  # kept on the (warm) machine between calls; only results.json comes back
SB="timeout 570 python3 benchmarks/serve_bench.py --model $M --out $S --repeats 2"
case "${1:-kernels}" in
  kernels) python3 -m pytest -q tests/test_kernels.py 2>&1 | tail -3 ;;
  rate_inf) $SB --rates inf --configs inactive,steer_one,steer_all,probe_one 2>&1 | tail -15 ;;
  rate_inf2) $SB --rates inf --configs inactive,ablate_all,seal,cast,all_apps 2>&1 | tail -15 ;;
  rate_16) $SB --rates 16 --configs inactive,steer_all,probe_one,cast 2>&1 | tail -15 ;;
  k) $SB --rates inf --configs steer_all,steer_all_K16,steer_all_K256 2>&1 | tail -15 ;;
  decode)  # decode step time, batch 1/8/64: plain vLLM, then inactive / add all / probe / seal / cast
    VLLM_PLUGINS= timeout 280 python3 benchmarks/spine_check.py --model $M --mode plain --repeats 2 \
        --check-prompts 4 --check-tokens 4 --skip-throughput --out "$OUT/decode_plain.json" > "$OUT/decode_plain.log" 2>&1
    timeout 300 python3 benchmarks/spine_check.py --model $M --mode xmix --with-probe --with-cond --on-scales 0.5 \
        --repeats 2 --check-prompts 4 --check-tokens 4 --skip-throughput --out "$OUT/decode_xmix.json" > "$OUT/decode_xmix.log" 2>&1
    grep -h RESULT "$OUT"/decode_*.log ;;
esac
cp "$S/results.json" "$OUT/serve_results_$(basename $M).json" 2>/dev/null || true
tail -c 3000 "$S/xmix.log" > "$OUT/xmix_server_tail.log" 2>/dev/null || true
