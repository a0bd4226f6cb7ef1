# vllm bench sweep serve: the xmix configurations (one server, configurations in sequence,
# the prefix cache reset between runs), then vanilla (plugin not loaded) with its own sweep.
# Not expressible as sweep parameters: the K-distinct configurations (per-request
# selections), and the interleaving of vanilla and xmix runs (A B A B) of `serve rounds`.
vllm bench sweep serve --serve-cmd 'vllm serve /root/xmix-serve/llama-r16/model --load-format dummy --gpu-memory-utilization 0.42 --max-model-len 4096 --dtype bfloat16' --bench-cmd 'vllm bench serve --backend vllm --model /root/xmix-serve/llama-r16/model --tokenizer /root/xmix-serve/llama-r16/model --dataset-name random --random-input-len 256 --random-output-len 128 --random-range-ratio 0.9 --num-prompts 400 --ignore-eos' \
    --serve-params /root/xmix-serve/llama-r16/sweep/serve_params.json --bench-params /root/xmix-serve/llama-r16/sweep/bench_params.json -o /root/xmix-serve/llama-r16/sweep/results -e xmix
VLLM_PLUGINS= vllm bench sweep serve --serve-cmd 'vllm serve /root/xmix-serve/llama-r16/model --load-format dummy --gpu-memory-utilization 0.42 --max-model-len 4096 --dtype bfloat16' --bench-cmd 'vllm bench serve --backend vllm --model /root/xmix-serve/llama-r16/model --tokenizer /root/xmix-serve/llama-r16/model --dataset-name random --random-input-len 256 --random-output-len 128 --random-range-ratio 0.9 --num-prompts 400 --ignore-eos' \
    --bench-params /root/xmix-serve/llama-r16/sweep/bench_params_vanilla.json -o /root/xmix-serve/llama-r16/sweep/results -e vanilla
