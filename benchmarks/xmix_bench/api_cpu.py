"""profile api-cpu: the API server's CPU time per streamed chunk, on a real CPU server.

At saturation a probe's throughput line is bounded by the OpenAI server's event loop (RESULTS.md:
its busiest thread near 1.0 while the engine core idles), so what counts is the API server's
CPU time per streamed token with and without the app. This starts one vLLM OpenAI server on
the CPU (``python -m vllm.entrypoints.openai.api_server``, the tiny Llama of
``vllm_xmix.tiny``, float32, enforce_eager) with the benchmark deployment built for that model
(``common.serving_apps``), streams ``--requests`` completions of ``--tokens`` tokens
(``--concurrency`` at a time, 32-token prompts) per configuration (``none``: no selection;
otherwise ``vllm_xargs.xmix`` = [name]; ``plain``: no selection, on a second server of the same
model without the plugin, ``VLLM_PLUGINS=""``; ``empty``: no selection, on a server with the
plugin loaded and nothing deployed; each started only when named), configurations interleaved
over ``--rounds`` rounds
after a discarded warm-up, and reads the server's process tree's CPU times around each run
(``cpu_usage.CpuMeter``). Per configuration: the median over rounds of the API server's and
the engine core's CPU microseconds per streamed chunk, and the API server's per streamed token
(a chunk carries several tokens when vLLM merges the outputs of a stream whose consumer lags). CPU time on this machine: compare lines
of one machine and one run only; the model's compute is in the engine core's line.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from . import common
from .cpu_usage import CpuMeter


async def _stream_all(url: str, model: str, xargs, n: int, tokens: int, concurrency: int) -> tuple[int, int]:
    """(streamed chunks, streamed tokens) of ``n`` requests: a chunk may carry several tokens
    (vLLM merges a stream's outputs while its consumer lags behind)."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)

    async def one(session, i: int) -> tuple[int, int]:
        body = {"model": model, "prompt": [10 + (i * 7 + k) % 200 for k in range(32)], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
        if xargs is not None:
            body["vllm_xargs"] = xargs
        chunks = toks = 0
        async with sem, session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:500]}")
            async for line in r.content:
                if line.startswith(b"data: {"):
                    chunks += 1
                    toks += sum(len(c.get("token_ids") or ()) for c in json.loads(line[6:])["choices"])
        return chunks, toks

    # a connection per request: a kept-alive connection the server has closed meanwhile would be
    # reused by the next request and end it with ServerDisconnectedError
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        got = await asyncio.gather(*[one(s, i) for i in range(n)])
    return sum(c for c, _ in got), sum(t for _, t in got)


#: the configurations that run on a server of their own, nothing deployed: name -> plugin loaded
SERVERS = {"plain": False, "empty": True}


def _start(model: str, deployment: dict | None, log: str, plugin: bool = True,
           profile_out: str | None = None) -> tuple[subprocess.Popen, str]:
    """A CPU OpenAI server of ``model`` with ``deployment`` (None: nothing deployed), the plugin
    loaded unless ``plugin`` is False; (its process, its URL) once it answers. ``profile_out``:
    run it under ``profiled_server.py`` (profiles switched by signals, written to
    ``profile_out.<k>``). A server that exits with ``Address already in use`` (another process
    took the free port chosen for it during its start-up) is started again on another port, up
    to three times."""
    for _ in range(2):
        try:
            return _start_once(model, deployment, log, plugin, profile_out)
        except _PortTaken:
            pass
    return _start_once(model, deployment, log, plugin, profile_out)


class _PortTaken(RuntimeError):
    """The server exited because its port was taken before it bound it."""


