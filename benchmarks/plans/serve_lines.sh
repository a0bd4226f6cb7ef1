#!/bin/bash
# Every serving budget line of Llama-3.1-8B, then Qwen3-8B (~38 min in all on an H100, an estimate from
# its measured start-ups and runs: more than one lease; STEPS splits it):
# rate 16 for apps off and each app, then saturation for the same and for all_apps and 256
# distinct configurations, 2 interleaved rounds each. The servers run as vLLM defaults them apart
# from the memory share; no step recorder, no API profiler. Ordered so that a lease cut short
# keeps the lines measured first.
# STEPS (default "LR16 LSAT QR16 QSAT"): the steps to run, in this order whatever the order given;
# a model's servers start only for its steps. On a card of more than 100 GB Llama gets the A/A
# control server (three servers at 0.3); on an 80 GB card three servers at 0.3 ran out of memory
# at saturation (the control's engine, 2026-12-06), so there it is two servers at 0.42, no control.
# LAPI / QAPI (not in the default): after the model's saturation rounds, one unmeasured saturation
# run each of plain vLLM, apps off, the probe and all apps with py-spy sampling each server's API
# server (`serve rounds --api-sample`: GIL-held microseconds per output token, the functions that
# grew; ~2 min). API_CONFIGS (default inactive,probe_one,all_apps): the configurations sampled
# beside plain vLLM. py-spy: on PATH, or XMIX_PY_SPY, or carried as .gpu/bin/py-spy.
# API_R16=1: the sampled runs at rate 16 with the rate-16 steps' workload (400 prompts) in place
# of saturation.
# R16_APPS (default: every app): the apps of the rate-16 steps (apps off always runs, last).
# SAT_APPS (default: every app, all_apps and steer_all_K256): the configurations of the
# saturation steps (apps off always runs, last).
# CONTROL=0: no A/A control server on a large card either (two servers at 0.42: a shorter start).
# CONTROL=force: the A/A control on any card, three servers at 0.3 (on an 80 GB card for the
# rate-16 steps only: three at 0.3 held rate 16 there, fc7d26a, and ran out at saturation).
# ALT=onoff|pieces|pieces64|none: one more plugin server with that CUDA-graph variant policy (`serve start
# --alt-variants`: its start-up and graph memory in servers.json; its configurations alt_inactive,
# alt_<app> in summary.md only, never latest.json); name them in R16_APPS / SAT_APPS (e.g.
# R16_APPS=steer_one,alt_steer_one,steer_all,alt_steer_all). Memory share 0.3 a server with three,
# 0.22 with four (ALT and the control: a card of more than 100 GB).
# ROUNDS (default 2): interleaved rounds of the rate-16 and saturation steps (a P99 line rests on
# ~30-40 gaps a run: `itl-tail`; more rounds resolve it).
# RECORD_STEPS=1: the servers record every engine step they run (`serve start --record-steps`:
# each run's decode and prefill-carrying step periods and the scheduler's host time in results.json).
# PIN_CPUS=1: each server and the client on physical CPU cores of their own (`serve start
# --pin-cpus`; pinned rounds pair only with pinned rounds, and their workload says so; a host whose
# CPUs cannot be split so refuses before launching, and the servers then start unpinned, the log
# saying so).
# LUP / QUP (not in the default): the model's servers started (each on compile caches of its own,
# cold on a fresh machine: start-up and graph memory into latest.json) even with no other step.
# LWARM / QWARM (not in the default): last, the servers stopped and started again in the same
# folder, both on the compile caches their first start filled (`serve start` gives each server
# its own): start-up and graph memory with warm caches, as a restarted deployment sees them
# (the first start's, both cold, are in servers.json before it; ~3.5 min for Llama).
# Markers: LUP LR16 LSAT LAPI LWARM QUP QR16 QSAT QAPI QWARM ALLDONE (a step left out still prints
# its marker).
# See README.md.
cd "${XMIX_REPO:?}" || exit 1
source /root/xmix-env.sh
R=/root/res; mkdir -p $R
B="python3 -m benchmarks.xmix_bench"
STEPS=" ${STEPS:-LR16 LSAT QR16 QSAT} "
has() { case "$STEPS" in *" $1 "*) return 0;; esac; return 1; }
for step in $STEPS; do  # a misspelt step would run nothing and still print every marker
  case "$step" in LUP|LR16|LSAT|LAPI|LWARM|QUP|QR16|QSAT|QAPI|QWARM) ;; *) echo "STEPS: unknown step '$step' (LUP LR16 LSAT LAPI LWARM QUP QR16 QSAT QAPI QWARM, space-separated)"; echo ALLDONE; exit 2;; esac
