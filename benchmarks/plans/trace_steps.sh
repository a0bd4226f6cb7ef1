#!/bin/bash
# What an app's engine steps cost on the device, per kind of step, against apps off in the same
# engine (~8 min, estimated): the plugin's Llama-3.1-8B engine in-process at rate 16 (`steps`), each app on
# every request in turn, 2 interleaved rounds after a warm-up, then a round with a torch-profiler
# trace of steps 10-59 of apps off, steer_all, ablate_all and CAST (kernels per step by name).
# For the lines where an app's served ITL exceeds steer_all's (ablate_all, CAST, SEAL, the probe)
# without a measured cause. First (~1 min) the hosted norm's kernel alone, apps off / add /
# ablation against vLLM's and Inductor's norm (`kernels --kernel norm`: what a launch costs at
# decode batch sizes; KERN=0 skips it). MODEL (default benchmarks/models/llama31_8b): the model
# config whose engine is traced, e.g. benchmarks/models/qwen3_8b. TRACE_CONFIGS (default
# inactive,steer_all,ablate_all,cast): the configurations of the traced round. PLAIN=1: plain
# vLLM's engine as well, first, in a process of its own (`steps` without --skip-plain), traced the
# same way, and the plugin's engine with apps off only (TRACE_CONFIGS default inactive): the
# kernels of an apps-off step beside plain vLLM's, same arrivals (~5 min, estimated). Markers:
# KERN, TRACE. See README.md.
cd "${XMIX_REPO:?}" || exit 1
source /root/xmix-env.sh
R=/root/res; mkdir -p $R /root/trace
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt 2>&1
if [ "${KERN:-1}" != 0 ]; then
  python3 -m benchmarks.xmix_bench kernels --kernel norm --tokens 1,8,16,32,64,256,512 \
    --out $R/kernels_norm.json > $R/kernels_norm.log 2>&1; echo "rc=$?"
  tail -20 $R/kernels_norm.log
fi
echo KERN
if [ "${PLAIN:-0}" = 1 ]; then
  T=${TRACE_CONFIGS:-inactive}; SARGS="--configs $T --fused-writes auto --fused-configs $T --trace-configs $T"
else
  SARGS="--_engine xmix:auto --configs inactive,steer_all,ablate_all,cast,seal,probe_one"
  SARGS="$SARGS --trace-configs ${TRACE_CONFIGS:-inactive,steer_all,ablate_all,cast}"
fi
VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 -m benchmarks.xmix_bench steps ${MODEL:-benchmarks/models/llama31_8b} \
  $SARGS --rate 16 --num-prompts 150 --rounds 2 --trace 10,60 \
  --out /root/trace/steps_apps.json > $R/steps_apps.log 2>&1; echo "rc=$?"
# (the engine writes each raw chrome trace beside --out, summarizes it into the JSON and deletes it:
# --out outside /root/res keeps a trace that outlives a cut run out of what poll.sh packs)
cp /root/trace/steps_apps.json* $R/ 2>/dev/null  # (with PLAIN=1 each engine's part beside it)
grep "^\[steps\]" $R/steps_apps.log | tail -30
echo TRACE
