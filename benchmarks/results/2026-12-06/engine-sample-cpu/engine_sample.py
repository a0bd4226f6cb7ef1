"""py-spy (GIL-held) samples of a served CPU engine core, per app configuration: the one-off
script behind engine_sample.txt. From the repository root, with the CPU environment:
``python benchmarks/results/2026-12-06/engine-sample-cpu/engine_sample.py none,steer_all,seal,probe_one 2``
(samples go to /tmp/ecs/<config>_<round>.txt)."""
import asyncio, collections, json, os, sys, time
sys.path.insert(0, os.getcwd())
os.makedirs("/tmp/ecs", exist_ok=True)
from benchmarks.xmix_bench import api_cpu, api_sample
import psutil

configs = sys.argv[1].split(",")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
model, dep = api_cpu.model_and_deployment(configs)
proc, url = api_cpu._start(model, dep, "/tmp/ecs/server.log")
try:
    kids = psutil.Process(proc.pid).children(recursive=True)
    eng = [k for k in kids if "EngineCore" in " ".join(k.cmdline()) or "EngineCore" in k.name()]
    print("engine core:", [(k.pid, k.name()) for k in eng]); eng = eng[0].pid
    asyncio.run(api_cpu._stream_all(url, model, None, 64, 64, 32))
    res = collections.defaultdict(lambda: collections.Counter()); tot = collections.Counter(); toks = collections.Counter()
    for r in range(rounds):
        for c in configs:
            xargs = None if c == "none" else {"xmix": [c]}
            path = f"/tmp/ecs/{c}_{r}.txt"
            s = api_sample.Sampler(eng, path, rate_hz=500)
            ch, tk = asyncio.run(api_cpu._stream_all(url, model, xargs, 96, 64, 32))
            s.stop()
            toks[c] += tk
            for line in open(path):
                stack, _, n = line.rstrip().rpartition(" ")
                n = int(n); tot[c] += n
                frames = stack.split(";")
                xm = [f for f in frames if "vllm_xmix/" in f]
                if xm:
                    res[c][xm[0].split(" (")[0] + " @ " + xm[0].split("vllm_xmix/")[1].split(":")[0]] += n
    for c in configs:
        us = lambda n: n / 500 * 1e6 / toks[c]
        print(f"{c}: GIL-held {us(tot[c]):.1f} us per token, plugin frames {us(sum(res[c].values())):.1f}")
        for k, n in res[c].most_common(8):
            print(f"    {us(n):7.2f}  {k}")
finally:
    api_cpu._stop(proc)
