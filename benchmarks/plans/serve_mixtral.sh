#!/bin/bash
# Mixtral-8x7B on one H200 with fp8 weights (vLLM's online quantization of the dummy bf16 weights,
# which loads them layer by layer: ~47 GB a server), so that plain vLLM and the plugin's server
# fit side by side: first the hook check in fp8 (graphs against eager, router_mask included), then
# serving at rate 16 and at saturation for apps off, router_mask and steer_all.
# Markers: MHOOKS MUP MR16 MSAT ALLDONE (in this order). See README.md. Not yet run.
cd "${XMIX_REPO:?}" || exit 1
source /root/xmix-env.sh
R=/root/res; S=/root/xmix-serve/mixtral; mkdir -p $R $S
B="python3 -m benchmarks.xmix_bench"
M=benchmarks/models/mixtral_8x7b
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt 2>&1
if [ "${MHOOKS:-1}" = 1 ]; then
  $B hooks-check --model $M --quantization fp8 --gpu-mem 0.45 --out $R/mix_graphs.json > $R/mix_hooks.log 2>&1 &
  sleep 60  # (the two engines' start-ups apart: each measures its free memory)
  $B hooks-check --model $M --quantization fp8 --gpu-mem 0.45 --eager --out $R/mix_eager.json >> $R/mix_hooks_eager.log 2>&1
  wait
  $B hooks-check --compare $R/mix_graphs.json $R/mix_eager.json > $R/mix_compare.txt 2>&1; echo "rc=$?"
fi
echo MHOOKS
$B serve start --model $M --out $S --latest $S/latest.json --gpu-mem 0.45 --server-args="--quantization fp8" \
  --record-steps > $R/mstart.log 2>&1; echo "rc=$?"
echo MUP
$B serve rounds --out $S --latest $S/latest.json --rates 16 --num-prompts 400 --warmup 1 --warmup-prompts 60 \
  --repeats 2 --dataset random --input-len 256 --range-ratio 0.9 --output-len 128 \
  --configs inactive,router_mask,steer_all > $R/mr16.log 2>&1; echo "rc=$?"
echo MR16
$B serve rounds --out $S --latest $S/latest.json --rates inf --num-prompts 1000 --warmup 1 --warmup-prompts 200 \
  --repeats 2 --configs inactive,router_mask,steer_all > $R/msat.log 2>&1; echo "rc=$?"
echo MSAT
$B serve stop --out $S > $R/mstop.log 2>&1
echo ALLDONE
