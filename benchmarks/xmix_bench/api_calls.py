"""profile api-calls: Python function calls per streamed chunk in the OpenAI API server's event
loop, on real CPU servers, per configuration.

CPU time on a shared 2-core machine moves by more than the differences in question (``profile
api-cpu`` measured 5-7 us per chunk between separately started servers and could not resolve
it); the number of Python calls the server's main thread makes moves much less with the
machine's load. Per request and per chunk it is exact; what moves is the front end's work per
batch of outputs the engine core sends (vLLM's stats and metrics, the output handler's loop),
which follows how many requests' outputs arrive together, and how many tokens a chunk carries
(a lagging stream's outputs are merged). So besides the totals per chunk and per token the
calls made in and directly from the plugin's own functions are counted apart (``plugin``:
exact, 0 without the plugin).
This starts the servers of ``api_cpu`` (a tiny Llama, float32, eager; ``plain``: without the
plugin, ``empty``: the plugin with nothing deployed, otherwise the benchmark deployment) under
``profiled_server.py``, streams ``--requests`` completions of ``--tokens`` tokens per
configuration after a warm-up (``none``: no selection; an app name: ``vllm_xargs.xmix`` = [name])
with a cProfile of the server's main thread on around exactly those requests, and reports per
configuration: calls per streamed chunk, the functions whose calls per chunk changed most
against the first configuration, and the garbage collector's work (collections, seconds,
objects collected per request). The engine core (another process) is not profiled here: its
per-step work is ``profile vs-plain``'s."""

from __future__ import annotations

import asyncio
import os
import pstats
import signal
import tempfile
import time

from . import common
from .api_cpu import SERVERS, _start, _stop, _stream_all, model_and_deployment


def _label(f: str, ln: int, fn: str) -> str:
    if f == "~":
        return fn
    for root in ("site-packages" + os.sep, str(common.REPO) + os.sep):
        if root in f:
            f = f.split(root, 1)[1]
            break
    return f"{f}:{ln}({fn})"


def _is_plugin(f: str) -> bool:
    return f"{os.sep}vllm_xmix{os.sep}" in f


def _calls(path: str) -> tuple[dict[str, int], int]:
    """({function: calls}, calls made in or directly from the plugin's functions) of one pstats
    file (built-in methods of different objects merged by name)."""
    out: dict[str, int] = {}
    plugin = 0
    for (f, ln, fn), (cc, nc, tt, ct, callers) in pstats.Stats(path).stats.items():
        plugin += nc if _is_plugin(f) else sum(v[1] for (cf, _, _), v in callers.items() if _is_plugin(cf))
        if f == "~" and " at 0x" in fn:  # e.g. "<built-in method __new__ of type object at 0x...>"
            fn = fn.split(" at 0x")[0] + ">"
        key = _label(f, ln, fn)
        out[key] = out.get(key, 0) + nc
    return out, plugin


