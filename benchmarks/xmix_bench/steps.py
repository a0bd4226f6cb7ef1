"""steps: serving-like arrivals driven through one in-process engine, per request time to first
token and inter-token latency, and per engine step its host phases and device time: where a
request's first token goes, without an HTTP front end.

One process per engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the scheduler, the model runner
and the output processor run in this process and can be timed): plain vLLM (``VLLM_PLUGINS=""``)
and, per ``--fused-writes`` value, the plugin's engine with the benchmark deployment. Requests
arrive as a Poisson process in wall time (``--rate`` per second), prompts of uniformly random
length in ``[--input-len x (1 - --range-ratio), --input-len x (1 + --range-ratio)]`` of random
token ids, ``--output-len`` tokens each with ``ignore_eos``: the shape of ``vllm bench serve``'s
random dataset. The loop adds each request when its arrival time has passed and otherwise calls
``LLMEngine.step()``. Configurations (the apps on every request; ``inactive``: none) run in
turn, ``--rounds`` times interleaved, each round with the same arrivals for every configuration.

Per configuration (medians over requests, then over rounds):

* ``ttft_ms``: arrival to the end of the ``step()`` that returned the request's first token
  (``ttfts_ms``: per request, in arrival order); ``ttft_paired_ms``: the median over requests of
  a request's TTFT minus its TTFT under the engine's first configuration in the same round (same
  arrivals), the shift of a typical request, which rounds' own spread does not hide;
  ``itl_ms``: per request, (last token - first token) / (tokens - 1); ``p99_itl_ms``: 99th
  percentile of the gaps between a request's consecutive token arrivals;
* per kind of step (``mixed``: some prompt tokens scheduled, split into ``mixed_graph`` and
  ``mixed_eager`` by whether the step fits the largest captured CUDA graph; ``decode``): steps,
  median tokens, ms of the whole
  ``step()`` and of its host phases (``schedule``, ``execute_model``: the forward's preparation
  and launch, ``sample_tokens``, ``update_from_output``, ``process_outputs``: the output
  processor; inside those, the plugin's ``xmix_update`` (request registry), ``xmix_fill`` (the
  step's device tables), ``xmix_snapshot`` / ``xmix_reads_of`` (read values to the host)), Python's
  garbage collector (``gc``: ms of collections during the step, any generation; ``gc2``: of the
  oldest generation's), and on CUDA the device ms from the start of the forward's preparation to the end
  of sampling on the forward's stream (CUDA events; with async scheduling, the device time of the
  step's own work plus any wait for the host inside it).

Per step (``per_step``: whether it was mixed, tokens, ms of ``step()``, of ``execute_model`` and
on the device), so steps of equal size can be compared across engines. Ratios to plain vLLM are
printed and written with the raw numbers to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import time

from . import common

HELP = "serving-like arrivals through an in-process engine: TTFT, ITL and per-step host/device time vs plain vLLM"
PHASES = ("schedule", "execute_model", "sample_tokens", "update_from_output", "process_outputs",
          "xmix_update", "xmix_fill", "xmix_snapshot", "xmix_reads_of", "gc", "gc2")


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL_DIR", help="model config folder, e.g. benchmarks/models/llama31_8b")
    p.add_argument("--configs", default="inactive,steer_all,ablate_all,probe_one,seal,cast",
                   help="apps on every request (inactive: none), names of the benchmark deployment")
    p.add_argument("--fused-writes", default="auto",
                   help="comma-separated fused_writes values (auto, none, norm, adds, all): one plugin engine each")
    p.add_argument("--fused-configs", default="inactive,steer_all,ablate_all",
                   help="the configurations of the engines after the first (with the other fused_writes values)")
    p.add_argument("--rate", type=float, default=16.0, help="requests per second (Poisson)")
    p.add_argument("--num-prompts", type=int, default=150, help="requests per configuration and round")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (after one warm-up round)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.9)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 otherwise")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--trace", default="", metavar="START,STOP",
                   help="one more round, not measured, with a torch-profiler trace (CPU + CUDA, no stacks) of its "
                        "steps START..STOP-1 per configuration of --trace-configs, summarized per kind of step "
                        "(CUDA runtime calls, kernels, host ops by name) into --out under 'traced'")
    p.add_argument("--trace-configs", default="inactive,steer_all,probe_one",
                   help="the configurations of the traced round (plain vLLM's engine traces its own)")
    p.add_argument("--line-profile", default="", metavar="CONFIGS",
                   help="one more round, not measured, per configuration named here (comma-separated), with the "
                        "plugin's per-step host functions (registry update, step fill) under line_profiler "
                        "(the `line_profiler` package); the line timings go to OUT.lines-CONFIG.txt")
    p.add_argument("--skip-plain", action="store_true",
                   help="run the plugin's engines only (their apps-off configuration is the reference)")
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--_engine", help=argparse.SUPPRESS)  # internal: one engine


def main(args) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args._engine:
        return engine(args)
    res = {}
    engines = [] if args.skip_plain else [("plain", {"VLLM_PLUGINS": ""})]
    engines += [(f"xmix:{fw}", {}) for fw in args.fused_writes.split(",")]
    for spec, env in engines:
        part = args.out + f".{spec.replace(':', '-')}.json"
        first = spec == f"xmix:{args.fused_writes.split(',')[0]}"
        configs = args.configs if spec == "plain" or first else args.fused_configs
        cmd = common.TOOL + ["steps", args.model, "--_engine", spec, "--out", part, "--configs", configs] + \
            _passthrough(args)
        print(f"[steps] {spec}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        p = subprocess.run(cmd, env={**os.environ, **env}, cwd=common.REPO)
        if p.returncode:
            raise SystemExit(f"steps: the {spec} engine failed (rc {p.returncode})")
        print(f"[steps] {spec}: done in {time.time() - t0:.0f} s", flush=True)
        res[spec] = common.read_json(part)
    out = {"commit": common.git_commit(), "date": common.today(), "command": common.command_line(),
           "model": common.model_name(args.model), "settings": _settings(args), "engines": res}
    common.write_json(args.out, out)
    print(table(out))
    return 0


def _passthrough(args) -> list[str]:
    return ["--rate", str(args.rate), "--num-prompts", str(args.num_prompts),
            "--rounds", str(args.rounds), "--input-len", str(args.input_len), "--range-ratio", str(args.range_ratio),
            "--output-len", str(args.output_len), "--max-model-len", str(args.max_model_len),
            "--trace", args.trace, "--trace-configs", args.trace_configs, "--line-profile", args.line_profile] + (
        ["--dtype", args.dtype] if args.dtype else [])


def _settings(args) -> dict:
    return {k: getattr(args, k) for k in ("rate", "num_prompts", "rounds", "input_len", "range_ratio", "output_len",
                                          "max_model_len")}


# ------------------------------------------------------------------------------ one engine


class _Timers:
    """Wall time of the engine's host phases in the current step, and CUDA events around the
    model runner's work of each forward."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.cur: dict[str, float] = {}
        self.tokens = 0
        self.prompt_tokens = False
        self.events: list = []  # (start event, end event) per forward, in order
        self._start = None

    def watch_gc(self) -> None:
        """Count the garbage collector's pauses into the step's ``gc`` / ``gc2`` phases."""
        import gc

        started = [0.0]

        def cb(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
                return
            dt = time.perf_counter() - started[0]
            self.cur["gc"] = self.cur.get("gc", 0.0) + dt
            if info.get("generation") == 2:
                self.cur["gc2"] = self.cur.get("gc2", 0.0) + dt

        gc.callbacks.append(cb)

    def wrap(self, obj, name: str, key: str) -> None:
        orig = getattr(obj, name)

        @functools.wraps(orig)
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self.cur[key] = self.cur.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)

    def wrap_schedule(self, sched) -> None:
        orig = sched.schedule

        @functools.wraps(orig)
        def schedule(*a, **kw):
            t = time.perf_counter()
            so = orig(*a, **kw)
            self.cur["schedule"] = self.cur.get("schedule", 0.0) + time.perf_counter() - t
            n = so.total_num_scheduled_tokens
            if n:
                self.tokens += n
                self.prompt_tokens |= n > len(so.num_scheduled_tokens)
            return so

        sched.schedule = schedule

    def wrap_device(self, runner) -> None:
        if not self.cuda:
            return
        import torch

        ex, samp = runner.execute_model, runner.sample_tokens

        @functools.wraps(ex)
        def execute_model(*a, **kw):
            so = a[0] if a else kw.get("scheduler_output")
            if not kw.get("dummy_run") and getattr(so, "total_num_scheduled_tokens", 0):
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
            return ex(*a, **kw)

        @functools.wraps(samp)
        def sample_tokens(*a, **kw):
            out = samp(*a, **kw)
            if self._start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.events.append((self._start, end))
                self._start = None
            return out

        runner.execute_model, runner.sample_tokens = execute_model, sample_tokens

    def take(self):
        cur, tok, pre = self.cur, self.tokens, self.prompt_tokens
        self.cur, self.tokens, self.prompt_tokens = {}, 0, False
        return cur, tok, pre


