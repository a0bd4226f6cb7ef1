# uvicorn's RequestResponseCycle.send timed by its thread's CPU time (launch_timed.py wraps it inside the API server), apps off ("none") and a probe, 3 interleaved rounds
import asyncio, sys, os, json, signal, time, subprocess
import pathlib; HERE = pathlib.Path(__file__).resolve().parent; ROOT = HERE.parents[3]; sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(HERE))
from benchmarks.xmix_bench import api_cpu as A
configs = ["none", "probe_one"]
model, dep = A.model_and_deployment(configs)
os.environ["TIMED_OUT"] = str(HERE / "timed.json")
# start via the launcher: reuse _start_once with profile_out-like hook: simplest, patch the module name
orig_popen = subprocess.Popen
def popen(cmd, *a, **k):
    cmd = [c if c != "vllm.entrypoints.openai.api_server" else "launch_timed" for c in cmd]
    k["env"]["PYTHONPATH"] = f"{HERE}:{ROOT}"
    return orig_popen(cmd, *a, **k)
A.subprocess.Popen = popen
proc, url = A._start(model, dep, str(HERE / "send_server.log"))
try:
    asyncio.run(A._stream_all(url, model, None, 96, 64, 32))
    for r in range(3):
        for c in configs:
            xargs = None if c == "none" else {"xmix": [c]}
            os.kill(proc.pid, signal.SIGUSR1); time.sleep(0.3)
            ch, tok = asyncio.run(A._stream_all(url, model, xargs, 96, 64, 32))
            os.kill(proc.pid, signal.SIGUSR1); time.sleep(0.5)
            S = json.load(open(HERE / "timed.json"))
            print(c, "chunks", ch, "sends", S["n"], "send cpu us/chunk", round(S["cpu"] / 1e3 / ch, 2), "bytes/send", round(S["bytes"] / max(S["n"], 1)), "paused", S["paused"], flush=True)
finally:
    A._stop(proc)
