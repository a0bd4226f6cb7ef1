"""profile: where an engine step's time goes, from GPU traces and from host (CPU) profiles.

Actions:

* ``trace TRACE [--json OUT]``: one torch-profiler trace of a vLLM worker
  (``*.pt.trace.json[.gz]``, written with ``--profiler-config '{"profiler": "torch", ...}'``;
  ``serve start --profiler`` + ``serve rounds --profile CONFIGS`` make them). vLLM's GPU worker
  annotates every engine step as ``execute_context_C(Tc)_generation_G(Tg)``: a CPU range and the
  same range on the GPU timeline. Per kind of step (``decode`` by batch size, ``mixed``, a
  prefill chunk in the step, by scheduled tokens, split at the largest CUDA-graph size
  ``--max-graph-tokens``): CPU ms of the range, GPU ms of its GPU range, kernels launched inside
  it, and the interval to the next step's start (what a decoding request sees as inter-token
  latency). With Python stacks in the trace (``torch_profiler_with_stack``; ``serve start
  --profile-stack``): the Python functions by inclusive host ms per step (the 40 largest). For
  the whole trace: kernels by name, CUDA runtime calls by name (launches, graph launches,
  copies, the synchronizing calls), the plugin's ops on the host, the GPU's busy fraction.
* ``compare A.json B.json``: two trace summaries side by side (markdown), incl. the Python
  functions whose time per step grew most.
* ``host``: host time the plugin adds per engine step, cProfile of an in-process engine
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on a 4-layer Llama config with dummy weights (d_model
  64), enforce_eager; per configuration (``none``: no app on; otherwise every request with that
  app on; ``--batch`` requests of ``--tokens`` tokens): steps, wall time per step, the summed
  *self* time of functions defined in ``vllm_xmix`` per step (time in torch ops and in vLLM
  code they call is not included), the 5 functions with the most self time, and the
  *cumulative* time of the entry points (``fill``, ``update_requests``, ``snapshot``,
  ``reads_of``, ``add``, ``assemble``, ``hook_write_``). The hook ops run their torch reference
  kernels here: that time is CPU compute and does not carry over to a GPU.
* ``runtime MODEL_DIR``: no engine; the worker-side runtime alone (``XmixState``, its tables
  on ``--device``: cpu, or cuda where the fill's copies and events are real CUDA calls; the
  benchmark deployment at the config's full size) driven with scheduler outputs shaped like
  vLLM's: per app, the median host ms of ``update_requests`` + ``fill`` + read snapshot /
  transport, whole and per phase, for a mixed step (one new request of 220 prompt tokens beside
  40 decoding ones) and for a decode step, and the functions with the most self time (cProfile).
* ``stream``: the front end's host time per streamed chunk of a request with a probe
  (``stream.py``).
* ``ttft-parts``: TTFT and its parts (queue, prefill, front end) by vLLM's metrics, one request
  at a time on a real CPU server, apps off against each app (``ttft_parts.py``).
* ``norm-call``: host microseconds per call of a norm hosting hook sites with apps off (with
  ``--on``: with its sites' writes on, steering's path), against vLLM's add + RMSNorm called
  directly (what a step without CUDA graphs pays per hosted norm; on a GPU machine the tensors
  are CUDA and the writes are the fused Triton kernel's launch).
* ``api-cpu``: the API server's CPU time per streamed chunk on a real CPU server, per
  configuration (``api_cpu.py``).
* ``api-calls``: the API server's Python calls per streamed chunk on real CPU servers (a
  cProfile of its event loop around the measured requests only), per configuration, and the
  functions whose calls changed most against the first configuration (``api_calls.py``).
* ``vs-plain``: whole engine steps against vLLM without the plugin, compiled (no CUDA graphs
  on a CPU), serving-like arrivals: a 32-layer Llama config (d_model 64, dummy weights), a new
  request of 16-400 prompt tokens every second step beside up to 32 decoding ones,
  ``max_num_batched_tokens`` 512 (chunked prefill). One process without the plugin
  (``VLLM_PLUGINS=""``), one with the benchmark deployment (``--fused-writes``), each driving
  ``LLMEngine.step()`` under cProfile: ms per step that schedules prompt tokens ("mixed", where
  a request's first token comes from) and per decode step, and the functions whose *self* time
  per step grew most against the plain engine (generated Inductor code counted as one
  function). Compute is CPU compute here, so only which functions run carries over to a GPU.
* ``saturation``: per engine (plain vLLM, the plugin with nothing deployed, the benchmark
  deployment with no app on, optionally with an environment setting), in its own process, ms
  per decode step with ``--requests`` requests in flight, and the host's health around it: the
  interpreter's speed, each thread's CPU seconds, the garbage collector, trace hooks
  (:mod:`.saturation`).

The trace summaries are small; the traces themselves (hundreds of MB for a serving run) stay on
the machine that made them.
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import gzip
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from . import common

HELP = "where an engine step's time goes: GPU trace summaries, host-time profiles on the CPU"
STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cudaHostAlloc", "cudaFreeHost", "cudaMallocHost", "cudaFree", "cudaMalloc")


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = sub.add_parser("trace", help="summarize one torch-profiler trace of a vLLM worker")
    t.add_argument("trace", help="a *.pt.trace.json[.gz] file")
    t.add_argument("--json", help="write the summary here")
    t.add_argument("--max-graph-tokens", type=int, default=512, help="the largest CUDA-graph size (mixed steps)")
    c = sub.add_parser("compare", help="two trace summaries side by side")
    c.add_argument("a", metavar="A.json")
    c.add_argument("b", metavar="B.json")
    h = sub.add_parser("host", help="the plugin's host time per engine step (cProfile, in-process CPU engine)")
    h.add_argument("--batch", type=int, default=64)
    h.add_argument("--tokens", type=int, default=64)
    h.add_argument("--configs", default="none,steer_all,probe_one,cast",
                   help="apps on per request (none: no app); the apps named are deployed")
    r = sub.add_parser("runtime", help="the worker-side runtime alone, the benchmark deployment at full size")
    r.add_argument("model", metavar="MODEL_DIR", help="model config folder, e.g. benchmarks/models/llama31_8b")
    r.add_argument("--fused-writes", choices=["auto", "none", "adds", "all", "norm"], default="auto",
                   help="the deployment's fused_writes (adds/all: fill() also writes the per-token fused coefficients)")
    r.add_argument("--steps", type=int, default=300, help="mixed + decode steps per app (the first 50 not counted)")
    r.add_argument("--device", default="cpu",
                   help="where the runtime's tables live (cuda: the fill's copies and events are real CUDA calls, "
                        "as in a GPU engine; the steps are timed after the device finished the previous one)")
    r.add_argument("--json", help="write the per-app medians (ms) and the functions with the most self time here")
    s = sub.add_parser("stream", help="the front end's host time per streamed chunk of a request with a probe")
    s.add_argument("--prompt", type=int, default=256, help="prompt tokens (their values come with the first chunk)")
    s.add_argument("--tokens", type=int, default=128, help="streamed chunks (tokens) per request")
    s.add_argument("--repeats", type=int, default=20, help="streams measured (median of their means)")
    s.add_argument("--layers", type=int, default=1, help="layers the probe reads (a value of each per token)")
    s.add_argument("--json", help="write the result here")
    nc = sub.add_parser("norm-call", help="host us per call of a hosted norm (apps off, or --on) vs vLLM's norm")
    nc.add_argument("--tokens", type=int, default=8)
    nc.add_argument("--on", action="store_true", help="the norm's sites on (steer_all's writes), not apps off")
    nc.add_argument("--calls", type=int, default=20000)
    nc.add_argument("--json", help="write the result here")
    a = sub.add_parser("api-cpu", help="the API server's CPU time per streamed chunk, real CPU server, per app")
    a.add_argument("--configs", default="none,probe_one,steer_all",
                   help="apps on per request (none: no selection), names of the benchmark deployment; "
                        "plain / empty: no selection on a server without the plugin / with nothing deployed")
    a.add_argument("--requests", type=int, default=96, help="streamed requests per run")
    a.add_argument("--tokens", type=int, default=64, help="tokens per request")
    a.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    a.add_argument("--rounds", type=int, default=3, help="interleaved rounds (after a warm-up)")
    a.add_argument("--json", help="write the result here")
    tp = sub.add_parser("ttft-parts", help="TTFT and its parts, one request at a time, real CPU server, per app")
    tp.add_argument("--configs", default="none,probe_one", help="apps on per request (none: apps off)")
    tp.add_argument("--requests", type=int, default=40, help="requests per run")
    tp.add_argument("--prompt", type=int, default=200, help="prompt tokens (1-250)")
    tp.add_argument("--rounds", type=int, default=4, help="interleaved rounds (after a warm-up)")
    tp.add_argument("--json", help="write the result here")
    ac = sub.add_parser("api-calls", help="the API server's Python calls per streamed chunk, real CPU servers")
    ac.add_argument("--configs", default="plain,empty,none,probe_one,steer_all",
                    help="as for api-cpu; the first is what the others are compared with")
    ac.add_argument("--requests", type=int, default=64, help="streamed requests per configuration")
    ac.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ac.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    ac.add_argument("--json", help="write the result here")
    v = sub.add_parser("vs-plain", help="whole engine steps, compiled, serving-like arrivals: plugin vs plain vLLM")
    v.add_argument("--configs", default="inactive,steer_all,probe_one",
                   help="apps on per request (inactive: none), names of the benchmark deployment")
    v.add_argument("--fused-writes", choices=["auto", "none", "adds", "all", "norm"], default="auto",
                   help="the deployment's fused_writes")
    v.add_argument("--steps", type=int, default=300, help="measured engine steps per configuration")
    v.add_argument("--running", type=int, default=0,
                   help="keep this many requests in flight (saturation-like large steps); 0: a new request every "
                        "other step")
    v.add_argument("--json", help="write both engines' per-config results here")
    v.add_argument("--_engine", help=argparse.SUPPRESS)  # internal: one engine of vs-plain
    sa = sub.add_parser("saturation", help="ms per decode step with many requests in flight, and the host's health "
                                           "(interpreter speed, thread CPU) per engine (saturation.py)")
    sa.add_argument("--model", default="benchmarks/models/llama31_8b", help="model config folder")
    sa.add_argument("--engines", default="plain,xmix",
                    help="comma-separated: plain, empty, xmix, or ENGINE@NAME=VALUE (one more environment setting)")
    sa.add_argument("--requests", type=int, default=900, help="requests decoding (above 512: no CUDA graphs)")
    sa.add_argument("--warm-steps", type=int, default=60, help="steps before the timed ones (the prompts' prefill)")
    sa.add_argument("--steps", type=int, default=30, help="decode steps timed (and profiled, with --prof-dir)")
    sa.add_argument("--max-model-len", type=int, default=2048)
    sa.add_argument("--eager", action="store_true", help="enforce_eager (no compile, no CUDA graphs)")
    sa.add_argument("--prof-dir", help="also cProfile as many steps again, one .prof file per engine here")
    sa.add_argument("--rounds", type=int, default=1, help="the engines this many times, every second round reversed")
    sa.add_argument("--json", help="write the result here")
    sa.add_argument("--prof-out", help=argparse.SUPPRESS)  # internal: one engine's profile
    sa.add_argument("--_engine", help=argparse.SUPPRESS)  # internal: one engine


def main(args) -> int:
    if args.action == "trace":
        s = summarize(args.trace, args.max_graph_tokens)
        if args.json:
            common.write_json(args.json, s)
        print(json.dumps({k: s[k] for k in ("n_steps", "span_ms", "gpu_kernel_ms", "gpu_busy_fraction", "steps")},
                         indent=1))
        return 0
    if args.action == "compare":
        print(compare(common.read_json(args.a), common.read_json(args.b), "A", "B"))
        return 0
    if args.action == "stream":
        from .stream import stream_cost

        r = stream_cost(args.prompt, args.tokens, args.repeats, args.layers)
        if args.json:
            common.write_json(args.json, r)
        print(f"front end, streamed chunk of a request with a probe: {r['us_per_chunk']:.1f} us per chunk, "
              f"{r['us_per_decode_chunk']:.1f} per decode chunk, {r['us_final_chunk']:.1f} the final chunk "
              f"(median of {len(r['runs'])} streams of "
              f"{r['tokens']} chunks, prompt {r['prompt']}, {r['layers']} layer(s); minimum over the streams {r['us_per_chunk_min']:.1f} / "
              f"{r['us_per_decode_chunk_min']:.1f} / {r['us_final_chunk_min']:.1f})")
        return 0
    if args.action == "norm-call":
        r = norm_call(args.tokens, args.calls, on=args.on)
        if args.json:
            common.write_json(args.json, r)
        print(f"hosted norm, {'its sites on' if r['on'] else 'apps off'} ({r['device']}): "
              f"{statistics.median(r['hosted_us']):.1f} us per call; vLLM's add + RMSNorm "
              f"directly: {statistics.median(r['direct_us']):.1f} us; the hosting's own cost {r['overhead_us']:.1f} us "
              f"({r['tokens']} tokens, {r['calls']} calls x {len(r['hosted_us'])})")
        return 0
    if args.action == "api-cpu":
        from .api_cpu import api_cpu

        r = api_cpu(args.configs.split(","), args.requests, args.tokens, args.concurrency, args.rounds)
        if args.json:
            common.write_json(args.json, r)
        for c, v in r["configs"].items():
            print(f"{c}: API server {v['api_us_per_chunk']:.1f} us CPU per streamed chunk "
                  f"({v['api_us_per_token']:.1f} per token), engine core {v['engine_us_per_chunk']:.1f} "
                  f"(median of {len(v['runs'])} runs of {r['requests']} requests x {r['tokens']} tokens, "
                  f"{r['concurrency']} at a time)")
        return 0
    if args.action == "ttft-parts":
        from .ttft_parts import ttft_parts

        r = ttft_parts(args.configs.split(","), args.requests, args.prompt, args.rounds)
        if args.json:
            common.write_json(args.json, r)
        for c, v in r["configs"].items():
            print(f"{c}: TTFT {v['ttft_ms']:.3f} ms = queue {v['queue_ms']:.3f} + prefill {v['prefill_ms']:.3f} "
                  f"+ front end {v['front_end_ms']:.3f} (vLLM's metrics; client {v['client_ttft_median_ms']:.3f}; "
                  f"median of {len(v['runs'])} runs of {r['requests']} requests one at a time, prompt {r['prompt']})")
        return 0
    if args.action == "api-calls":
        from .api_calls import api_calls, report

        r = api_calls(args.configs.split(","), args.requests, args.tokens, args.concurrency)
        if args.json:
            common.write_json(args.json, r)
        print(report(r))
        return 0
    if args.action == "saturation":
        from . import saturation as sat

        if args._engine:
            r = sat.engine(args._engine, args.model, args.requests, args.warm_steps, args.steps, args.max_model_len,
                           args.eager, args.prof_out)
            print(sat.MARK + json.dumps(r))
            return 0
        r = sat.saturation(args.model, args.engines.split(","), args.requests, args.warm_steps, args.steps,
                           args.max_model_len, args.eager, args.prof_dir, args.json, args.rounds)
        print(sat.report(r))
        return 0
    # CPU engines: in-process (cProfile sees the worker) and a small KV cache
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.action == "host":
        return host_steps(args.batch, args.tokens, args.configs)
    if args.action == "runtime":
        return runtime_steps(args.model, fused_writes=args.fused_writes, n=args.steps, device=args.device,
                             json_out=args.json)
    if args._engine:
        return engine_steps(args._engine, args.configs, args.fused_writes, args.steps, args.running)
    return vs_plain(args.configs, args.fused_writes, args.steps, args.running, args.json)


# ------------------------------------------------------------------------------ GPU traces


def _load(path: str) -> list[dict]:
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _bucket(kind: str, n: int, max_graph: int) -> str:
    if kind == "decode":
        for hi in (1, 8, 16, 32, 64, 128, 256, 512):
            if n <= hi:
                return f"decode b<={hi}"
        return "decode b>512"
    return f"mixed <={max_graph} tok" if n <= max_graph else f"mixed >{max_graph} tok"


def _med(xs):
    return round(statistics.median(xs), 4) if xs else None


def summarize(path: str, max_graph: int = 512) -> dict:
    """Per-step and whole-trace numbers of one trace (see the module docstring). Raises
    ``ValueError`` when the trace holds no annotated engine step."""
    ev = [e for e in _load(path) if e.get("ph") == "X"]
    cpu_steps = sorted((e for e in ev if e.get("cat") == "user_annotation" and STEP.fullmatch(e["name"])),
                       key=lambda e: e["ts"])
    gpu_steps = sorted((e for e in ev if e.get("cat") == "gpu_user_annotation" and STEP.fullmatch(e["name"])),
                       key=lambda e: e["ts"])
    if not cpu_steps:
        raise ValueError(f"{path}: no engine-step annotations (execute_context_..._generation_...) in the trace")
    kernels = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    runtime = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    # GPU ranges in order; the n-th GPU range belongs to the n-th CPU range of the same name
    gpu_by_name: dict[str, list[dict]] = defaultdict(list)
    for g in gpu_steps:
        gpu_by_name[g["name"]].append(g)
    seen: dict[str, int] = defaultdict(int)
    k_starts = [k["ts"] for k in kernels]
    rows = defaultdict(lambda: defaultdict(list))
    bucket_of = []
    for i, s in enumerate(cpu_steps):
        c, tc, g, tg = map(int, STEP.fullmatch(s["name"]).groups())
        kind = "decode" if c == 0 else "mixed"
        n = tg if kind == "decode" else tc + tg
        bucket_of.append(_bucket(kind, n, max_graph))
        r = rows[bucket_of[-1]]
        r["cpu_ms"].append(s["dur"] / 1e3)
        if i + 1 < len(cpu_steps):
            r["interval_ms"].append((cpu_steps[i + 1]["ts"] - s["ts"]) / 1e3)
        r["tokens"].append(n)
        j = seen[s["name"]]
        seen[s["name"]] += 1
        if j < len(gpu_by_name[s["name"]]):
            gr = gpu_by_name[s["name"]][j]
            r["gpu_ms"].append(gr["dur"] / 1e3)
            lo, hi = bisect.bisect_left(k_starts, gr["ts"]), bisect.bisect_right(k_starts, gr["ts"] + gr["dur"])
            r["kernels"].append(hi - lo)
            r["kernel_ms"].append(sum(k["dur"] for k in kernels[lo:hi]) / 1e3)
    steps = {b: {"steps": len(r["cpu_ms"]), "tokens": _med(r["tokens"]), "cpu_ms": _med(r["cpu_ms"]),
                 "gpu_ms": _med(r["gpu_ms"]), "kernel_ms": _med(r["kernel_ms"]), "kernels": _med(r["kernels"]),
                 "interval_ms": _med(r["interval_ms"]),
                 "interval_mean_ms": round(statistics.fmean(r["interval_ms"]), 4) if r["interval_ms"] else None}
             for b, r in sorted(rows.items())}
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        by_kernel[k["name"]][0] += 1
        by_kernel[k["name"]][1] += k["dur"] / 1e3
    by_call: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in runtime:
        by_call[e["name"]][0] += 1
        by_call[e["name"]][1] += e["dur"] / 1e3
    # Python functions (traces with stacks): inclusive ms per step, by step bucket
    starts = [s["ts"] for s in cpu_steps]
    py: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in ev:
        if e.get("cat") != "python_function":
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] > cpu_steps[i]["ts"] + cpu_steps[i]["dur"]:
            continue  # outside every engine step
        py[bucket_of[i]][e["name"]] += e["dur"] / 1e3
    n_in = defaultdict(int)
    for b in bucket_of:
        n_in[b] += 1
    python = {b: dict(sorted(((n, round(t / n_in[b], 4)) for n, t in fs.items()), key=lambda kv: -kv[1])[:40])
              for b, fs in py.items()}
    xmix_ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # the plugin's ops, host side
    for e in ev:
        if e.get("cat") == "cpu_op" and "vllm_xmix" in e["name"]:
            xmix_ops[e["name"]][0] += 1
            xmix_ops[e["name"]][1] += e["dur"] / 1e3
    span = (cpu_steps[-1]["ts"] + cpu_steps[-1]["dur"] - cpu_steps[0]["ts"]) / 1e3
    busy = sum(k["dur"] for k in kernels) / 1e3
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:40]
    return {
        "trace": path, "n_steps": len(cpu_steps), "span_ms": round(span, 2),
        "gpu_kernel_ms": round(busy, 2), "gpu_busy_fraction": round(busy / span, 4) if span else None,
        "steps": steps,
        "python_ms_per_step": python,
        "kernels_top": [{"name": n, "count": c, "ms": round(t, 3)} for n, (c, t) in top],
        "runtime_calls": {n: {"count": c, "ms": round(t, 3)} for n, (c, t) in
                          sorted(by_call.items(), key=lambda kv: -kv[1][1])},
        "xmix_cpu_ops": {n: {"count": c, "ms": round(t, 3)} for n, (c, t) in xmix_ops.items()},
        "sync_calls": {n: {"count": c, "ms": round(t, 3)} for n, (c, t) in by_call.items()
                       if any(n.startswith(s) for s in SYNC_CALLS)},
    }


def compare(a: dict, b: dict, la: str = "A", lb: str = "B") -> str:
    """Markdown: per step bucket, the medians of A and B and B/A - 1; then the runtime calls,
    the Python functions whose time per step grew most, and the largest kernels."""
    out = [f"| step bucket | steps {la}/{lb} | cpu ms {la} | {lb} | gpu ms {la} | {lb} | kernels {la} | {lb} "
           f"| interval ms {la} | {lb} | interval |", "|" + "---|" * 12]

    def pct(x, y):
        return f"{(y / x - 1) * 100:+.1f}%" if x and y else "-"

    for bk in sorted(set(a["steps"]) | set(b["steps"])):
        sa, sb = a["steps"].get(bk, {}), b["steps"].get(bk, {})
        out.append(f"| {bk} | {sa.get('steps', 0)}/{sb.get('steps', 0)} | {sa.get('cpu_ms')} | {sb.get('cpu_ms')} "
                   f"| {sa.get('gpu_ms')} | {sb.get('gpu_ms')} | {sa.get('kernels')} | {sb.get('kernels')} "
                   f"| {sa.get('interval_ms')} | {sb.get('interval_ms')} "
                   f"| {pct(sa.get('interval_ms'), sb.get('interval_ms'))} |")
    out += ["", f"GPU busy fraction {la} {a['gpu_busy_fraction']} / {lb} {b['gpu_busy_fraction']}; "
            f"steps {a['n_steps']} / {b['n_steps']}; plugin ops on the host ({lb}): {b.get('xmix_cpu_ops')}", "",
            f"| runtime call | count {la} | {lb} | ms {la} | {lb} |", "|---|---|---|---|---|"]
    calls = sorted(set(a["runtime_calls"]) | set(b["runtime_calls"]),
                   key=lambda n: -max(a["runtime_calls"].get(n, {}).get("ms", 0),
                                      b["runtime_calls"].get(n, {}).get("ms", 0)))
    for n in calls[:25]:
        ca, cb = a["runtime_calls"].get(n, {}), b["runtime_calls"].get(n, {})
        out.append(f"| {n} | {ca.get('count', 0)} | {cb.get('count', 0)} | {ca.get('ms', 0)} | {cb.get('ms', 0)} |")
    pa, pb = a.get("python_ms_per_step") or {}, b.get("python_ms_per_step") or {}
    for bk in sorted(set(pa) & set(pb)):  # traces with Python stacks: where a step's host time grew
        fa, fb = pa[bk], pb[bk]
        grew = sorted(set(fa) | set(fb), key=lambda n: -(fb.get(n, 0.0) - fa.get(n, 0.0)))[:15]
        out += ["", f"| Python function, {bk} (ms per step, inclusive; largest growth) | {la} | {lb} |",
                "|---|---|---|"]
        out += [f"| {n[-90:]} | {fa.get(n, '<top40')} | {fb.get(n, '<top40')} |" for n in grew]
    names_a = {k["name"]: k for k in a["kernels_top"]}
    out += ["", f"| kernel (top by GPU ms in {lb}) | count {la} | {lb} | ms {la} | {lb} |", "|---|---|---|---|---|"]
    for k in b["kernels_top"][:25]:  # matched by full name (template instantiations share long prefixes)
        ka = names_a.get(k["name"], {})
        name = k["name"] if len(k["name"]) <= 80 else k["name"][:50] + " ... " + k["name"][-25:]
        out.append(f"| {name} | {ka.get('count', 0)} | {k['count']} | {ka.get('ms', 0)} | {k['ms']} |")
    return "\n".join(out)


# ------------------------------------------------------------------------------ host time, CPU


def norm_call_engine(tokens: int):
    """``profile norm-call``'s engine and call: an in-process eager engine on this machine's
    device (4-layer Llama config, d_model 64, float32, steer_all deployed, ``fused_writes="norm"``)
    after one request (the hook self-check passed), and layer 1's input norm with random ``x`` /
    ``residual`` ``[tokens, 64]`` for it: ``(llm, model runner, norm module, x, residual)``.

    Raises:
        RuntimeError: layer 1's norm does not host sites."""
    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = common.write_model_config(tempfile.mkdtemp(prefix="xmix-norm-"), layers=4)
    cfg = common.load_config(model)
    llm, _ = common.make_llm(model, apps=common.serving_apps(cfg, names=["steer_all"]), fused_writes="norm",
                             dtype="float32", max_model_len=256, eager=True)
    # one request first: the hook self-check passes in the first real forward, as in a serving engine
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], common.sampling(None, max_tokens=2), use_tqdm=False)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    norm = next(m for n, m in runner.model.named_modules() if n.endswith("layers.1.input_layernorm"))
    if getattr(norm.forward, "func", None) is None:
        raise RuntimeError("profile norm-call: layer 1's input norm does not host hook sites")
    dev = norm.weight.device
    x, r = torch.randn(tokens, cfg["hidden_size"], device=dev), torch.randn(tokens, cfg["hidden_size"], device=dev)
    return llm, runner, norm, x, r


