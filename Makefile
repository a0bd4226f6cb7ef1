# `make demo`: set up (once) and run the main job on the embedded tiny model.
# `make test`: set up (once) and run the test suite (CPU, real vLLM; what CI runs).
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_HOST_IP ?= 127.0.0.1
export HF_HUB_OFFLINE ?= 1

.PHONY: setup demo test
setup:
	@bash scripts/setup-cpu.sh

demo: setup
	.venv/bin/python -m vllm_xmix.demo

test: setup
	.venv/bin/python -m pytest -q -rs tests
