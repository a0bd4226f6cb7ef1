#!/bin/bash
# Detached GPU run: Llama-3.1-8B, three servers at 0.3 (plain vLLM, the plugin with the benchmark
# deployment, the plugin with nothing deployed); ABBA rounds at saturation (the apps-off line's
# cause) and at rate 16; then host cost per eager launch of the hosted norm's kernels.
source /root/xmix-env.sh
X="python3 -m benchmarks.xmix_bench"
S=/root/xmix-serve/llama
R=/root/res; mkdir -p $R
mark() { echo "$1 $(date +%s)" >> $R/marker; }
mark BEGIN
$X serve start --model benchmarks/models/llama31_8b --out $S --latest $S/latest.json --gpu-mem 0.3 --control empty > $R/start.log 2>&1
grep -h "Graph capturing\|KV cache size\|graph variant\|captured for\|Maximum concurrency" $S/*.log > $R/servers.txt 2>/dev/null
mark STARTED
$X serve rounds --out $S --latest $S/latest.json --rates inf --num-prompts 1000 --warmup 1 --warmup-prompts 200 --repeats 4 \
  --configs aa_empty,inactive,steer_all,probe_one > $R/sat.log 2>&1
mark SAT
RND="--dataset random --input-len 256 --range-ratio 0.9 --output-len 128"
$X serve rounds --out $S --latest $S/latest.json --rates 16 --num-prompts 400 --warmup 1 --warmup-prompts 60 --repeats 2 $RND \
  --configs aa_empty,inactive,steer_all,ablate_all,probe_one,seal,cast > $R/r16.log 2>&1
mark R16
$X serve stop --out $S > $R/stop.log 2>&1
sleep 3
$X kernels --kernel norm-launch --tokens 1,64,512,1024,2048 --out $R/norm_launch.json > $R/norm_launch.log 2>&1
mark DONE
