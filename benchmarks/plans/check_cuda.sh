#!/bin/bash
# Correctness on CUDA in ~2.5 minutes (an H100), for a short lease: the kernels against their torch references
# (the compiled launches included), then the hook check on the 4-layer Llama-3.1-8B config:
# graphs against eager for every app kind and apps off against plain vLLM (three engines side by
# side). Markers: KTEST HOOKS ALLDONE (in this order). See README.md.
cd "${XMIX_REPO:?}" || exit 1
source /root/xmix-env.sh
R=/root/res; mkdir -p $R
B="python3 -m benchmarks.xmix_bench"
M=benchmarks/models/llama31_8b_4l
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt 2>&1
python3 -m pytest -q tests/test_kernels.py -k "cuda or launch" > $R/kernel_tests.log 2>&1; echo "rc=$?"
tail -2 $R/kernel_tests.log
echo KTEST
$B hooks-check --model $M --gpu-mem 0.28 --out $R/graphs.json > $R/hooks_graphs.log 2>&1 &
sleep 30  # (start-ups apart: each engine measures the memory left)
$B hooks-check --model $M --gpu-mem 0.28 --eager --out $R/eager.json > $R/hooks_eager.log 2>&1 &
sleep 30
VLLM_PLUGINS= $B hooks-check --model $M --gpu-mem 0.28 --plain --out $R/plain.json > $R/hooks_plain.log 2>&1
wait
$B hooks-check --compare $R/graphs.json $R/eager.json > $R/compare.txt 2>&1; echo "rc=$?"
$B hooks-check --compare $R/plain.json $R/graphs.json > $R/compare_plain.txt 2>&1; echo "rc=$?"
tail -5 $R/compare.txt $R/compare_plain.txt
echo HOOKS
echo ALLDONE