def norm_call(tokens: int = 8, calls: int = 20000, repeats: int = 3, on: bool = False) -> dict:
    """Host microseconds per call of a norm hosting hook sites (``fused_writes="norm"``,
    ``ops.hook_norm_``) in a forward where no app is on (``on``: every deployed site on, so the
    norm applies steer_all's writes: on CUDA the fused Triton kernel's launch, on a CPU the
    per-site path), against vLLM's add + RMSNorm called directly on the same tensors: what a
    step that runs without CUDA graphs (more tokens than the largest captured size) pays per
    hosted norm. An in-process eager engine on this machine's device (4-layer Llama config,
    d_model 64, float32, steer_all deployed) after one request (the hook self-check passed); the
    norm of layer 1. Each timing ends with the device's queue drained, so the launches' host
    time is what is timed while it exceeds the kernels' (tiny) device time.

    Raises:
        RuntimeError: layer 1's norm does not host sites, or ``on`` and its sites have no
        plan to apply (the timing would be of a no-op)."""
    import torch
    from vllm.forward_context import set_forward_context

    from vllm_xmix.ops import plain_add_rms_norm

    llm, runner, norm, x, r = norm_call_engine(tokens)
    dev = norm.weight.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    state = common.xmix_state(llm)
    var = state.variants
    if on:
        var.set_variant(var.all_mask)
        sites = [s for s in state.site_keys.sites_of(norm.weight.data) if s >= 0 and var.site_plan(s, 0) is not None]
        if not sites:
            var.set_variant(0)
            raise RuntimeError("profile norm-call --on: layer 1's norm has no site with a plan to apply")
    hosted, direct = [], []
    try:
        with set_forward_context(None, runner.vllm_config):
            for _ in range(repeats):
                sync()
                t = time.perf_counter()
                for _ in range(calls):
                    norm(x, r)
                sync()
                hosted.append((time.perf_counter() - t) / calls * 1e6)
                t = time.perf_counter()
                for _ in range(calls):
                    plain_add_rms_norm(x, r, norm.weight.data, norm.variance_epsilon)
                sync()
                direct.append((time.perf_counter() - t) / calls * 1e6)
    finally:
        var.set_variant(0)
    return {"hosted_us": [round(v, 2) for v in hosted], "direct_us": [round(v, 2) for v in direct],
            "overhead_us": round(statistics.median(h - d for h, d in zip(hosted, direct)), 2), "tokens": tokens,
            "on": on, "sites_on": len(sites) if on else 0, "device": str(dev),
            "calls": calls, "commit": common.git_commit(), "date": common.today(), "command": common.command_line()}


