# API-server CPU per streamed chunk split into user and system time, apps off ("none") and a probe, one CPU server (the tiny Llama of profile api-cpu), 96 requests x 64 tokens, 32 at a time, 5 interleaved rounds
import asyncio, sys, os, psutil, json, statistics
import pathlib; HERE = pathlib.Path(__file__).resolve().parent; sys.path.insert(0, str(HERE.parents[3]))
from benchmarks.xmix_bench import api_cpu as A
configs = ["none", "probe_one"]
model, dep = A.model_and_deployment(configs)
proc, url = A._start(model, dep, str(HERE / "usersys_server.log"))
try:
    p = psutil.Process(proc.pid)
    asyncio.run(A._stream_all(url, model, None, 96, 64, 32))
    res = {c: [] for c in configs}
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
        for c in configs:
            xargs = None if c == "none" else {"xmix": [c]}
            t0 = p.cpu_times(); ctx0 = p.num_ctx_switches()
            ch, tok = asyncio.run(A._stream_all(url, model, xargs, 96, 64, 32))
            t1 = p.cpu_times(); ctx1 = p.num_ctx_switches()
            res[c].append(((t1.user - t0.user) / ch * 1e6, (t1.system - t0.system) / ch * 1e6,
                           (ctx1.voluntary - ctx0.voluntary) / ch, (ctx1.involuntary - ctx0.involuntary) / ch, ch))
    for c, rs in res.items():
        print(c, "user us/chunk", [round(x[0], 1) for x in rs], "sys", [round(x[1], 1) for x in rs],
              "vol ctx/chunk", [round(x[2], 2) for x in rs], "invol", [round(x[3], 2) for x in rs], "chunks", [x[4] for x in rs])
finally:
    A._stop(proc)
