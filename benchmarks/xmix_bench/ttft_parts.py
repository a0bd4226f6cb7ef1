"""profile ttft-parts: where a request's time to first token goes, one request at a time, on a
real CPU server: apps off against each configuration named.

One vLLM OpenAI server on the CPU (``api_cpu._start``: the tiny Llama of ``vllm_xmix.tiny``,
float32, enforce_eager, the benchmark deployment of the apps named) answers ``--requests``
streamed completions of ``--prompt`` prompt tokens and 2 output tokens, one at a time (no other
request in flight: nothing waits behind another request's work), per configuration, the
configurations interleaved over ``--rounds`` rounds (ABBA) after a warm-up. Every request's
prompt is new (no prefix-cache hits). Per run, vLLM's own metrics (``server_metrics``): mean
TTFT and its parts, the engine core's queue and prefill, and the rest, ``front_end_ms`` (the
API server's input processing, the trips to and from the engine core and the first output's
processing: what a request's apps add there on an idle server), and the client's median TTFT.
Host time of this machine: compare lines of one run only.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

from . import common

#: the metrics kept per run
KEYS = ("ttft_ms", "queue_ms", "prefill_ms", "front_end_ms")


async def _run(url: str, model: str, xargs, n: int, prompt: int, first_id: int) -> float:
    """The client's median TTFT (ms) of ``n`` streamed requests sent one after the other."""
    import aiohttp

    ttfts = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        for i in range(n):
            rid = first_id + i  # (a prompt no earlier request had: no prefix-cache hit)
            body = {"model": model, "prompt": [10 + rid % 97] + [10 + (rid * 31 + k * 7) % 200 for k in range(prompt - 1)],
                    "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
            if xargs is not None:
                body["vllm_xargs"] = xargs
            t0 = time.perf_counter()
            first = None
            async with s.post(url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:500]}")
                async for line in r.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - t0
            ttfts.append(first * 1e3)
    return statistics.median(ttfts)


def ttft_parts(configs: list[str], requests: int = 40, prompt: int = 200, rounds: int = 4) -> dict:
    """``{"configs": {name: {key: median over runs, "runs": [...]}}, ...}`` for ``configs``
    (``none``: apps off; otherwise an app of the benchmark deployment on every request).

    Raises:
        RuntimeError: the server did not start, or a request was refused.
        ValueError: a prompt longer than the server's 256-token context allows."""
    from . import api_cpu, server_metrics

    if not 1 <= prompt <= 250:
        raise ValueError(f"--prompt {prompt}: 1 to 250 tokens (the server's context is 256)")
    model, deployment = api_cpu.model_and_deployment(configs)
    out: dict = {"configs": {c: {"runs": []} for c in configs}, "requests": requests, "prompt": prompt,
                 "rounds": rounds, "commit": common.git_commit(), "date": common.today(),
                 "command": common.command_line()}
    import tempfile

    log = os.path.join(tempfile.mkdtemp(prefix="xmix-ttft-"), "server.log")  # (kept: the server's log)
    out["server_log"] = log
    proc, url = api_cpu._start(model, deployment, log)
    next_id = 0
    try:
        for c in configs:  # warm-up
            asyncio.run(_run(url, model, None if c == "none" else {"xmix": [c]}, 8, prompt, next_id))
            next_id += 8
        for r in range(rounds):
            for c in (configs if r % 2 == 0 else configs[::-1]):
                meter = server_metrics.MetricsMeter(url)
                client = asyncio.run(_run(url, model, None if c == "none" else {"xmix": [c]}, requests, prompt, next_id))
                next_id += requests
                d = meter.stop(expect=requests)
                out["configs"][c]["runs"].append({"client_ttft_median_ms": round(client, 3),
                                                  **{k: d.get(k) for k in KEYS}, "prefix_cache_hits": d.get("prefix_cache_hits")})
    finally:
        api_cpu._stop(proc)
    for c, v in out["configs"].items():
        for k in ("client_ttft_median_ms", *KEYS):
            vals = [x[k] for x in v["runs"] if x.get(k) is not None]
            v[k] = round(statistics.median(vals), 4) if vals else None
    return out