def _arrivals(seed: int, n: int, rate: float, lo: int, hi: int, vocab: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    lens = rng.integers(lo, hi + 1, n)
    return [(float(t[i]), rng.integers(10, vocab - 10, int(lens[i])).tolist()) for i in range(n)]


def _run_once(eng, timers: _Timers, name: str, arrivals, output_len: int, sp, cap: int, trace=None) -> dict:
    """One configuration's requests through the engine (see the module docstring); ``cap``: the
    largest CUDA-graph size (steps with more tokens run without graphs); ``trace``: (start,
    stop, path) to write a torch-profiler trace of those steps to."""
    import numpy as np

    add, first, last, count, gaps = {}, {}, {}, {}, []
    steps = []
    i, k = 0, 0
    t0 = time.perf_counter()
    timers.take()
    while i < len(arrivals) or eng.has_unfinished_requests():
        now = time.perf_counter() - t0
        while i < len(arrivals) and arrivals[i][0] <= now:
            rid = f"{name}-{k}"
            eng.add_request(rid, {"prompt_token_ids": arrivals[i][1]}, sp)
            add[rid] = t0 + arrivals[i][0]
            i, k = i + 1, k + 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[i][0] - (time.perf_counter() - t0)))
            continue
        prof = _trace_step(trace, len(steps))
        ts = time.perf_counter()
        if prof is not None:
            import torch

            with torch.profiler.record_function(f"xmix_step_{len(steps)}"):
                outs = eng.step()
        else:
            outs = eng.step()
        te = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            prev = count.get(o.request_id, 0)
            if n > prev:
                if prev == 0:
                    first[o.request_id] = te
                else:
                    gaps.append(te - last[o.request_id])
                last[o.request_id] = te
                count[o.request_id] = n
        phases, tok, pre = timers.take()
        if tok:
            steps.append(("mixed" if pre else "decode", te - ts, phases, tok))
    _trace_step(trace, None)
    ttft = [first[r] - add[r] for r in add if r in first]
    itl = [(last[r] - first[r]) / (count[r] - 1) for r in add if count.get(r, 0) > 1]
    short = [r for r in add if count.get(r, 0) != output_len]
    if short:
        raise RuntimeError(f"steps: {len(short)} requests of {name} ended with a token count other than {output_len}")
    res = {"ttft_ms": float(np.median(ttft) * 1e3), "ttft_mean_ms": float(np.mean(ttft) * 1e3),
           # per request in arrival order: every configuration of a round has the same arrivals
           "ttfts_ms": [round((first[r] - add[r]) * 1e3, 3) if r in first else None for r in add],
           "itl_ms": float(np.mean(itl) * 1e3), "p99_itl_ms": float(np.percentile(gaps, 99) * 1e3),
           "wall_s": time.perf_counter() - t0, "steps": {}}
    kinds = _kinds(steps, cap)
    for kind in KINDS:
        sel = [s for s, k in zip(steps, kinds) if kind in k]
        if not sel:
            continue
        res["steps"][kind] = {"n": len(sel), "step_ms": float(np.median([s[1] for s in sel]) * 1e3),
                              "tokens": float(np.median([s[3] for s in sel])),
                              **{f"{p}_ms": float(np.median([s[2].get(p, 0.0) for s in sel]) * 1e3) for p in PHASES}}
    res["per_step"] = {"mixed": [int(s[0] == "mixed") for s in steps], "tokens": [s[3] for s in steps],
                       "step_ms": [round(s[1] * 1e3, 4) for s in steps],
                       "execute_model_ms": [round(s[2].get("execute_model", 0.0) * 1e3, 4) for s in steps],
                       "gc_ms": [round(s[2].get("gc", 0.0) * 1e3, 4) for s in steps]}
    res["gc_ms_total"] = round(sum(s[2].get("gc", 0.0) for s in steps) * 1e3, 3)
    res["gc2_ms_total"] = round(sum(s[2].get("gc2", 0.0) for s in steps) * 1e3, 3)
    res["step_ms_max"] = round(max((s[1] for s in steps), default=0.0) * 1e3, 3)
    res["_kinds"] = kinds
    return res


