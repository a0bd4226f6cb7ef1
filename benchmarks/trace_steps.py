"""Where a serving step's time goes, from a torch-profiler trace of a vLLM worker (issue 5).

vLLM's GPU worker annotates every engine step as ``execute_context_C(Tc)_generation_G(Tg)``
(``Worker.annotate_profile``): a CPU range (``user_annotation``) and the same range on the GPU
timeline (``gpu_user_annotation``). This script reads one trace (``*.pt.trace.json[.gz]``, written
by ``--profiler-config '{"profiler": "torch", ...}'``) and reports, per kind of step:

* ``decode`` (no context request) by batch size, ``mixed`` (a prefill chunk in the step) by
  scheduled tokens, split at the largest CUDA-graph size (``--max-graph-tokens``, 512 by default:
  bigger steps run without CUDA graphs);
* per step: CPU time of the annotated range (ms), GPU time of its GPU range (ms), kernels
  launched on the GPU inside it, and the interval to the next step's start (ms: what a
  decoding request sees as inter-token latency);
* with Python stacks in the trace (``"torch_profiler_with_stack": true``; ``serve_bench.py
  --profile-stack``): per kind of step, the Python functions by inclusive host time per step
  (ms; the 40 largest), so ``--compare`` can list the functions whose time per step grew most
  (where a step's extra host time goes);
* for the whole trace: kernels by name (count, total GPU ms), CUDA runtime calls by name
  (count, total CPU ms: launches, graph launches, copies and the synchronizing calls), and the
  GPU's busy fraction over the profiled span.

usage:
  python benchmarks/trace_steps.py TRACE [--json OUT.json]            # one trace
  python benchmarks/trace_steps.py --compare A.json B.json            # two summaries side by side

The summaries (``--json``) are small; the traces themselves (hundreds of MB for a serving run)
stay on the machine that made them.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
from collections import defaultdict

STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cudaHostAlloc", "cudaFreeHost", "cudaMallocHost", "cudaFree", "cudaMalloc")


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
    for i, s in enumerate(cpu_steps):
        c, tc, g, tg = map(int, STEP.fullmatch(s["name"]).groups())
        kind = "decode" if c == 0 else "mixed"
        n = tg if kind == "decode" else tc + tg
        r = rows[_bucket(kind, n, max_graph)]
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
    bucket_of = []
    for s in cpu_steps:
        c, tc, g, tg = map(int, STEP.fullmatch(s["name"]).groups())
        bucket_of.append(_bucket("decode" if c == 0 else "mixed", tg if c == 0 else tc + tg, max_graph))
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
        "sync_calls": {n: v for n, v in ((n, {"count": c, "ms": round(t, 3)}) for n, (c, t) in by_call.items())
                       if any(n.startswith(s) for s in SYNC_CALLS)},
    }


def compare(a: dict, b: dict, la: str = "A", lb: str = "B") -> str:
    """Markdown: per step bucket, the medians of A and B and B/A - 1; then the runtime calls."""
    out = [f"| step bucket | steps {la}/{lb} | cpu ms {la} | {lb} | gpu ms {la} | {lb} | kernels {la} | {lb} "
           f"| interval ms {la} | {lb} | interval |", "|" + "---|" * 12]
    pct = lambda x, y: f"{(y / x - 1) * 100:+.1f}%" if x and y else "-"  # noqa: E731
    for bk in sorted(set(a["steps"]) | set(b["steps"])):
        sa, sb = a["steps"].get(bk, {}), b["steps"].get(bk, {})
        out.append(f"| {bk} | {sa.get('steps', 0)}/{sb.get('steps', 0)} | {sa.get('cpu_ms')} | {sb.get('cpu_ms')} "
                   f"| {sa.get('gpu_ms')} | {sb.get('gpu_ms')} | {sa.get('kernels')} | {sb.get('kernels')} "
                   f"| {sa.get('interval_ms')} | {sb.get('interval_ms')} "
                   f"| {pct(sa.get('interval_ms'), sb.get('interval_ms'))} |")
    out += ["", f"GPU busy fraction {la} {a['gpu_busy_fraction']} / {lb} {b['gpu_busy_fraction']}; "
            f"steps {a['n_steps']} / {b['n_steps']}; plugin ops on the host ({lb}): {b.get('xmix_cpu_ops')}", "", f"| runtime call | count {la} | {lb} | ms {la} | {lb} |",
            "|---|---|---|---|---|"]
    calls = sorted(set(a["runtime_calls"]) | set(b["runtime_calls"]),
                   key=lambda n: -max(a["runtime_calls"].get(n, {}).get("ms", 0), b["runtime_calls"].get(n, {}).get("ms", 0)))
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", help="a *.pt.trace.json[.gz] file")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--max-graph-tokens", type=int, default=512)
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two summaries (--json outputs)")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        print(compare(a, b, "A", "B"))
        return 0
    if not args.trace:
        ap.error("a trace file or --compare A B is needed")
    s = summarize(args.trace, args.max_graph_tokens)
    if args.json:
        json.dump(s, open(args.json, "w"), indent=1)
    print(json.dumps({k: s[k] for k in ("n_steps", "span_ms", "gpu_kernel_ms", "gpu_busy_fraction", "steps")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
