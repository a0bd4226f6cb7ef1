#!/bin/bash
# Qwen3-8B: the lines the Current table lacks (steer_one; seal, cast, steer_one, K=256 at saturation),
# with recorded engine steps. Markers: QUP QR16 QSAT ALLDONE. See README.md.
cd "${XMIX_REPO:?}" || exit 1
source /root/xmix-env.sh
R=/root/res; S=/root/xmix-serve/qwen; mkdir -p $R $S
B="python3 -m benchmarks.xmix_bench"
$B serve start --model benchmarks/models/qwen3_8b --out $S --latest $S/latest.json --gpu-mem 0.42 --record-steps > $R/qstart.log 2>&1; echo "rc=$?"
echo QUP
$B serve rounds --out $S --latest $S/latest.json --rates 16 --num-prompts 400 --warmup 1 --warmup-prompts 60 --repeats 2 --dataset random --input-len 256 --range-ratio 0.9 --output-len 128 --configs inactive,steer_one,steer_all,probe_one,seal > $R/qr16.log 2>&1; echo "rc=$?"
echo QR16
$B serve rounds --out $S --latest $S/latest.json --rates inf --num-prompts 1000 --warmup 1 --warmup-prompts 200 --repeats 2 --configs inactive,steer_one,seal,cast,steer_all_K256 > $R/qsat.log 2>&1; echo "rc=$?"
echo QSAT
$B serve stop --out $S > $R/qstop.log 2>&1
echo ALLDONE
