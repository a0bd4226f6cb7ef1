#!/bin/bash
# Mixtral-8x7B with fp8 weights (vLLM's online quantization of the dummy bf16 weights, which loads
# them layer by layer: ~47 GB an engine): first the hook check in fp8 (graphs against eager,
# router_mask included), then serving at rate 16 and at saturation for apps off, router_mask and
# steer_all. On a card of more than 100 GB (an H200) the two engines / servers run side by side
# at 0.45 of the GPU; on an 80 GB card (an H100) two do not fit, so they run one at a time at 0.9:
# the hook check's engines one after the other, and `serve start --servers vanilla`, plain vLLM's
# rounds, stop, then `--servers xmix` in the same folder and the plugin's rounds (paired with
# vanilla's by round number; not interleaved across the servers, so apps off, measured beside
# the apps in the plugin's phase, is the reference that shares their conditions).
# Markers: MHOOKS MUP MR16 MSAT ALLDONE (in this order; one at a time: MUP after the plugin's
# server is up; ~22 min on an H100, serving ~16 of it). MHOOKS=0 skips the hook check, MSERVE=0 the serving (a short lease: serving
# first, `chain.sh 'MHOOKS=0 bash ...' 'MSERVE=0 bash ...'`). See README.md.
cd "${XMIX_REPO:?}" || exit 1
source /root/xmix-env.sh
R=/root/res; S=/root/xmix-serve/mixtral; mkdir -p $R $S
B="python3 -m benchmarks.xmix_bench"
M=benchmarks/models/mixtral_8x7b
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt 2>&1
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${MIB:-0}" -gt 100000 ]; then MEM=0.45; ONE=0; else MEM=0.9; ONE=1; fi
up() {  # up LOG PID: wait (at most 10 min) until LOG says the engine is up (vLLM's "init engine ... took") or PID exited
  for _ in $(seq 300); do grep -q "init engine" "$1" 2>/dev/null && return; kill -0 "$2" 2>/dev/null || return; sleep 2; done
}
if [ "${MHOOKS:-1}" = 1 ]; then
  if [ $ONE = 1 ]; then
    $B hooks-check --model $M --quantization fp8 --gpu-mem $MEM --out $R/mix_graphs.json > $R/mix_hooks.log 2>&1
    $B hooks-check --model $M --quantization fp8 --gpu-mem $MEM --eager --out $R/mix_eager.json > $R/mix_hooks_eager.log 2>&1
  else  # side by side, the second started once the first is up (each engine measures the memory left)
    $B hooks-check --model $M --quantization fp8 --gpu-mem $MEM --out $R/mix_graphs.json > $R/mix_hooks.log 2>&1 &
    up $R/mix_hooks.log $!
    $B hooks-check --model $M --quantization fp8 --gpu-mem $MEM --eager --out $R/mix_eager.json > $R/mix_hooks_eager.log 2>&1
    wait
  fi
  $B hooks-check --compare $R/mix_graphs.json $R/mix_eager.json > $R/mix_compare.txt 2>&1; echo "rc=$?"
fi
echo MHOOKS
[ "${MSERVE:-1}" = 1 ] || { echo ALLDONE; exit 0; }
START="$B serve start --model $M --out $S --latest $S/latest.json --gpu-mem $MEM --server-args=--quantization=fp8 --record-steps"
# (200 warm-up prompts: with 60, the first round after each start-up took 2.6x / 9.3x as long to a
# first token as the second, a271519)
R16="--rates 16 --num-prompts 400 --warmup 1 --warmup-prompts 200 --repeats 2 --dataset random --input-len 256 --range-ratio 0.9 --output-len 128"
SAT="--rates inf --num-prompts 1000 --warmup 1 --warmup-prompts 200 --repeats 2"
if [ $ONE = 1 ]; then
  $START --servers vanilla > $R/mstart_vanilla.log 2>&1; echo "rc=$?"
  $B serve rounds --out $S --latest $S/latest.json $R16 > $R/mr16_vanilla.log 2>&1; echo "rc=$?"
  $B serve rounds --out $S --latest $S/latest.json $SAT > $R/msat_vanilla.log 2>&1; echo "rc=$?"
  $B serve stop --out $S > $R/mstop.log 2>&1
  $START --servers xmix > $R/mstart.log 2>&1; echo "rc=$?"
else
  $START > $R/mstart.log 2>&1; echo "rc=$?"
fi
echo MUP
$B serve rounds --out $S --latest $S/latest.json $R16 --configs inactive,router_mask,steer_all > $R/mr16.log 2>&1; echo "rc=$?"
echo MR16
$B serve rounds --out $S --latest $S/latest.json $SAT --configs inactive,router_mask,steer_all > $R/msat.log 2>&1; echo "rc=$?"
echo MSAT
$B serve stop --out $S >> $R/mstop.log 2>&1
echo ALLDONE
