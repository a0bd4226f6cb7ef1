#!/usr/bin/env bash
# Issue 5 on the H200s (kit sourced: source /root/xmix-env.sh). Each part fits one `run` call
# (10 minutes). Parts ending in 2 use two GPUs at once (nvidia-h200-x2): the serving benchmark
# on GPU 0 (both servers there) and checks / decode-step lines on GPU 1, each in its own process.
# Serving results accumulate in /root/xmix-serve/<model>/results.json on the warm machine and come
# back as $OUT/serve_results_<model>.json; locally, put it in a folder as results.json and
# `python3 benchmarks/serve_bench.py --out <folder> --summarize` writes summary.md + overhead.png.
# Everything else comes back in $OUT/<part>.tgz.
#   A2: GPU0 kernels on CUDA, graphs vs eager for every hook/app kind | GPU1 decode step time plain/xmix
#   B2: serving, Llama: GPU0 rate inf, every configuration | GPU1 rate 16 (subset)
#   C2: GPU0 serving Qwen3-8B rate inf (subset) | GPU1 serving Llama rate inf, VLLM_XMIX_GRAPH_VARIANTS=0
#   P2: vLLM torch-profiler tables (CUDA time per kernel) at rate 16: vanilla vs steer_all | vanilla vs probe_one
#   P3: GPU0 profiles at rate 16 with per-step summaries (trace_steps.py): vanilla vs steer_all, probe_one, cast
#       | GPU1 run_issue3_gpu.sh mixtral (graphs vs eager on the V1 model runner: its graph-variant capture)
#   E3: per-app graph variants: GPU0 graphs vs eager | GPU1 serving rate 16 (subset)
#   F3: GPU0 profiles at rate 16 (vanilla vs steer_all, cast) | GPU1 decode lines (xmix, inactive = baseline)
#   D2: GPU0 graphs vs eager + decode lines (xmix) | GPU1 serving rate 16 (subset): re-measure after a change
#   G4: GPU0 graphs vs eager | GPU1 decode lines, plain vLLM then xmix (incl. ablate_all)
#   H4: serving, Llama: GPU0 rate 16, every single-app configuration | GPU1 rate inf, every configuration
#   I4: GPU0 serving Qwen3-8B rate inf (subset) | GPU1 profiles at rate 16, vanilla vs steer_all
#   J4: decode lines by the deployment's fused_writes: GPU0 plain, none, adds | GPU1 plain, all, adds (every app kind)
#   L5: graphs vs eager with fused_writes adds (GPU0) and all (GPU1): the fused paths read tok_fc
#   K5: GPU0 profiles with Python stacks at rate 16 (vanilla vs steer_all, probe_one) | GPU1 rate 16, 3 rounds
#   S5: saturation with 1000 prompts: GPU0 Llama (inactive, steer_all, K256, all_apps) | GPU1 Qwen3-8B (subset)
#   M4: serving, Mixtral-8x7B, both servers TP=2 on GPUs 0,1 (bf16: 47 GB of weights per GPU each), rate inf
# Usage: run_issue5_gpu.sh A2|B2|C2|D2|P2|P3|E3|F3|G4|H4|I4|J4|K5|L5|S5|M4|kernels
set -uo pipefail
OUT=${OUT:-/tmp/xmix-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
L=/tmp/xmix-logs/${1:-A2}; mkdir -p "$L"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$L/gpu.txt" 2>&1
LL=benchmarks/models/llama31_8b
QW=benchmarks/models/qwen3_8b
serve() {  # $1 gpu, $2 model dir, $3 timeout, rest: serve_bench arguments
  local gpu=$1 m=$2 t=$3; shift 3
  local s="/root/xmix-serve/$(basename $m)${XMIX_SERVE_TAG:-}"
  CUDA_VISIBLE_DEVICES=$gpu timeout $t python3 benchmarks/serve_bench.py --model $m --out $s "$@" \
      > "$L/serve_$(basename $m)${XMIX_SERVE_TAG:-}.log" 2>&1
  echo "serve $(basename $m)${XMIX_SERVE_TAG:-} rc=$?" >> "$L/rc.txt"
  cp "$s/results.json" "$OUT/serve_results_$(basename $m)${XMIX_SERVE_TAG:-}.json" 2>/dev/null
  tail -c 4000 "$s/xmix.log" > "$L/xmix_server_$(basename $m)${XMIX_SERVE_TAG:-}.log" 2>/dev/null
  grep -h "Graph capturing finished\|KV cache\|Available KV" "$s/xmix.log" "$s/vanilla.log" >> "$L/servers.txt" 2>/dev/null
  grep -h "WARNING.*vllm_xmix\|vllm_xmix.*wait\|hook variants" "$s/xmix.log" 2>/dev/null | tail -n 20 >> "$L/xmix_warnings.txt"
}
fw() {  # $1 gpu, $2 fused_writes, $3 timeout, rest: spine_check flags: decode lines of one deployment
  local g=$1 f=$2 t=$3; shift 3
  CUDA_VISIBLE_DEVICES=$g timeout $t python3 benchmarks/spine_check.py --model $LL --mode xmix --fused-writes $f \
      --on-scales 0.5 --repeats 2 --check-prompts 4 --check-tokens 4 --skip-throughput "$@" \
      --out "$L/decode_${f}_gpu$g.json" > "$L/decode_${f}_gpu$g.log" 2>&1; echo "decode $f gpu$g rc=$?" >> "$L/rc.txt"
}
plain() {  # $1 gpu, $2 timeout
  CUDA_VISIBLE_DEVICES=$1 VLLM_PLUGINS= timeout $2 python3 benchmarks/spine_check.py --model $LL --mode plain \
      --repeats 2 --check-prompts 4 --check-tokens 4 --skip-throughput --out "$L/decode_plain_gpu$1.json" \
      > "$L/decode_plain_gpu$1.log" 2>&1; echo "decode plain gpu$1 rc=$?" >> "$L/rc.txt"
}
decode() {  # decode step time, batch 1/8/64: plain vLLM, then inactive / add all / probe / seal / cast (GPU 1)
  CUDA_VISIBLE_DEVICES=1 VLLM_PLUGINS= timeout 200 python3 benchmarks/spine_check.py --model $LL --mode plain \
      --repeats 2 --check-prompts 4 --check-tokens 4 --skip-throughput --out "$L/decode_plain.json" > "$L/decode_plain.log" 2>&1
  echo "decode plain rc=$?" >> "$L/rc.txt"
  CUDA_VISIBLE_DEVICES=1 timeout 280 python3 benchmarks/spine_check.py --model $LL --mode xmix --with-probe --with-cond \
      --on-scales 0.5 --repeats 2 --check-prompts 4 --check-tokens 4 --skip-throughput --out "$L/decode_xmix.json" \
      > "$L/decode_xmix.log" 2>&1
  echo "decode xmix rc=$?" >> "$L/rc.txt"
}
hooks() {  # $1 gpu, $2 timeout: graphs vs eager, every hook / write / read / condition kind
  CUDA_VISIBLE_DEVICES=$1 timeout $2 python3 benchmarks/hooks_check.py --model $LL --out "$L/hooks_graphs.json" \
      > "$L/hooks_graphs.log" 2>&1; echo "hooks graphs rc=$?" >> "$L/rc.txt"
  CUDA_VISIBLE_DEVICES=$1 timeout $2 python3 benchmarks/hooks_check.py --model $LL --eager --out "$L/hooks_eager.json" \
      > "$L/hooks_eager.log" 2>&1; echo "hooks eager rc=$?" >> "$L/rc.txt"
  python3 benchmarks/hooks_check.py --compare "$L/hooks_graphs.json" "$L/hooks_eager.json" > "$L/hooks_compare.txt" 2>&1
}
case "${1:-A2}" in
  kernels) CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q tests/test_kernels.py 2>&1 | tail -3 ;;
  A2)  # checks: GPU0 kernels + graphs vs eager | GPU1 decode step lines
    (CUDA_VISIBLE_DEVICES=0 timeout 80 python3 -m pytest -q tests/test_kernels.py > "$L/kernels.log" 2>&1
     echo "kernels rc=$?" >> "$L/rc.txt"; hooks 0 ${HOOKS_T:-210}) &
    decode &
    wait ;;
  B2)  # serving, Llama: GPU0 rate inf every configuration | GPU1 rate 16 subset
    serve 0 $LL 560 --rates inf --repeats 2 &
    (XMIX_SERVE_TAG=_r16 serve 1 $LL 560 --rates 16 --repeats 2 --configs inactive,steer_all,probe_one,cast --port 8201) &
    wait ;;
  D2)  # after a change: GPU0 graphs vs eager, then decode lines (xmix only) | GPU1 serving rate 16 subset
    (hooks 0 ${HOOKS_T:-170}
     CUDA_VISIBLE_DEVICES=0 timeout ${DEC_T:-230} python3 benchmarks/spine_check.py --model $LL --mode xmix --with-probe \
         --with-cond --on-scales 0.5 --repeats 2 --check-prompts 4 --check-tokens 4 --skip-throughput \
         --out "$L/decode_xmix.json" > "$L/decode_xmix.log" 2>&1; echo "decode xmix rc=$?" >> "$L/rc.txt") &
    (XMIX_SERVE_TAG=_r16 serve 1 $LL ${SERVE_T:-500} --rates 16 --repeats 2 --configs inactive,steer_all,probe_one,cast \
         --port 8201) &
    wait ;;
  P2)  # profiles (vLLM's torch profiler, per-kernel CUDA time): GPU0 vanilla vs steer_all | GPU1 vanilla vs probe_one
    XMIX_SERVE_TAG=_prof0 serve 0 $LL 500 --rates 16 --repeats 0 --configs steer_all --profile steer_all &
    XMIX_SERVE_TAG=_prof1 serve 1 $LL 500 --rates 16 --repeats 0 --configs probe_one --profile probe_one --port 8201 &
    wait
    cp /root/xmix-serve/llama31_8b_prof*/profile_*.txt "$L/" 2>/dev/null ;;
  E3)  # per-app graph variants: correctness and decode | serving rate 16
    hooks 0 ${HOOKS_T:-250} &
    (XMIX_SERVE_TAG=_r16 serve 1 $LL ${SERVE_T:-560} --rates 16 --repeats 2 --configs inactive,steer_all,probe_one,cast \
         --port 8201) &
    wait ;;
  F3)  # profiles | decode lines
    XMIX_SERVE_TAG=_prof serve 0 $LL ${P3_T:-420} --rates 16 --repeats 0 --configs steer_all,cast \
        --profile steer_all,cast --profile-steps 150,300 &
    (CUDA_VISIBLE_DEVICES=1 timeout ${DEC_T:-420} python3 benchmarks/spine_check.py --model $LL --mode xmix --with-probe \
         --with-cond --with-ablate --on-scales 0.5 --repeats 2 --check-prompts 4 --check-tokens 4 --skip-throughput \
         --out "$L/decode_xmix.json" > "$L/decode_xmix.log" 2>&1; echo "decode xmix rc=$?" >> "$L/rc.txt") &
    wait
    cp /root/xmix-serve/llama31_8b_prof/profile_*.txt /root/xmix-serve/llama31_8b_prof/trace_*.json \
        /root/xmix-serve/llama31_8b_prof/trace_*_vs_vanilla.md "$L/" 2>/dev/null
    cat "$L"/trace_*_vs_vanilla.md 2>/dev/null | head -c 7000 ;;
  G4)  # after the fused projections / per-step variant choice: correctness | decode lines vs plain vLLM
    hooks 0 ${HOOKS_T:-260} &
    (CUDA_VISIBLE_DEVICES=1 VLLM_PLUGINS= timeout ${PLAIN_T:-170} python3 benchmarks/spine_check.py --model $LL \
         --mode plain --repeats 2 --check-prompts 4 --check-tokens 4 --skip-throughput --out "$L/decode_plain.json" \
         > "$L/decode_plain.log" 2>&1; echo "decode plain rc=$?" >> "$L/rc.txt"
     CUDA_VISIBLE_DEVICES=1 timeout ${DEC_T:-350} python3 benchmarks/spine_check.py --model $LL --mode xmix \
         --with-probe --with-cond --with-ablate --on-scales 0.5 --repeats 2 --check-prompts 4 --check-tokens 4 \
         --skip-throughput --out "$L/decode_xmix.json" > "$L/decode_xmix.log" 2>&1
     echo "decode xmix rc=$?" >> "$L/rc.txt") &
    wait ;;
  H4)  # serving, Llama, current code: rate 16 single apps | rate inf every configuration
    XMIX_SERVE_TAG=_r16 serve 0 $LL ${SERVE_T:-555} --rates 16 --repeats 2 --fused-writes ${FUSED:-adds} \
        --configs inactive,steer_one,steer_all,ablate_all,probe_one,seal,cast &
    (XMIX_SERVE_TAG=_inf serve 1 $LL ${SERVE_T:-555} --rates inf --repeats 2 --port 8201 --fused-writes ${FUSED:-adds}) &
    wait ;;
  I4)  # Qwen3-8B serving | profiles (the upload ring's extra blocking sync per step, mixed-step host time)
    serve 0 $QW ${SERVE_T:-540} --rates inf --repeats 2 --configs inactive,steer_all,ablate_all,probe_one,cast &
    XMIX_SERVE_TAG=_prof serve 1 $LL ${P3_T:-540} --rates 16 --repeats 0 --configs steer_all \
        --profile steer_all --profile-steps 150,300 --port 8201 &
    wait
    cp /root/xmix-serve/llama31_8b_prof/trace_*.json /root/xmix-serve/llama31_8b_prof/trace_*_vs_vanilla.md "$L/" 2>/dev/null
    cat "$L"/trace_*_vs_vanilla.md 2>/dev/null | head -c 5000 ;;
  J4)  # what fused writes cost every request: decode lines, steer_all + ablate_all deployed, by fused_writes
    (plain 0 ${PLAIN_T:-130}; fw 0 none ${FW_T:-220} --with-ablate; fw 0 adds ${FW_T:-220} --with-ablate) &
    (plain 1 ${PLAIN_T:-130}; fw 1 all ${FW_T:-220} --with-ablate
     fw 1 adds ${FW2_T:-240} --with-ablate --with-probe --with-cond) &
    wait ;;
  L5)  # graphs vs eager for the fused paths (per-token coefficient table): GPU0 adds | GPU1 all; eager once
    (CUDA_VISIBLE_DEVICES=0 timeout ${HOOKS_T:-250} python3 benchmarks/hooks_check.py --model $LL --fused-writes adds \
         --out "$L/hooks_graphs_adds.json" > "$L/hooks_graphs_adds.log" 2>&1; echo "hooks graphs adds rc=$?" >> "$L/rc.txt"
     CUDA_VISIBLE_DEVICES=0 timeout ${HOOKS_T:-250} python3 benchmarks/hooks_check.py --model $LL --eager \
         --out "$L/hooks_eager.json" > "$L/hooks_eager.log" 2>&1; echo "hooks eager rc=$?" >> "$L/rc.txt") &
    (CUDA_VISIBLE_DEVICES=1 timeout ${HOOKS_T:-250} python3 benchmarks/hooks_check.py --model $LL --fused-writes all \
         --out "$L/hooks_graphs_all.json" > "$L/hooks_graphs_all.log" 2>&1; echo "hooks graphs all rc=$?" >> "$L/rc.txt") &
    wait
    for f in adds all; do
      python3 benchmarks/hooks_check.py --compare "$L/hooks_graphs_$f.json" "$L/hooks_eager.json" > "$L/hooks_compare_$f.txt" 2>&1
      echo "== fused_writes $f"; head -n 16 "$L/hooks_compare_$f.txt"; tail -n 2 "$L/hooks_compare_$f.txt"
    done ;;
  K5)  # where the TTFT goes (host time per mixed step, by Python function) | rate 16 with more rounds
    XMIX_SERVE_TAG=_prof serve 0 $LL ${P3_T:-560} --rates 16 --repeats 0 --configs steer_all,probe_one \
        --profile steer_all,probe_one --profile-stack --profile-steps 150,100 &
    XMIX_SERVE_TAG=_r16b serve 1 $LL ${SERVE_T:-560} --rates 16 --repeats 3 --port 8201 \
        --configs inactive,steer_all,ablate_all,probe_one,cast &
    wait
    cp /root/xmix-serve/llama31_8b_prof/trace_*.json /root/xmix-serve/llama31_8b_prof/trace_*_vs_vanilla.md "$L/" 2>/dev/null
    cat "$L"/trace_*_vs_vanilla.md 2>/dev/null | grep -A17 "Python function, mixed" | head -c 6000 ;;
  S5)  # saturation, 1000 prompts per run (250-prompt runs last ~3 s and gave +-10% CIs)
    XMIX_SERVE_TAG=_inf1000 serve 0 $LL ${SERVE_T:-560} --rates inf --repeats 3 --num-prompts 1000 \
        --configs inactive,steer_all,steer_all_K256,all_apps &
    serve 1 $QW ${SERVE_T:-560} --rates inf --repeats 2 --num-prompts 1000 --port 8201 \
        --configs inactive,steer_all,ablate_all,probe_one,cast &
    wait ;;
  M4)  # Mixtral-8x7B serving: both servers TP=2 over the two GPUs, one at a time busy
    (export CUDA_VISIBLE_DEVICES=0,1; serve 0,1 benchmarks/models/mixtral_8x7b ${SERVE_T:-570} --rates inf --repeats 1 \
        --gpu-mem 0.47 --server-args "--tensor-parallel-size 2" \
        --configs inactive,steer_all,ablate_all,probe_one,cast,router_mask) ;;
  P3)  # per-step profile summaries | Mixtral graphs vs eager (V1 runner)
    XMIX_SERVE_TAG=_prof serve 0 $LL ${P3_T:-560} --rates 16 --repeats 0 --configs steer_all,probe_one,cast \
        --profile steer_all,probe_one,cast &
    (mkdir -p "$L/mixtral"; CUDA_VISIBLE_DEVICES=1 OUT="$L/mixtral" timeout ${MIX_T:-570} bash benchmarks/run_issue3_gpu.sh mixtral \
        > "$L/mixtral.log" 2>&1; echo "mixtral rc=$?" >> "$L/rc.txt") &
    wait
    cp /root/xmix-serve/llama31_8b_prof/profile_*.txt /root/xmix-serve/llama31_8b_prof/trace_*.json \
        /root/xmix-serve/llama31_8b_prof/trace_*_vs_vanilla.md "$L/" 2>/dev/null
    cat "$L"/trace_*_vs_vanilla.md 2>/dev/null | head -c 9000; tail -n 5 "$L/mixtral.log" ;;
  C2)  # GPU0 Qwen3-8B rate inf subset | GPU1 Llama rate inf without graph variants (before/after)
    serve 0 $QW ${C2_T:-560} --rates inf --repeats 2 --configs inactive,steer_one,steer_all,probe_one,all_apps &
    (export VLLM_XMIX_GRAPH_VARIANTS=0 XMIX_SERVE_TAG=_novariants
     serve 1 $LL ${C2_T:-560} --rates inf --repeats 2 --configs inactive,steer_all,probe_one --port 8201) &
    wait ;;
esac
cat "$L/rc.txt" 2>/dev/null
grep "DECODE" "$L"/decode_*.log 2>/dev/null | sed "s|.*/decode_||" | cut -c1-400
tail -n 3 "$L/kernels.log" "$L/hooks_compare.txt" 2>/dev/null
cut -c1-220 "$L/xmix_warnings.txt" 2>/dev/null | tail -n 6
tail -n 30 "$L"/serve_*.log 2>/dev/null | grep -v "^$" | tail -n 40
tar czf "$OUT/${1:-A2}.tgz" -C /tmp/xmix-logs "${1:-A2}"
