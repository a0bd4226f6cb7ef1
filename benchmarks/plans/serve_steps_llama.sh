#!/bin/bash
# Llama-3.1-8B served rounds with recorded engine steps and a second plain server (A/A control):
# rate 16, the API server sampled at saturation, then saturation (2 rounds each); with SATDIAG=1 first the in-process saturation
# health of four engines (~8 min more). Markers: SATDIAG KTEST NORM UP R16 APIPROF SAT R16MORE DONE ALLDONE (in this order). See README.md.
cd "${XMIX_REPO:?}" || exit 1
source /root/xmix-env.sh
R=/root/res; S=/root/xmix-serve/llama; mkdir -p $R $S
B="python3 -m benchmarks.xmix_bench"
# CONTROL=0: no A/A control server (its start-up and rounds, ~2.5 min, left out). R16_CONFIGS and
# R16MORE_CONFIGS: the apps of the two rate-16 steps (~50 s per configuration and round), so that a
# short lease can measure the lines a change touches first
if [ "${CONTROL:-1}" = 1 ]; then CTL="--control"; AA="aa_plain,"; else CTL=""; AA=""; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt 2>&1
if [ "${SATDIAG:-0}" = 1 ]; then
  $B profile saturation --engines xmix,plain,empty,xmix@VLLM_XMIX_GRAPH_VARIANTS=onoff --json $R/saturation.json \
    > $R/saturation.log 2>&1; echo "rc=$?"
fi
echo SATDIAG
# the kernels against their torch references on CUDA, the compiled launches included (~1 min;
# KTEST=0 skips it)
if [ "${KTEST:-1}" = 1 ]; then
  python3 -m pytest -q tests/test_kernels.py -k "cuda or launch" > $R/kernel_tests.log 2>&1; echo "rc=$?"
  tail -2 $R/kernel_tests.log
fi
echo KTEST
# the host time of a hosted norm per call, apps off and with its sites' writes on (the fused
# Triton kernel's launch), against vLLM's kernel: what each of 31 norms costs in a step above
# the largest CUDA graph (~1 min)
# (NORM=0 skips it)
if [ "${NORM:-1}" = 1 ]; then
  $B profile norm-call --json $R/norm_off.json > $R/norm.log 2>&1
  $B profile norm-call --on --json $R/norm_on.json >> $R/norm.log 2>&1; echo "rc=$?"
fi
echo NORM
$B serve start --model benchmarks/models/llama31_8b --out $S --latest $S/latest.json --gpu-mem 0.3 $CTL \
  --record-steps --profile-api > $R/start.log 2>&1; echo "rc=$?"
echo UP
$B serve rounds --out $S --latest $S/latest.json --rates 16 --num-prompts 400 --warmup 1 --warmup-prompts 60 \
  --repeats 2 --dataset random --input-len 256 --range-ratio 0.9 --output-len 128 \
  --configs ${AA}${R16_CONFIGS:-inactive,steer_all,probe_one} > $R/r16.log 2>&1; echo "rc=$?"
echo R16
# where the API server's time goes at saturation: unmeasured runs with py-spy sampling each
# server's API server (vanilla, the A/A control: the noise floor, apps off, the probe, all-layer steering; ~2 min). py-spy: on PATH
# or carried as .gpu/bin/py-spy (README.md); with API_PROFILE=1 also the same runs under cProfile
# (exact calls, inflated times; ~2 min more)
[ -f .gpu/bin/py-spy ] && chmod +x .gpu/bin/py-spy && export XMIX_PY_SPY=$PWD/.gpu/bin/py-spy  # (a carried file may lose its mode)
$B serve rounds --out $S --no-latest --rates inf --num-prompts 1000 --warmup 0 --repeats 0 \
  --api-sample ${AA}inactive,probe_one,steer_all > $R/api_sample.log 2>&1; echo "rc=$?"
cp $S/api_sample.json $R/ 2>/dev/null; for f in $S/api_sample_*.txt; do [ -f "$f" ] && gzip -c "$f" > $R/$(basename "$f").gz; done
if [ "${API_PROFILE:-0}" = 1 ]; then
  $B serve rounds --out $S --no-latest --rates inf --num-prompts 1000 --warmup 0 --repeats 0 \
    --api-profile inactive,probe_one > $R/api_profile.log 2>&1; echo "rc=$?"
  cp $S/api_profile.json $S/api_profile_*.prof $R/ 2>/dev/null
fi
echo APIPROF
$B serve rounds --out $S --latest $S/latest.json --rates inf --num-prompts 1000 --warmup 1 --warmup-prompts 200 \
  --repeats 2 --configs ${AA}inactive,steer_all,probe_one,all_apps > $R/sat.log 2>&1; echo "rc=$?"
echo SAT
# the other apps' rate-16 lines at this code, against plain vLLM and the A/A control (~5 min)
$B serve rounds --out $S --latest $S/latest.json --rates 16 --num-prompts 400 --warmup 0 \
  --repeats 2 --dataset random --input-len 256 --range-ratio 0.9 --output-len 128 \
  --configs ${AA}${R16MORE_CONFIGS:-ablate_all,seal,cast,steer_one} > $R/r16_more.log 2>&1; echo "rc=$?"
echo R16MORE
$B serve stop --out $S > $R/stop.log 2>&1
echo DONE
echo ALLDONE
