#!/bin/bash
# chain.sh 'COMMAND' ['COMMAND' ...]: run plans one after the other in one detached shell, each
# COMMAND a shell command line (e.g. 'MODEL=benchmarks/models/qwen3_8b KERN=0 bash
# benchmarks/plans/trace_steps.sh'), with one ALLDONE at the very end. A plan's own ALLDONE
# line is dropped: poll.sh stops at the first ALLDONE in the log, which would end the wait for a
# later plan's markers while it is still running. Prints "chain: COMMAND" before each and
# "chain: rc=N" after. See README.md.
cd "${XMIX_REPO:?}" || exit 1
for cmd in "$@"; do
  echo "chain: $cmd"
  bash -c "$cmd" 2>&1 | grep --line-buffered -vx ALLDONE
  echo "chain: rc=${PIPESTATUS[0]}"
done
echo ALLDONE
