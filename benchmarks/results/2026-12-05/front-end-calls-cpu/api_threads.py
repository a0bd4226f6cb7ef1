# the API server process's CPU per streamed token, per thread, apps off and a probe, 4 interleaved rounds
import asyncio, os, sys, time, json
import pathlib
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))  # the repository root
from benchmarks.xmix_bench.api_cpu import _start, _stop, _stream_all, model_and_deployment
import psutil

def tstat(pid):
    out = {}
    p = psutil.Process(pid)
    for th in p.threads():
        try:
            name = open(f'/proc/{pid}/task/{th.id}/comm').read().strip()
        except OSError:
            name = '?'
        out[th.id] = (name, th.user_time + th.system_time)
    return out

model, dep = model_and_deployment(['probe_one'])
proc, url = _start(model, dep, str(HERE / 'thr_server.log'))
try:
    asyncio.run(_stream_all(url, model, None, 96, 64, 32))
    res = {}
    for rnd in range(4):
        for c in (['none', 'probe_one'] if rnd % 2 == 0 else ['probe_one', 'none']):
            xargs = None if c == 'none' else {'xmix': [c]}
            t0 = tstat(proc.pid)
            chunks, toks = asyncio.run(_stream_all(url, model, xargs, 96, 64, 32))
            t1 = tstat(proc.pid)
            per = {}
            for tid, (name, s) in t1.items():
                d = s - t0.get(tid, (name, 0.0))[1]
                key = 'main' if tid == proc.pid else name
                per[key] = per.get(key, 0) + d
            res.setdefault(c, []).append({k: round(v / toks * 1e6, 1) for k, v in per.items() if v > 0})
    for c, runs in res.items():
        print(c)
        for r in runs: print('   ', r)
finally:
    _stop(proc)