def _start_once(model: str, deployment: dict | None, log: str, plugin: bool,
                profile_out: str | None) -> tuple[subprocess.Popen, str]:
    """One try of :func:`_start`.

    Raises:
        _PortTaken: the server exited with ``Address already in use``.
        RuntimeError: it exited otherwise, or did not answer in 600 s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = "vllm.entrypoints.openai.api_server" if profile_out is None else "benchmarks.xmix_bench.profiled_server"
    cmd = [sys.executable, "-m", server, "--model", model, "--dtype", "float32",
           "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "32", "--port", str(port),
           "--host", "127.0.0.1"]
    if deployment is not None:
        cmd += ["--additional-config", json.dumps(deployment)]
    env = dict(os.environ)
    if not plugin:
        env["VLLM_PLUGINS"] = ""
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core in its own process, as served
    if profile_out is not None:
        env["XMIX_PROFILE_OUT"] = profile_out
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(common.REPO), env.get("PYTHONPATH")) if x)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            _stop(proc)  # (what it started, e.g. an engine core)
            out = open(log).read()[-3000:]
            raise (_PortTaken if "Address already in use" in out else RuntimeError)(
                f"the server exited; see {log}:\n" + out)
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1)
    _stop(proc)
    raise RuntimeError(f"the server did not answer in 600 s; see {log}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def model_and_deployment(configs: list[str]) -> tuple[str, dict]:
    """The tiny Llama's folder and the benchmark deployment for it (``common.serving_apps``: the
    apps ``configs`` name, or the probe alone; ``fused_writes="none"``), as the servers here use them."""
    from vllm_xmix import deploy
    from vllm_xmix.tiny import build_tiny_model

    model = build_tiny_model("llama")
    names = [c for c in configs if c != "none" and c not in SERVERS]
    apps = common.serving_apps(common.load_config(model), names=names or ["probe_one"])
    return model, deploy(*apps, fused_writes="none")


def api_cpu(configs: list[str], requests: int = 96, tokens: int = 64, concurrency: int = 32,
            rounds: int = 3) -> dict:
    """``{"configs": {name: {"api_us_per_chunk": median, "engine_us_per_chunk": median, "runs":
    [...]}}, ...}`` (see the module docstring).

    Raises:
        RuntimeError: the server did not start, or a request was refused."""
    model, deployment = model_and_deployment(configs)
    tmp = tempfile.mkdtemp(prefix="xmix-api-cpu-")
    log = os.path.join(tmp, "server.log")
    out: dict = {"configs": {c: {"runs": []} for c in configs}, "requests": requests, "tokens": tokens,
                 "concurrency": concurrency, "rounds": rounds, "commit": common.git_commit(),
                 "date": common.today(), "command": common.command_line(), "server_log": log}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        servers["xmix"] = _start(model, deployment, log)
        for c in configs:
            if c in SERVERS:
                out[f"server_log_{c}"] = os.path.join(tmp, f"server-{c}.log")
                servers[c] = _start(model, None, out[f"server_log_{c}"], plugin=SERVERS[c])
        for proc, url in servers.values():  # warm-up
            asyncio.run(_stream_all(url, model, None, requests, tokens, concurrency))
        for _ in range(rounds):
            for c in configs:
                xargs = None if c == "none" or c in SERVERS else {"xmix": [c]}
                proc, url = servers[c if c in SERVERS else "xmix"]
                meter = CpuMeter(proc.pid)
                chunks, toks = asyncio.run(_stream_all(url, model, xargs, requests, tokens, concurrency))
                cpu = meter.stop()
                api, eng = (cpu.get(r, {}).get("cpu_s", 0.0) for r in ("api_server", "engine_core"))
                out["configs"][c]["runs"].append({
                    "chunks": chunks, "tokens": toks,
                    "api_us_per_chunk": round(api / chunks * 1e6, 2), "api_us_per_token": round(api / toks * 1e6, 2),
                    "engine_us_per_chunk": round(eng / chunks * 1e6, 2)})
    finally:
        for proc, _ in servers.values():
            _stop(proc)
    for c, r in out["configs"].items():
        for k in ("api_us_per_chunk", "api_us_per_token", "engine_us_per_chunk"):
            r[k] = statistics.median(x[k] for x in r["runs"])
    return out