#: kinds of step: ``decode``; ``mixed`` (some prompt tokens), split into ``mixed_graph`` (at most
#: the largest captured CUDA-graph size: piecewise graphs) and ``mixed_eager`` (more tokens: the
#: compiled pieces run without graphs, and every hook op runs its Python)
KINDS = ("decode", "mixed", "mixed_graph", "mixed_eager")


def _kinds(steps, cap: int) -> list[tuple[str, ...]]:
    """Per step, the kinds it counts under (see :data:`KINDS`)."""
    return [("decode",) if s[0] == "decode" else ("mixed", "mixed_graph" if s[3] <= cap else "mixed_eager")
            for s in steps]


_PROF: dict = {}


def _trace_step(trace, i):
    """The profiler while step ``i`` of a traced run is inside the window (started at its
    first step, stopped and exported at its end or when ``i`` is None), else None."""
    if trace is None:
        return None
    start, stop, path = trace
    prof = _PROF.get(path)
    if i is not None and start <= i < stop:
        if prof is None:
            import torch

            prof = _PROF[path] = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            prof.start()
        return prof
    if prof is not None and (i is None or i >= stop) and not getattr(prof, "_xmix_done", False):
        prof.stop()
        prof.export_chrome_trace(path)
        prof._xmix_done = True
    return None


