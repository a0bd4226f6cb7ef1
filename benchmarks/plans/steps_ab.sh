#!/bin/bash
# The plugin's per-step host work for this checkout and for the code before a change, on one GPU:
# the in-process `steps` benchmark (Llama-3.1-8B, rate 16, 150 prompts a round, 2 rounds, the same
# arrivals for both; the plugin's engine only, its apps-off configuration the reference), this
# checkout's engine first with one line-profiled round per app of LINES (the registry update and
# the step fill under line_profiler), then, with OLD_FILES, a copy of this checkout whose
# vllm_xmix/runtime files are replaced by those in OLD_FILES (e.g. `git show REV:vllm_xmix/runtime/
# step.py > .gpu/old/step.py`; carried, not committed). 3-4 min an engine on an H100 (measured).
# MODEL (default benchmarks/models/llama31_8b); NUM_PROMPTS (default 150);
# CONFIGS (default inactive,steer_one,cast,steer_all); LINES (default steer_one,cast; empty: none):
# line_profiler importable, or its wheel carried in .gpu/lp (unpacked to /root/lp).
# Markers: STEPSNEW STEPSOLD (and ALLDONE). See README.md.
cd "${XMIX_REPO:?}" || exit 1
source /root/xmix-env.sh
R=/root/res; mkdir -p $R
B="python3 -m benchmarks.xmix_bench"
M=${MODEL:-benchmarks/models/llama31_8b}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt 2>&1
CONFIGS=${CONFIGS:-inactive,steer_one,cast,steer_all}
LINES=${LINES-steer_one,cast}
for w in .gpu/lp/line_profiler-*.whl; do
  [ -f "$w" ] && mkdir -p /root/lp && python3 -m zipfile -e "$w" /root/lp && export PYTHONPATH=$PYTHONPATH:/root/lp
done
[ -n "$LINES" ] && ! python3 -c "import line_profiler" 2>/dev/null && { echo "line_profiler not importable: no line-profiled rounds"; LINES=""; }
ARGS="--skip-plain --configs $CONFIGS --rate 16 --num-prompts ${NUM_PROMPTS:-150} --rounds 2"
$B steps $M $ARGS ${LINES:+--line-profile $LINES} --out $R/steps_new.json > $R/steps_new.log 2>&1; echo "rc=$?"
echo STEPSNEW
if [ -n "${OLD_FILES:-}" ]; then
  O=/root/oldtree; rm -rf $O; mkdir -p $O
  cp -r vllm_xmix benchmarks $O/ && cp "$OLD_FILES"/*.py $O/vllm_xmix/runtime/
  (cd $O && python3 -c "import vllm_xmix.runtime.step as s, hashlib; print('old copy:', s.__file__, hashlib.sha1(open(s.__file__, 'rb').read()).hexdigest()[:12])") >> $R/steps_old.log 2>&1
  (cd $O && XMIX_COMMIT="${XMIX_COMMIT:-?}-old" $B steps $M $ARGS --out $R/steps_old.json >> $R/steps_old.log 2>&1; echo "rc=$?")
fi
echo STEPSOLD
echo ALLDONE
