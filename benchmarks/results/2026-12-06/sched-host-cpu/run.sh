#!/bin/bash
# vLLM's own scheduler host time, plain vLLM vs the plugin's server with apps off, on CPU servers
# REPO: this checkout; EXP: a scratch folder (the servers, their logs and runs go there)
REPO=${REPO:-$PWD}; EXP=${EXP:-/tmp/cpuexp}
cd "$REPO" && source .venv/bin/activate
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 PYTHONPATH="$REPO"
rm -rf $EXP && mkdir -p $EXP
python -c "from benchmarks.xmix_bench import common; print(common.write_model_config('$EXP/cfg', layers=4, d_model=64, vocab=512))"
B="python -m benchmarks.xmix_bench serve"
$B start --out $EXP/serve --model $EXP/cfg --no-latest --record-steps --dtype float32 --max-model-len 512 --port 8301 \
  --server-args "--enforce-eager --max-num-seqs 8 --max-num-batched-tokens 512" || exit 1
$B rounds --out $EXP/serve --no-latest --rates 8 --num-prompts 40 --dataset random --input-len 24 --range-ratio 0.5 \
  --output-len 32 --repeats 4 --warmup 1 --configs steer_all,inactive
$B stop --out $EXP/serve
