"""Run vLLM's OpenAI server with uvicorn's RequestResponseCycle.send timed (thread CPU ns,
synchronous part only) and StreamingResponse body iteration counted; dump on SIGUSR1."""
import os, signal, runpy, time, json
import uvicorn.protocols.http.httptools_impl as h
orig = h.RequestResponseCycle.send
S = {"n": 0, "cpu": 0, "bytes": 0, "paused": 0}
async def send(self, message):
    if self.flow.write_paused and not self.disconnected:
        S["paused"] += 1
        await self.flow.drain()
    t = time.thread_time_ns()
    b = message.get("body")
    await orig(self, message)   # (no await inside now: not paused)
    S["cpu"] += time.thread_time_ns() - t
    S["n"] += 1
    if b: S["bytes"] += len(b)
h.RequestResponseCycle.send = send
def dump(*_):
    with open(os.environ["TIMED_OUT"], "w") as f:
        json.dump(S, f)
    for k in S: S[k] = 0
signal.signal(signal.SIGUSR1, dump)
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