def host_steps(batch: int, tokens: int, configs: str) -> int:
    """cProfile per configuration of an in-process eager engine (see the module docstring)."""
    names = configs.split(",")
    model = common.write_model_config(tempfile.mkdtemp(prefix="xmix-host-"), layers=4)
    cfg = common.load_config(model)
    apps = common.serving_apps(cfg, names=[n for n in names if n != "none"])
    llm, _ = common.make_llm(model, apps=apps, dtype="float32", max_model_len=512, eager=True, max_num_seqs=batch,
                             block_size=32)
    prompts = common.token_prompts(0, batch, 16, 128, 1000)

    def sp(name):
        return common.sampling(None if name == "none" else [name], temperature=0, max_tokens=tokens, ignore_eos=True)

    llm.generate(prompts, sp(apps[0].name if apps else "none"), use_tqdm=False)  # warm-up
    state = common.xmix_state(llm)
    print(f"batch {batch}, {tokens} tokens; per engine step (ms):")
    for name in names:
        steps0 = state.forwards
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        llm.generate(prompts, sp(name), use_tqdm=False)
        prof.disable()
        wall = time.perf_counter() - t
        steps = state.forwards - steps0
        ours = []
        for (file, line, fn), (cc, nc, tt, ct, callers) in pstats.Stats(prof).stats.items():
            if f"{os.sep}vllm_xmix{os.sep}" in file:
                ours.append((tt, ct, nc, f"{os.path.basename(file)}:{line}({fn})"))
        own = sum(x[0] for x in ours)  # self time of our functions (no double counting)
        print(f"  {name:10s} steps {steps:4d}  wall/step {wall / steps * 1e3:7.3f}  "
              f"vllm_xmix self time/step {own / steps * 1e3:7.3f}  ({own / wall * 100:.1f}% of wall)")
        for tt, ct, nc, label in sorted(ours, reverse=True)[:5]:
            print(f"      {tt / steps * 1e3:7.4f} ms/step self, {ct / steps * 1e3:7.4f} cumulative, "
                  f"{nc:6d} calls  {label}")
        entry = ("(fill)", "(update_requests)", "(snapshot)", "(reads_of)", "(add)", "(assemble)", "(hook_write_)")
        for tt, ct, nc, label in sorted(ours, key=lambda x: -x[1]):
            if label.endswith(entry):
                print(f"      cumulative {ct / steps * 1e3:7.4f} ms/step  {nc:6d} calls  {label}")
    return 0