done
echo "steps:$STEPS"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt 2>&1
R16W="--rates 16 --num-prompts 400 --dataset random --input-len 256 --range-ratio 0.9 --output-len 128"  # (the rate-16 workload)
R16="$R16W --repeats ${ROUNDS:-2}"
SAT="--rates inf --num-prompts 1000 --repeats ${ROUNDS:-2}"
# apps off last: with ABBA rounds it runs at the centre of each pair of rounds, where a hump in
# the machine's speed (seen 2026-12-06: the runs around the rounds' boundary slower) would show on
# a line expected at 0
APPS="steer_all,ablate_all,probe_one,seal,cast"
SOPTS=""; [ "${RECORD_STEPS:-0}" = 1 ] && SOPTS="--record-steps"
[ "${PIN_CPUS:-0}" = 1 ] && SOPTS="$SOPTS --pin-cpus"
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ -f .gpu/bin/py-spy ] && chmod +x .gpu/bin/py-spy && export XMIX_PY_SPY=${XMIX_PY_SPY:-$PWD/.gpu/bin/py-spy}
if { [ "${MIB:-0}" -gt 100000 ] && [ "${CONTROL:-1}" = 1 ]; } || [ "${CONTROL:-1}" = force ]; then LMEM="0.3 --control"; AA="aa_plain,"; QMEM=0.3; else LMEM=0.42; AA=""; QMEM=0.42; fi
if [ -n "${ALT:-}" ]; then  # one more server: smaller shares
  SOPTS="$SOPTS --alt-variants $ALT"
  if [ -n "$AA" ]; then LMEM="0.22 --control"; QMEM=0.22; else LMEM=0.3; QMEM=0.3; fi
fi

# one model's servers and steps: model TAG (L/Q: markers TAGUP TAGR16 TAGSAT, logs tag*.log),
# its config folder, the serving folder's name, --gpu-mem (and server options), configurations
# before the apps
model() {
  local T=$1 M=$2 S=/root/xmix-serve/$3 MEM=$4 PRE=$5 t; t=$(echo "$1" | tr LQ lq); mkdir -p $S
  if has ${T}UP || has ${T}R16 || has ${T}SAT || has ${T}API || has ${T}WARM; then
    $B serve start --model $M --out $S --latest $S/latest.json --gpu-mem $MEM $SOPTS > $R/${t}start.log 2>&1; rc=$?; echo "rc=$rc"
    # a host whose CPUs cannot be split refuses before anything starts: run unpinned rather than not at all
    if [ $rc != 0 ] && grep -q -- "--pin-cpus:" $R/${t}start.log; then
      echo "pinning refused, starting unpinned: $(grep -m1 -- '--pin-cpus:' $R/${t}start.log)"
      mv $R/${t}start.log $R/${t}start_pin_refused.log; SOPTS=${SOPTS/--pin-cpus/}
      $B serve start --model $M --out $S --latest $S/latest.json --gpu-mem $MEM $SOPTS > $R/${t}start.log 2>&1; echo "rc=$?"
    fi
  fi
  echo ${T}UP
  if has ${T}R16; then
    $B serve rounds --out $S --latest $S/latest.json $R16 --warmup 1 --warmup-prompts 60 \
      --configs $PRE${R16_APPS:-$APPS},inactive > $R/${t}r16.log 2>&1; echo "rc=$?"
  fi
  echo ${T}R16
  if has ${T}SAT; then
    $B serve rounds --out $S --latest $S/latest.json $SAT --warmup 1 --warmup-prompts 200 \
      --configs $PRE${SAT_APPS:-$APPS,all_apps,steer_all_K256},inactive > $R/${t}sat.log 2>&1; echo "rc=$?"
  fi
  echo ${T}SAT
  if has ${T}API; then
    local AW="--rates inf --num-prompts 1000"; [ "${API_R16:-0}" = 1 ] && AW="$R16W"
    $B serve rounds --out $S --no-latest $AW --warmup 0 --repeats 0 \
      --api-sample ${API_CONFIGS:-inactive,probe_one,all_apps} > $R/${t}api_sample.log 2>&1; echo "rc=$?"
    cp $S/api_sample.json $R/${t}api_sample.json 2>/dev/null
    for f in $S/api_sample_*.txt; do [ -f "$f" ] && gzip -c "$f" > $R/$t$(basename "$f").gz; done
  fi
  echo ${T}API
  $B serve stop --out $S > $R/${t}stop.log 2>&1
  if has ${T}WARM; then
    cp $S/servers.json $R/${t}servers_cold.json 2>/dev/null
    $B serve start --model $M --out $S --latest $S/latest.json --gpu-mem $MEM $SOPTS > $R/${t}start_warm.log 2>&1; echo "rc=$?"
    cp $S/servers.json $R/${t}servers_warm.json 2>/dev/null
    $B serve stop --out $S >> $R/${t}stop.log 2>&1
  fi
  echo ${T}WARM
}
model L benchmarks/models/llama31_8b llama "$LMEM" "$AA"
model Q benchmarks/models/qwen3_8b qwen "$QMEM" ""
echo ALLDONE
