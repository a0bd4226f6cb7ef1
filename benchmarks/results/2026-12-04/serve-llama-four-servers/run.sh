#!/bin/bash
# Detached GPU experiment: where the apps-off line goes. Llama-3.1-8B, four servers (plain, the
# plugin with the benchmark deployment, plain again, the plugin with nothing deployed), ABBA rounds
# at saturation and rate 16; then apps off against plain vLLM, greedy tokens (4-layer config).
source /root/xmix-env.sh
X="python3 -m benchmarks.xmix_bench"
S=/root/xmix-serve/llama
R=/root/res; mkdir -p $R
mark() { echo "$1 $(date +%s)" >> $R/marker; }
mark BEGIN
$X serve start --model benchmarks/models/llama31_8b --out $S --latest $S/latest.json --gpu-mem 0.22 --control plain,empty > $R/start.log 2>&1
grep -h "Graph capturing\|KV cache size\|graph variant\|captured for" $S/*.log > $R/servers.txt 2>/dev/null
mark STARTED
RND="--dataset random --input-len 256 --range-ratio 0.9 --output-len 128"
$X serve rounds --out $S --no-latest --rates inf --warmup 1 --repeats 0 --num-prompts 200 \
  --configs aa_plain,aa_empty,inactive,steer_all > $R/warm.log 2>&1
mark WARM
$X serve rounds --out $S --latest $S/latest.json --rates inf --num-prompts 1000 --warmup 0 --repeats 4 \
  --configs aa_plain,aa_empty,inactive > $R/sat.log 2>&1
mark SAT
$X serve rounds --out $S --latest $S/latest.json --rates 16 --num-prompts 400 --warmup 0 --repeats 2 $RND \
  --configs aa_plain,aa_empty,inactive,steer_all > $R/r16.log 2>&1
mark R16
$X serve stop --out $S > $R/stop.log 2>&1
sleep 5
M=benchmarks/models/llama31_8b_4l
$X hooks-check --model $M --gpu-mem 0.4 --out $R/graphs.json > $R/hooks_graphs.log 2>&1 &
VLLM_PLUGINS= $X hooks-check --model $M --plain --gpu-mem 0.4 --out $R/plain.json > $R/hooks_plain.log 2>&1
wait
$X hooks-check --compare $R/graphs.json $R/plain.json > $R/compare_plain.txt 2>&1
mark DONE