def runtime_steps(model_dir: str, running: int = 40, prompt: int = 220, n: int = 300,
                  fused_writes: str = "auto", device: str = "cpu", json_out: str | None = None) -> int:
    """Per app of the benchmark deployment: median host ms of the runtime's per-step work
    (``update_requests``, ``fill``, ``snapshot`` / ``reads_of``) in a mixed and a decode step,
    each phase on its own, and under cProfile (the second half of the steps) the functions
    (torch's CUDA calls included) with the most self time per pair of steps (one mixed, one
    decode). ``device``: where the tables live; on ``cuda`` each step starts after the device
    finished the previous one, so no wait for the device is counted."""
    from types import SimpleNamespace as NS

    import numpy as np
    import torch

    from vllm_xmix import deploy
    from vllm_xmix.runtime import XmixState
    from vllm_xmix.spec import parse_deployment  # XmixState.build takes the parsed deployment

    cfg = common.load_config(model_dir)
    apps = common.serving_apps(cfg, tempfile.mkdtemp(prefix="xmix-vecs-"))
    dep = parse_deployment(deploy(*apps, fused_writes=fused_writes)["xmix"])
    dev = torch.device(device)
    st = XmixState.build(dep, cfg["num_hidden_layers"], cfg["hidden_size"], dev, 8192, 257,
                         vocab_size=cfg["vocab_size"], max_model_len=4096)
    st.fused_mode = True
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    phases = ("update", "fill", "reads")

    def sched(new, cached, finished=()):
        return NS(finished_req_ids=set(finished), preempted_req_ids=set(), scheduled_new_reqs=new,
                  scheduled_cached_reqs=NS(req_ids=list(cached), num_computed_tokens=[prompt + 10] * len(cached)))

    def step(new, cached, finished=(), tokens=None):
        sync()
        t0 = time.perf_counter()
        st.update_requests(sched(new, cached, finished))
        t1 = time.perf_counter()
        ids = [r.req_id for r in new] + list(cached)
        st.fill(ids, np.asarray(tokens if tokens is not None else [1] * len(ids)), n_padded=len(ids) + prompt)
        t2 = time.perf_counter()
        st.snapshot()
        snap = st.pop_snapshot()
        if snap is not None:
            st.reads_of(snap)
        t3 = time.perf_counter()
        return (t3 - t0, t1 - t0, t2 - t1, t3 - t2)

    def run(app, prof):
        live, mixed, dec = [], [], []
        for i in range(n):
            rid = f"{app}-{i}"
            fin = live[:1] if len(live) >= running else []
            live = live[len(fin):]
            req = NS(req_id=rid, sampling_params=NS(extra_args={"xmix": {"apps": [{"name": app}]}}),
                     prompt_token_ids=list(range(prompt)), num_computed_tokens=0)
            mixed.append(step([req], live, fin, [prompt] + [1] * len(live)))
            live.append(rid)
            if i == n // 2:
                prof.enable()
            dec.append(step([], live))
        prof.disable()
        st.update_requests(sched([], [], live))  # the app's requests finish
        skip = min(50, n // 2)
        med = lambda xs: [float(np.median([x[k] for x in xs[skip:]])) * 1e3 for k in range(4)]  # noqa: E731
        return med(mixed), med(dec), n - n // 2

    print(f"{os.path.basename(model_dir.rstrip('/'))}: runtime host ms per step (mixed: 1 new request of "
          f"{prompt} tokens + {running} decoding; decode: {running + 1} decoding; fused_writes={fused_writes}; "
          f"tables on {dev}): whole step (update / fill / reads)")
    out = {"model": common.model_name(model_dir), "device": str(dev), "fused_writes": fused_writes,
           "running": running, "prompt": prompt, "steps": n, "apps": {}}
    for app in [a.name for a in apps]:
        prof = cProfile.Profile()
        mixed, dec, n_prof = run(app, prof)
        stats = pstats.Stats(prof)
        top = sorted(((v[2], f"{os.path.basename(k[0])}:{k[1]}({k[2]})") for k, v in stats.stats.items()),
                     reverse=True)[:8]
        out["apps"][app] = {"mixed_ms": dict(zip(("step",) + phases, mixed)),
                            "decode_ms": dict(zip(("step",) + phases, dec)),
                            "self_us_per_step_pair": {name: round(t / n_prof * 1e6, 2) for t, name in top}}
        print(f"  {app:12s} mixed {mixed[0]:6.3f} ({' / '.join(f'{x:.3f}' for x in mixed[1:])})  "
              f"decode {dec[0]:6.3f} ({' / '.join(f'{x:.3f}' for x in dec[1:])})")
        print("      self us per mixed + decode step (cProfile): " + ", ".join(
            f"{name} {us}" for name, us in list(out["apps"][app]["self_us_per_step_pair"].items())[:6]))
    if json_out:
        common.write_json(json_out, out)
    return 0


def engine_steps(spec: str, configs: str, fused_writes: str, n_steps: int, running: int = 0) -> int:
    """One engine (``spec`` = "plain:MODEL_DIR" or "xmix:MODEL_DIR") driven step by step under
    cProfile; prints JSON (per config: median ms per mixed / decode step, self seconds and calls
    per function and step) as the last line of stdout, after ``XMIX_JSON``.

    ``running`` 0: a new request every other step (a few requests in flight, steps below 512
    tokens); otherwise the engine is topped up to ``running`` unfinished requests before every
    step (saturation: large mixed steps, ``max_num_batched_tokens`` 2048), and a step is *mixed*
    when requests were added before it."""
    import numpy as np

    kind, model = spec.split(":", 1)
    apps, names = [], ["plain"]
    if kind == "xmix":
        apps = common.serving_apps(common.load_config(model))
        names = configs.split(",")
    size = (dict(max_num_seqs=running, max_num_batched_tokens=2048) if running
            else dict(max_num_seqs=48, max_num_batched_tokens=512))
    llm, _ = common.make_llm(model, apps=apps, fused_writes=fused_writes, dtype="float32", max_model_len=1024,
                             block_size=32, **size)
    eng = llm.llm_engine
    out = {}

    def label(f, ln, fn):
        if "torchinductor" in f or "torch_compile_cache" in f:  # generated code: its file name is a hash
            return f"<inductor-generated>({fn})"
        f = f.split("site-packages" + os.sep, 1)[-1] if "site-packages" in f else os.path.basename(f)
        return f"{f}:{ln}({fn})"

    for name, warm in ((n, w) for n in names for w in (True, False)):  # each config warmed up first
        rng = np.random.default_rng(1)  # the same arrivals for every config
        sel = None if name in ("plain", "inactive", "none") else [name]
        sp = common.sampling(sel, temperature=0, max_tokens=24, ignore_eos=True)
        steps = 40 if warm else n_steps
        mixed, decode, k = [], [], 0
        prof = cProfile.Profile()
        for i in range(steps):
            n_new = (running - eng.get_num_unfinished_requests()) if running else int(i % 2 == 0)
            new = n_new > 0
            for _ in range(max(n_new, 0)):
                p = rng.integers(10, 1000, int(np.clip(rng.lognormal(5.0, 0.9), 16, 400))).tolist()
                eng.add_request(f"{name}-{warm}-{k}", {"prompt_token_ids": p}, sp)
                k += 1
            t = time.perf_counter()
            prof.enable()
            eng.step()
            prof.disable()
            (mixed if new else decode).append(time.perf_counter() - t)
        while eng.has_unfinished_requests():
            eng.step()
        if warm:
            continue
        own, calls = {}, {}
        for (f, ln, fn), (cc, nc, tt, ct, _) in pstats.Stats(prof).stats.items():
            own[label(f, ln, fn)] = own.get(label(f, ln, fn), 0.0) + tt / steps
            calls[label(f, ln, fn)] = calls.get(label(f, ln, fn), 0.0) + nc / steps
        out[name] = {"mixed_ms": float(np.median(mixed) * 1e3) if mixed else float("nan"),
                     "decode_ms": float(np.median(decode) * 1e3) if decode else float("nan"),
                     "self_s_per_step": own, "calls_per_step": calls}
    print("XMIX_JSON " + json.dumps(out))
    return 0


def vs_plain(configs: str, fused_writes: str, n_steps: int, running: int = 0, json_out: str | None = None) -> int:
    """Plain vLLM and the plugin's engine (``engine_steps``, each in its own process) on the same
    arrivals; prints per configuration the median step times against plain, then the functions
    whose self time and whose call count per step grew most (call counts do not depend on the
    machine's load: a difference there is work added, not noise)."""
    model = common.write_model_config(tempfile.mkdtemp(prefix="xmix-host-"), layers=32)
    res = {}
    for spec, env in (("plain:" + model, {"VLLM_PLUGINS": ""}), ("xmix:" + model, {})):
        cmd = common.TOOL + ["profile", "vs-plain", "--_engine", spec, "--configs", configs,
                             "--fused-writes", fused_writes, "--steps", str(n_steps), "--running", str(running)]
        p = subprocess.run(cmd, env={**os.environ, **env}, cwd=common.REPO, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("XMIX_JSON ")]
        if p.returncode or not line:
            sys.stderr.write(p.stderr[-4000:])
            raise SystemExit(f"profile vs-plain: the {spec.split(':')[0]} engine failed (rc {p.returncode})")
        res.update(json.loads(line[-1][len("XMIX_JSON "):]))
    base = res["plain"]
    if json_out:
        common.write_json(json_out, {"configs": res, "fused_writes": fused_writes, "steps": n_steps,
                                     "running": running, "commit": common.git_commit(), "date": common.today(),
                                     "command": common.command_line()})
    load = f"topped up to {running} requests" if running else "a new request every other step"
    print(f"32-layer Llama (d_model 64, dummy, compiled, CPU), fused_writes={fused_writes}, {n_steps} steps "
          f"per config, {load}: median ms per step (ratio to plain)")
    print(f"  {'plain':10s} mixed {base['mixed_ms']:8.3f}            decode {base['decode_ms']:8.3f}")
    for name in configs.split(","):
        r = res[name]
        print(f"  {name:10s} mixed {r['mixed_ms']:8.3f} ({r['mixed_ms'] / base['mixed_ms'] - 1:+6.1%})  "
              f"decode {r['decode_ms']:8.3f} ({r['decode_ms'] / base['decode_ms'] - 1:+6.1%})")
        keys = set(r["self_s_per_step"]) | set(base["self_s_per_step"])
        grow = sorted(((r["self_s_per_step"].get(f, 0.0) - base["self_s_per_step"].get(f, 0.0), f) for f in keys),
                      reverse=True)
        print(f"      self time per step, all steps: {sum(r['self_s_per_step'].values()) * 1e3:.3f} ms "
              f"(plain {sum(base['self_s_per_step'].values()) * 1e3:.3f}); grown most:")
        for dv, f in grow[:12]:
            print(f"      {dv * 1e3:+8.4f} ms/step self  {f}")
        rc, bc = r["calls_per_step"], base["calls_per_step"]
        print(f"      calls per step: {sum(rc.values()):.1f} (plain {sum(bc.values()):.1f}); changed most:")
        moved = sorted(((rc.get(f, 0.0) - bc.get(f, 0.0), f) for f in set(rc) | set(bc)), key=lambda x: -abs(x[0]))
        for dn, f in moved[:12]:
            print(f"      {dn:+9.1f} calls/step  {f}")
    return 0
