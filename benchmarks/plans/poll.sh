#!/bin/bash
# poll.sh MARKER SECONDS: wait until the plan's log (/root/run.out) has the line MARKER (or
# ALLDONE), at most SECONDS, then pack what the plan has written into one file, $OUT/plan.tgz
# (the device tool brings back only a few files per command): /root/res whole, and of each
# server folder under /root/xmix-serve the small files, each run's recorded engine steps
# (runs/*_steps.npz), the last 4 kB of each server log and its first tracebacks.
W=$1; T=${2:-540}
end=$((SECONDS + T))
while [ $SECONDS -lt $end ]; do
  grep -qx "$W" /root/run.out 2>/dev/null && break
  grep -qx "ALLDONE" /root/run.out 2>/dev/null && break
  sleep 4
done
echo "== waited $SECONDS s for $W"; tail -c 3000 /root/run.out
P=$(mktemp -d)
mkdir -p "$P/res" && cp -r /root/res/. "$P/res/" 2>/dev/null
cp /root/run.out "$P/" 2>/dev/null
for S in /root/xmix-serve/*/; do
  [ -d "$S" ] || continue
  n=$(basename "$S"); mkdir -p "$P/serve/$n"
  cp "$S"/{results.json,servers.json,latest.json,summary.md} "$P/serve/$n/" 2>/dev/null
  # each run's recorded engine steps (--record-steps: tens of kB a run)
  ls "$S"/runs/*_steps.npz > /dev/null 2>&1 && mkdir -p "$P/serve/$n/runs" && cp "$S"/runs/*_steps.npz "$P/serve/$n/runs/"
  for log in "$S"/*.log; do
    [ -f "$log" ] || continue
    tail -c 4000 "$log" > "$P/serve/$n/$(basename "$log").tail"
    # a dead engine's root cause lies far above its log's end: the first tracebacks, whole
    grep -n -B 3 -A 60 -m 3 "Traceback" "$log" | head -c 30000 > "$P/serve/$n/$(basename "$log").errors"
    [ -s "$P/serve/$n/$(basename "$log").errors" ] || rm -f "$P/serve/$n/$(basename "$log").errors"
  done
done
tar czf "$OUT/plan.tgz" -C "$P" . && rm -rf "$P" && ls -la "$OUT/plan.tgz"