def trace_summary(path: str, kinds: list[tuple[str, ...]], top: int = 40) -> dict:
    """Per kind of step (``kinds[i]``: the kinds traced step ``i`` counts under): medians per
    step of CUDA runtime calls by name (count, host ms) and of the kernels they launched (count,
    device ms); and, by name, the ``top`` host ops (torch ops and Python-level annotations:
    inclusive ms, so nested ops count in each) and kernels by mean ms per step."""
    import numpy as np

    with open(path) as f:
        ev = json.load(f)["traceEvents"]
    steps = {}
    for e in ev:
        n = e.get("name", "")
        if e.get("ph") == "X" and n.startswith("xmix_step_") and e.get("cat") in ("user_annotation", "cpu_op"):
            steps[int(n[len("xmix_step_"):])] = (e["ts"], e["ts"] + e["dur"])
    order = sorted(steps.items(), key=lambda kv: kv[1][0])
    starts = [v[0] for _, v in order]
    import bisect

    def step_of(ts):
        k = bisect.bisect_right(starts, ts) - 1
        if k >= 0 and ts <= order[k][1][1]:
            return order[k][0]
        return None

    calls: dict = {}
    corr: dict = {}
    ops: dict = {}
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation") and \
                not e.get("name", "").startswith("xmix_step_"):
            i = step_of(e["ts"])
            if i is not None:
                c = ops.setdefault(i, {}).setdefault(e["name"], [0, 0.0])
                c[0] += 1
                c[1] += e["dur"] / 1e3
        if e.get("ph") != "X" or e.get("cat") != "cuda_runtime":
            continue
        i = step_of(e["ts"])
        if i is None:
            continue
        d = calls.setdefault(i, {})
        c = d.setdefault(e["name"], [0, 0.0])
        c[0] += 1
        c[1] += e["dur"] / 1e3
        if "correlation" in e.get("args", {}):
            corr[e["args"]["correlation"]] = i
    kern: dict = {}
    kname: dict = {}
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            i = corr.get(e.get("args", {}).get("correlation"))
            if i is not None:
                k = kern.setdefault(i, [0, 0.0])
                k[0] += 1
                k[1] += e["dur"] / 1e3
                c = kname.setdefault(i, {}).setdefault(e["name"][:120], [0, 0.0])
                c[0] += 1
                c[1] += e["dur"] / 1e3

    def by_name(per_step: dict, idx: list[int]) -> dict:
        tot: dict = {}
        for i in idx:
            for n, (c, ms) in per_step.get(i, {}).items():
                t = tot.setdefault(n, [0.0, 0.0])
                t[0] += c / len(idx)
                t[1] += ms / len(idx)
        best = sorted(tot.items(), key=lambda kv: -kv[1][1])[:top]
        return {n: [round(c, 2), round(ms, 4)] for n, (c, ms) in best}

    out = {}
    for kind in KINDS:
        idx = [i for i in steps if i < len(kinds) and kind in kinds[i]]
        if not idx:
            continue
        names = sorted({n for i in idx for n in calls.get(i, {})})
        out[kind] = {"n": len(idx), "host_ms": float(np.median([steps[i][1] - steps[i][0] for i in idx]) / 1e3),
                     "kernels": float(np.median([kern.get(i, [0, 0])[0] for i in idx])),
                     "kernel_ms": float(np.median([kern.get(i, [0, 0.0])[1] for i in idx])),
                     "runtime": {n: [float(np.median([calls.get(i, {}).get(n, [0, 0])[0] for i in idx])),
                                     float(np.median([calls.get(i, {}).get(n, [0, 0.0])[1] for i in idx]))]
                                 for n in names},
                     "host_ops": by_name(ops, idx), "kernel_names": by_name(kname, idx)}
    return out


