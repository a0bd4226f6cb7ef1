#!/bin/bash
# Every serving budget line of Llama-3.1-8B, then Qwen3-8B, in one lease (~27 min on an H200):
# rate 16 for apps off and each app, then saturation for the same and for all_apps and 256
# distinct configurations, 2 interleaved rounds each. The servers run as vLLM defaults them apart
# from the memory share; no step recorder, no API profiler. Ordered so that a lease cut short
# keeps the lines measured first.
# STEPS (default "LR16 LSAT QR16 QSAT"): the steps to run, in this order whatever the order given;
# a model's servers start only for its steps. On a card of more than 100 GB Llama gets the A/A
# control server (three servers at 0.3); on an 80 GB card three servers at 0.3 ran out of memory
# at saturation (the control's engine, 2026-12-06), so there it is two servers at 0.42, no control.
# Markers: LUP LR16 LSAT QUP QR16 QSAT ALLDONE (a step left out still prints its marker).
# See README.md.
cd "${XMIX_REPO:?}" || exit 1
source /root/xmix-env.sh
R=/root/res; mkdir -p $R
B="python3 -m benchmarks.xmix_bench"
STEPS=" ${STEPS:-LR16 LSAT QR16 QSAT} "
has() { case "$STEPS" in *" $1 "*) return 0;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt 2>&1
R16="--rates 16 --num-prompts 400 --dataset random --input-len 256 --range-ratio 0.9 --output-len 128 --repeats 2"
SAT="--rates inf --num-prompts 1000 --repeats 2"
# apps off last: with ABBA rounds it runs at the centre of the sequence, where a hump in the
# machine's speed (seen 2026-12-06: both rounds' middle runs slower) would show on a line expected at 0
APPS="steer_all,ablate_all,probe_one,seal,cast"
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${MIB:-0}" -gt 100000 ]; then LMEM="0.3 --control"; AA="aa_plain,"; QMEM=0.3; else LMEM=0.42; AA=""; QMEM=0.42; fi

S=/root/xmix-serve/llama; mkdir -p $S
if has LR16 || has LSAT; then
  $B serve start --model benchmarks/models/llama31_8b --out $S --latest $S/latest.json --gpu-mem $LMEM \
    > $R/lstart.log 2>&1; echo "rc=$?"
fi
echo LUP
if has LR16; then
  $B serve rounds --out $S --latest $S/latest.json $R16 --warmup 1 --warmup-prompts 60 \
    --configs $AA$APPS,inactive > $R/lr16.log 2>&1; echo "rc=$?"
fi
echo LR16
if has LSAT; then
  $B serve rounds --out $S --latest $S/latest.json $SAT --warmup 1 --warmup-prompts 200 \
    --configs $AA$APPS,all_apps,steer_all_K256,inactive > $R/lsat.log 2>&1; echo "rc=$?"
fi
echo LSAT
$B serve stop --out $S > $R/lstop.log 2>&1

S=/root/xmix-serve/qwen; mkdir -p $S
if has QR16 || has QSAT; then
  $B serve start --model benchmarks/models/qwen3_8b --out $S --latest $S/latest.json --gpu-mem $QMEM \
    > $R/qstart.log 2>&1; echo "rc=$?"
fi
echo QUP
if has QR16; then
  $B serve rounds --out $S --latest $S/latest.json $R16 --warmup 1 --warmup-prompts 60 \
    --configs $APPS,inactive > $R/qr16.log 2>&1; echo "rc=$?"
fi
echo QR16
if has QSAT; then
  $B serve rounds --out $S --latest $S/latest.json $SAT --warmup 1 --warmup-prompts 200 \
    --configs $APPS,all_apps,steer_all_K256,inactive > $R/qsat.log 2>&1; echo "rc=$?"
fi
echo QSAT
$B serve stop --out $S > $R/qstop.log 2>&1
echo ALLDONE
