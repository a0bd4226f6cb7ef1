#!/bin/bash
# Every serving budget line of Llama-3.1-8B, then Qwen3-8B, in one lease (~27 min on an H200):
# rate 16 for apps off and each app (Llama also against the A/A control), then saturation for the
# same and for all_apps and 256 distinct configurations, 2 interleaved rounds each. The servers
# run as vLLM defaults them apart from the memory share; no step recorder, no API profiler.
# Ordered so that a lease cut short keeps the lines measured first.
# Markers: LUP LR16 LSAT QUP QR16 QSAT ALLDONE (in this order). See README.md.
cd "${XMIX_REPO:?}" || exit 1
source /root/xmix-env.sh
R=/root/res; mkdir -p $R
B="python3 -m benchmarks.xmix_bench"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt 2>&1
R16="--rates 16 --num-prompts 400 --dataset random --input-len 256 --range-ratio 0.9 --output-len 128 --repeats 2"
SAT="--rates inf --num-prompts 1000 --repeats 2"
APPS="inactive,steer_all,ablate_all,probe_one,seal,cast"
# Qwen's two servers at 0.3 leave an 80 GB card ~3 GB of KV cache: 0.42 there
GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${GIB:-0}" -gt 100000 ]; then QMEM=0.3; else QMEM=0.42; fi

S=/root/xmix-serve/llama; mkdir -p $S
$B serve start --model benchmarks/models/llama31_8b --out $S --latest $S/latest.json --gpu-mem 0.3 --control \
  > $R/lstart.log 2>&1; echo "rc=$?"
echo LUP
$B serve rounds --out $S --latest $S/latest.json $R16 --warmup 1 --warmup-prompts 60 \
  --configs aa_plain,$APPS > $R/lr16.log 2>&1; echo "rc=$?"
echo LR16
$B serve rounds --out $S --latest $S/latest.json $SAT --warmup 1 --warmup-prompts 200 \
  --configs aa_plain,$APPS,all_apps,steer_all_K256 > $R/lsat.log 2>&1; echo "rc=$?"
echo LSAT
$B serve stop --out $S > $R/lstop.log 2>&1

S=/root/xmix-serve/qwen; mkdir -p $S
$B serve start --model benchmarks/models/qwen3_8b --out $S --latest $S/latest.json --gpu-mem $QMEM \
  > $R/qstart.log 2>&1; echo "rc=$?"
echo QUP
$B serve rounds --out $S --latest $S/latest.json $R16 --warmup 1 --warmup-prompts 60 \
  --configs $APPS > $R/qr16.log 2>&1; echo "rc=$?"
echo QR16
$B serve rounds --out $S --latest $S/latest.json $SAT --warmup 1 --warmup-prompts 200 \
  --configs inactive,steer_all,probe_one,all_apps,steer_all_K256,ablate_all > $R/qsat.log 2>&1; echo "rc=$?"
echo QSAT
$B serve stop --out $S > $R/qstop.log 2>&1
echo ALLDONE