def engine(args) -> int:
    import numpy as np

    kind, _, fused = args._engine.partition(":")
    cfg = common.load_config(args.model)
    import torch

    cuda = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    names = ["plain"]
    apps = []
    if kind == "xmix":
        names = args.configs.split(",")
        apps = common.serving_apps(cfg)  # the serving deployment, whatever is switched on
    llm, startup = common.make_llm(args.model, apps=apps, fused_writes=fused or "auto", dtype=dtype,
                                   max_model_len=args.max_model_len)
    eng = llm.llm_engine
    core = eng.engine_core.engine_core
    timers = _Timers(cuda)
    timers.watch_gc()
    timers.wrap_schedule(core.scheduler)
    timers.wrap(core.scheduler, "update_from_output", "update_from_output")
    timers.wrap(core.model_executor, "execute_model", "execute_model")
    timers.wrap(core.model_executor, "sample_tokens", "sample_tokens")
    timers.wrap(eng.output_processor, "process_outputs", "process_outputs")
    runner = core.model_executor.driver_worker.worker.model_runner
    timers.wrap_device(runner)
    if kind == "xmix":  # the plugin's own parts of the step (inside execute_model / sample_tokens)
        st = common.xmix_state(llm)
        timers.wrap(st.slots, "update_requests", "xmix_update")
        timers.wrap(st.step, "fill", "xmix_fill")
        timers.wrap(st.reads, "snapshot", "xmix_snapshot")
        timers.wrap(st.reads, "reads_of", "xmix_reads_of")
    cc = eng.vllm_config.compilation_config
    cap = int(cc.max_cudagraph_capture_size or 0) if str(cc.cudagraph_mode) != "CUDAGraphMode.NONE" else 0
    lo = max(1, int(args.input_len * (1 - args.range_ratio)))
    hi = int(args.input_len * (1 + args.range_ratio))
    per: dict[str, list] = {n: [] for n in names}
    traced: dict[str, dict] = {}
    traced_names = [n for n in names if n in args.trace_configs.split(",") or n == "plain"]
    for rnd in range(args.rounds + 1 + bool(args.trace)):
        arr = _arrivals(rnd, args.num_prompts, args.rate, lo, hi, cfg["vocab_size"])
        tracing = rnd > args.rounds  # the extra, profiled round: its numbers are not the measurement
        for name in (traced_names if tracing else names):
            sel = None if name in ("plain", "inactive") else [name]
            sp = common.sampling(sel, temperature=0, max_tokens=args.output_len, ignore_eos=True)
            n_ev = len(timers.events)
            trace = None
            if tracing:
                a, b = (int(x) for x in args.trace.split(","))
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                trace = (a, b, os.path.join(os.path.dirname(os.path.abspath(args.out)), f"trace-{name}.json"))
            r = _run_once(eng, timers, f"{name}-{rnd}", arr if rnd else arr[: max(20, len(arr) // 4)],
                          args.output_len, sp, cap, trace)
            if trace is not None:
                r["trace"] = trace_summary(trace[2], r["_kinds"])
                os.remove(trace[2])
            if cuda:
                torch.cuda.synchronize()
                evs = timers.events[n_ev:]
                kinds = r["_kinds"]
                if len(evs) == len(kinds):
                    dev_all = [a.elapsed_time(b) for a, b in evs]
                    r["per_step"]["device_ms"] = [round(x, 4) for x in dev_all]
                    for kk in KINDS:
                        dev = [x for x, k2 in zip(dev_all, kinds) if kk in k2]
                        if dev and kk in r["steps"]:
                            r["steps"][kk]["device_ms"] = float(np.median(dev))
                else:
                    r["device_note"] = f"{len(evs)} forwards timed for {len(kinds)} steps: device time not paired"
            del r["_kinds"]
            print(f"[steps] {args._engine} round {rnd} {name}: ttft {r['ttft_ms']:.2f} ms, itl {r['itl_ms']:.3f} ms, "
                  f"gc {r['gc_ms_total']:.1f} ms (oldest generation {r['gc2_ms_total']:.1f}), "
                  f"longest step {r['step_ms_max']:.1f} ms", flush=True)
            if tracing:
                traced[name] = r
            elif rnd:
                per[name].append(r)
    if kind == "xmix" and args.line_profile:
        for name in args.line_profile.split(","):
            _line_profiled_round(eng, timers, st, name, _arrivals(args.rounds + 1, args.num_prompts, args.rate, lo, hi,
                                                                   cfg["vocab_size"]), args, cap)
    _pair_ttfts(per, names[0])
    common.write_json(args.out, {"engine": args._engine, "startup_s": startup, "configs": per, "traced": traced,
                                 "cudagraph_capture_max": cap, "info": common.engine_info(llm)})
    return 0


def _line_profiled_round(eng, timers, st, name: str, arr, args, cap: int) -> None:
    """One round of configuration ``name`` with the plugin's per-step host functions under
    line_profiler; the per-line timings to ``OUT.lines-NAME.txt`` (microseconds)."""
    try:
        from line_profiler import LineProfiler
    except ImportError as e:
        raise SystemExit("steps --line-profile: the line_profiler package is not installed "
                         "(pip install line_profiler)") from e
    from vllm_xmix.runtime import slots as slots_mod
    from vllm_xmix.runtime import step as step_mod

    funcs = [step_mod.StepFill.fill, step_mod.StepFill._next_stage, slots_mod.SlotRegistry.update_requests]
    funcs += [f for f in (getattr(slots_mod.SlotRegistry, "_selection", None),) if f is not None]
    lp = LineProfiler(*funcs)
    sel = None if name in ("plain", "inactive") else [name]
    sp = common.sampling(sel, temperature=0, max_tokens=args.output_len, ignore_eos=True)
    saved = (st.step.fill, st.step._next_stage, st.slots.update_requests)
    st.step.fill, st.step._next_stage, st.slots.update_requests = (lp(f) for f in saved)
    try:
        _run_once(eng, timers, f"{name}-lines", arr, args.output_len, sp, cap, None)
    finally:
        st.step.fill, st.step._next_stage, st.slots.update_requests = saved
    path = f"{args.out}.lines-{name}.txt"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        lp.print_stats(stream=f, output_unit=1e-6)
    print(f"[steps] {args._engine} line profile of {name}: {path}", flush=True)


def _pair_ttfts(per: dict[str, list[dict]], base: str) -> None:
    """Per configuration and round, ``ttft_paired_ms``: the median over requests of the
    request's TTFT minus the same request's TTFT under ``base`` (the engine's first
    configuration) in that round (the same arrival time and prompt length): a shift of most
    requests shows there even when rounds move the medians by more."""
    import numpy as np

    for name, runs in per.items():
        for r, b in zip(runs, per.get(base, [])):
            d = [x - y for x, y in zip(r.get("ttfts_ms") or [], b.get("ttfts_ms") or [])
                 if x is not None and y is not None]
            r["ttft_paired_ms"] = float(np.median(d)) if d else None


# ------------------------------------------------------------------------------ the table


def _med(xs):
    xs = [x for x in xs if x is not None]
    return common.median(xs) if xs else None


def summary(runs: list[dict]) -> dict:
    """Medians over rounds of one configuration's numbers (flattened: ``mixed.step_ms`` ...)."""
    out = {}
    for key in ("ttft_ms", "ttft_mean_ms", "ttft_paired_ms", "itl_ms", "p99_itl_ms", "gc_ms_total", "step_ms_max"):
        out[key] = _med([r.get(key) for r in runs])
    for kind in KINDS:
        for key in ["n", "tokens", "step_ms", "device_ms"] + [f"{p}_ms" for p in PHASES]:
            out[f"{kind}.{key}"] = _med([r["steps"].get(kind, {}).get(key) for r in runs])
    return out


def table(res: dict) -> str:
    """Medians per engine and configuration, each with its ratio to plain vLLM (or, with
    ``--skip-plain``, to the first plugin engine's first configuration)."""
    engines = res["engines"]
    if "plain" in engines:
        base_name, plain = "plain", summary(engines["plain"]["configs"]["plain"])
    else:
        spec0 = next(iter(engines))
        name0 = next(iter(engines[spec0]["configs"]))
        base_name, plain = f"{spec0} {name0}", summary(engines[spec0]["configs"][name0])
    cols = ["ttft_ms", "ttft_paired_ms", "itl_ms", "p99_itl_ms", "gc_ms_total", "step_ms_max", "mixed.step_ms", "mixed.device_ms", "mixed.execute_model_ms",
            "mixed.xmix_update_ms", "mixed.xmix_fill_ms",
            "mixed_graph.n", "mixed_graph.execute_model_ms", "mixed_eager.n", "mixed_eager.execute_model_ms",
            "decode.step_ms", "decode.device_ms", "decode.execute_model_ms", "decode.xmix_fill_ms"]
    lines = [f"{res['model']}, rate {res['settings']['rate']}/s, {res['settings']['num_prompts']} prompts x "
             f"{res['settings']['rounds']} rounds; ms (ratio to {base_name})",
             "| engine | config | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]

    def cell(v, b):
        if v is None:
            return "–"
        return f"{v:.3f}" if b in (None, 0) else f"{v:.3f} ({v / b - 1:+.1%})"

    if base_name == "plain":
        lines.append("| plain | – | " + " | ".join(cell(plain[c], None) for c in cols) + " |")
    for spec, e in engines.items():
        if spec == "plain":
            continue
        for name, runs in e["configs"].items():
            s = summary(runs)
            lines.append(f"| {spec} | {name} | " + " | ".join(cell(s[c], plain[c]) for c in cols) + " |")
    return "\n".join(lines)