def api_calls(configs: list[str], requests: int = 64, tokens: int = 64, concurrency: int = 32,
              top: int = 15) -> dict:
    """``{"configs": {name: {"chunks", "tokens", "calls_per_chunk", "calls_per_token",
    "plugin_calls_per_chunk", "plugin_calls_per_token", "gc": {...}, "changed":
    [[function, calls per chunk here, in the first configuration], ...] (the ``top`` that moved
    most), "plugin_only": [[function, calls per chunk], ...] (every function of the plugin this
    configuration calls and the first one never does)}}, ...}`` (see the module docstring).

    Raises:
        RuntimeError: a server did not start, or a request was refused."""
    model, deployment = model_and_deployment(configs)
    tmp = tempfile.mkdtemp(prefix="xmix-api-calls-")
    out: dict = {"configs": {}, "requests": requests, "tokens": tokens, "concurrency": concurrency,
                 "commit": common.git_commit(), "date": common.today(), "command": common.command_line(),
                 "profiles": tmp}
    servers: dict[str, tuple] = {}
    try:
        if any(c not in SERVERS for c in configs):
            servers["xmix"] = _start(model, deployment, os.path.join(tmp, "xmix.log"),
                                     profile_out=os.path.join(tmp, "xmix.prof"))
        for c in configs:
            if c in SERVERS:
                servers[c] = _start(model, None, os.path.join(tmp, f"{c}.log"), plugin=SERVERS[c],
                                    profile_out=os.path.join(tmp, f"{c}.prof"))
        for proc, url in servers.values():  # warm-up, not profiled
            asyncio.run(_stream_all(url, model, None, requests, tokens, concurrency))
        taken = {name: 0 for name in servers}
        raw: dict[str, dict[str, int]] = {}
        for c in configs:
            srv = c if c in SERVERS else "xmix"
            proc, url = servers[srv]
            xargs = None if c == "none" or c in SERVERS else {"xmix": [c]}
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.5)  # (the handler runs between the event loop's callbacks)
            chunks, toks = asyncio.run(_stream_all(url, model, xargs, requests, tokens, concurrency))
            time.sleep(0.5)
            os.kill(proc.pid, signal.SIGUSR2)
            path = os.path.join(tmp, f"{srv}.prof.{taken[srv]}")
            taken[srv] += 1
            for _ in range(100):
                if os.path.exists(path + ".gc.json"):
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError(f"profile api-calls: the {srv} server wrote no profile in 10 s ({path})")
            raw[c], plugin = _calls(path)
            g = common.read_json(path + ".gc.json")
            out["configs"][c] = {
                "chunks": chunks, "tokens": toks, "calls_per_chunk": round(sum(raw[c].values()) / chunks, 2),
                "calls_per_token": round(sum(raw[c].values()) / toks, 2),
                "plugin_calls_per_chunk": round(plugin / chunks, 2), "plugin_calls_per_token": round(plugin / toks, 2),
                "gc": {"collections": g["collections"], "seconds": [round(x, 5) for x in g["seconds"]],
                       "collected_per_request": round(g["collected"] / requests, 2),
                       "tracked_start": g["tracked_start"], "tracked_end": g["tracked_end"], "frozen": g["frozen"]}}
    finally:
        for proc, _ in servers.values():
            _stop(proc)
    ref = configs[0]
    for c in configs:
        a, b = raw[ref], raw[c]
        na, nb = out["configs"][ref]["chunks"], out["configs"][c]["chunks"]
        moved = sorted(((k, b.get(k, 0) / nb, a.get(k, 0) / na) for k in set(a) | set(b)),
                       key=lambda r: -abs(r[1] - r[2]))
        out["configs"][c]["changed"] = [[k, round(x, 3), round(y, 3)] for k, x, y in moved[:top] if x != y]
        # (the top list moves with the front end's per-batch work, which follows timing; these are exact)
        out["configs"][c]["plugin_only"] = [[k, round(x, 3)] for k, x, y in moved if "vllm_xmix/" in k and y == 0 < x]
    return out


def report(r: dict) -> str:
    """The result as text: calls per chunk against the first configuration, what changed most."""
    cfgs = list(r["configs"])
    ref = r["configs"][cfgs[0]]["calls_per_chunk"]
    ref_t = r["configs"][cfgs[0]]["calls_per_token"]
    lines = [f"API server main thread, Python calls per streamed chunk and per token ({r['requests']} requests x "
             f"{r['tokens']} tokens, {r['concurrency']} at a time; against {cfgs[0]}; a chunk carries several tokens "
             "when its stream lags):"]
    for c in cfgs:
        v = r["configs"][c]
        g = v["gc"]
        lines.append(f"  {c:12s} {v['calls_per_chunk']:8.2f} per chunk ({v['calls_per_chunk'] / ref - 1:+.1%}), "
                     f"{v['calls_per_token']:8.2f} per token ({v['calls_per_token'] / ref_t - 1:+.1%}); plugin "
                     f"{v['plugin_calls_per_chunk']:.2f} per chunk, {v['plugin_calls_per_token']:.2f} per token; chunks "
                     f"{v['chunks']}, gc collections {g['collections']} ({sum(g['seconds']) * 1e3:.1f} ms), "
                     f"{g['collected_per_request']} objects collected per request")
    for c in cfgs[1:]:
        lines.append(f"  {c}: calls per chunk that changed most (here / {cfgs[0]})")
        lines += [f"    {x - y:+8.3f}  {x:.3f} / {y:.3f}  {k}" for k, x, y in r["configs"][c]["changed"]]
    return "\n".join(lines)
