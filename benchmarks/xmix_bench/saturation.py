"""profile saturation: one in-process engine per process with many requests decoding (steps
above the largest CUDA graph when there are more than 512), its ms per decode step, and the
host's health around it: how fast the interpreter runs a plain Python call loop before the
engine is built, after, and after the measured steps; the CPU seconds of each thread of the
process during the measured steps; the garbage collector's state; trace / profile hooks and
Dynamo's frame callback; the CPU affinity; the share of the timed wall time the engine's thread
was on a CPU, its involuntary context switches and the cgroup's CPU throttling. Optionally a
cProfile of further steps (``--prof-dir``), and several rounds (``--rounds``, every second one in
reverse order).

Why: with apps deployed and none on, host work per step at saturation was measured about twice
plain vLLM's on the H200 (in-process, 900-1000 requests decoding) while the Python calls per step
were the same (+0.1%) and every function, vLLM's scheduler included, took ~15% longer per call
under cProfile: a slower process, not more work. The per-thread CPU and the interpreter's speed
say whether another thread competes with the engine's, or the whole process runs slower.

Engines (``--engines``, comma-separated): ``plain`` (vLLM without the plugin, ``VLLM_PLUGINS=""``),
``empty`` (the plugin loaded, nothing deployed), ``xmix`` (the benchmark deployment, no app on);
``xmix@NAME=VALUE`` runs that engine with one more environment setting (e.g.
``xmix@VLLM_XMIX_GRAPH_VARIANTS=0``)."""

from __future__ import annotations

import cProfile
import gc
import json
import os
import subprocess
import sys
import threading
import time

from . import common

MARK = "XMIX_SAT "


def pyloop_ns(n: int = 300_000) -> float:
    """Nanoseconds per call of a one-line Python function, in a loop of ``n``: how fast this
    process's interpreter runs (the same machine gives the same number, whatever is loaded)."""
    def f(a):
        return a + 1

    t = time.perf_counter()
    x = 0
    for _ in range(n):
        x = f(x)
    return (time.perf_counter() - t) / n * 1e9


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, ``"tid:name"`` -> s (Linux
    ``/proc/self/task``; empty elsewhere). ``name``: the Python thread's name where the thread is
    a Python thread (e.g. ``MainThread``), else the OS thread name (native threads: OpenMP, CUDA)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    py_names = {t.native_id: t.name for t in threading.enumerate() if getattr(t, "native_id", None)}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as fh:
                name = fh.read().strip()
        except OSError:
            continue
        out[f"{tid}:{py_names.get(int(tid), name)}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def sched_counters() -> dict[str, float]:
    """The scheduler's view of this process: the main thread's voluntary and involuntary context
    switches (``/proc/self/task/<tid>/status``) and the cgroup's CPU throttling (``cpu.stat``:
    periods throttled, microseconds throttled; cgroup v2, else v1); absent where unreadable."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/self/task/{threading.main_thread().native_id}/status") as fh:
            for line in fh:
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    k, v = line.split(":")
                    out[k.strip()] = float(v)
    except (OSError, TypeError):
        pass
    for path in ("/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.stat", "/sys/fs/cgroup/cpu,cpuacct/cpu.stat"):
        try:
            with open(path) as fh:
                for line in fh:
                    k, v = line.split()
                    if k in ("nr_throttled", "throttled_usec", "throttled_time"):
                        out["cgroup_" + k] = float(v)
            break
        except (OSError, ValueError):
            continue
    return out


def host_cpu() -> dict:
    """The machine around this process: busy CPU seconds of the whole host (``/proc/stat``, every
    core, all but idle and iowait), each other process's CPU seconds (``/proc/<pid>/stat``, user +
    system, pid -> (comm, s)), the CPU this thread last ran on and that CPU's current clock
    (``/proc/cpuinfo``, MHz; absent where the file has none), and the *steal* seconds of the
    host and of each CPU (``/proc/stat``'s eighth column: time a virtual machine's CPU was ready
    to run but its hypervisor ran something else; there a thread is "on a CPU" and makes no
    progress). Linux only; empty elsewhere."""
    out: dict = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        with open("/proc/stat") as fh:
            lines = [ln.split() for ln in fh if ln.startswith("cpu")]
        f = [int(x) for x in lines[0][1:]]
        out["host_busy_s"] = (sum(f) - f[3] - (f[4] if len(f) > 4 else 0)) / tick
        if len(f) > 7:
            out["host_steal_s"] = f[7] / tick
            out["cpu_steal_s"] = {int(ln[0][3:]): int(ln[8]) / tick for ln in lines[1:] if len(ln) > 8}
    except (OSError, ValueError, IndexError):
        return out
    procs = {}
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                head, rest = fh.read().rsplit(")", 1)
            fields = rest.split()
            procs[int(pid)] = (head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, ValueError, IndexError):
            continue
    out["procs"] = procs
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/stat") as fh:
            cpu = int(fh.read().rsplit(")", 1)[1].split()[36])
        out["cpu"] = cpu
        with open("/proc/cpuinfo") as fh:
            blocks = fh.read().split("\n\n")
        for b in blocks:
            kv = dict(line.split(":", 1) for line in b.splitlines() if ":" in line)
            kv = {k.strip(): v.strip() for k, v in kv.items()}
            if kv.get("processor") == str(cpu) and "cpu MHz" in kv:
                out["cpu_mhz"] = float(kv["cpu MHz"])
    except (OSError, ValueError, IndexError):
        pass
    return out


def cpu_delta(a: dict, b: dict, wall: float) -> dict:
    """What :func:`host_cpu` readings ``a`` then ``b``, ``wall`` seconds apart, say: the host's
    busy cores on average, the five other processes that took the most CPU seconds, this thread's
    CPU and clock at the end, the host's stolen cores on average (``steal_cores``) and the share
    of the time stolen from the CPU this thread ran on at the end (``cpu_steal``)."""
    out: dict = {}
    if "host_busy_s" in a and "host_busy_s" in b and wall > 0:
        out["host_busy_cores"] = round((b["host_busy_s"] - a["host_busy_s"]) / wall, 2)
    if "host_steal_s" in a and "host_steal_s" in b and wall > 0:
        out["steal_cores"] = round((b["host_steal_s"] - a["host_steal_s"]) / wall, 3)
        cpu = b.get("cpu")
        if cpu in a.get("cpu_steal_s", {}) and cpu in b.get("cpu_steal_s", {}):
            out["cpu_steal"] = round((b["cpu_steal_s"][cpu] - a["cpu_steal_s"][cpu]) / wall, 3)
    pa, pb = a.get("procs", {}), b.get("procs", {})
    # by pid (a kernel worker's name changes with the work it does); a process that started
    # between the readings counts all its CPU time
    d = sorted(((f"{pid}:{name}", s - pa.get(pid, ("", 0.0))[1]) for pid, (name, s) in pb.items()),
               key=lambda kv: -kv[1])
    out["other_procs_cpu_s"] = {k: round(v, 2) for k, v in d[:5] if v > 0}
    for k in ("cpu", "cpu_mhz"):
        if k in b:
            out[k] = b[k]
    return out


def host_health() -> dict:
    """The interpreter's speed and the process-wide settings that slow every Python call."""
    import torch

    try:
        cb = repr(torch._C._dynamo.eval_frame.get_eval_frame_callback())
    except Exception as e:  # not in every torch build
        cb = f"unknown ({type(e).__name__})"
    mon = getattr(sys, "monitoring", None)
    tools = [i for i in range(6) if mon.get_tool(i)] if mon is not None else []  # sys.monitoring: 3.12+
    return {"pyloop_ns": round(pyloop_ns(), 2), "trace": repr(sys.gettrace()), "profile": repr(sys.getprofile()),
            "monitoring_tools": tools, "gc_enabled": gc.isenabled(), "gc_threshold": list(gc.get_threshold()),
            "gc_count": list(gc.get_count()), "gc_frozen": gc.get_freeze_count(), "gc_tracked": len(gc.get_objects()),
            "grad_enabled": torch.is_grad_enabled(), "switch_interval_s": sys.getswitchinterval(),
            "eval_frame_callback": cb, "threads": sorted(t.name for t in threading.enumerate()),
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def engine(kind: str, model: str, requests: int, warm_steps: int, steps: int, max_model_len: int, eager: bool,
           prof_out: str | None) -> dict:
    """One engine (``kind``: plain, empty or xmix; the caller sets ``VLLM_PLUGINS`` for plain),
    ``requests`` requests of 20-199 random prompt tokens decoding 400 tokens each; ``warm_steps``
    steps first (the prompts' prefill), then ``steps`` decode steps timed without a profiler
    (ms per step, thread CPU seconds), then, with ``prof_out``, as many again under cProfile."""
    import numpy as np
    import torch

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its threads are ours
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    res = {"engine": kind, "health": {"before_engine": host_health()}}
    apps = common.serving_apps(common.load_config(model)) if kind == "xmix" else []
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    llm, startup = common.make_llm(model, apps=apps, fused_writes="auto", dtype=dtype, max_model_len=max_model_len,
                                   eager=eager)
    res["startup_s"] = round(startup, 1)
    res["plugin_loaded"] = "vllm_xmix" in sys.modules
    res["info"] = common.engine_info(llm)
    res["health"]["after_engine"] = host_health()
    eng = llm.llm_engine
    sp = common.sampling(None, temperature=0, max_tokens=400, ignore_eos=True)
    rng = np.random.default_rng(0)
    for k in range(requests):
        p = rng.integers(10, 1000, int(rng.integers(20, 200))).tolist()
        eng.add_request(f"r{k}", {"prompt_token_ids": p}, sp)
    for _ in range(warm_steps):
        eng.step()
    h0, c0, s0 = host_cpu(), thread_cpu_s(), sched_counters()
    own0, t = time.thread_time(), time.perf_counter()
    step_ms = []
    for _ in range(steps):
        t1 = time.perf_counter()
        eng.step()
        step_ms.append(round((time.perf_counter() - t1) * 1e3, 2))
    wall = time.perf_counter() - t
    own, c1, s1, h1 = time.thread_time() - own0, thread_cpu_s(), sched_counters(), host_cpu()
    res["ms_per_step"] = round(wall / steps * 1e3, 3)
    res["step_ms"] = step_ms  # each timed step: a slow stretch shows here, not in the mean
    res["host"] = cpu_delta(h0, h1, wall)
    # the share of the timed wall time the engine's thread (this one) was on a CPU (below 1: it
    # waited, or was descheduled; the involuntary switches and the cgroup's throttling say which)
    res["main_thread_on_cpu"] = round(own / wall, 3)
    res["sched"] = {k: s1[k] - s0.get(k, 0.0) for k in s1}
    res["running"] = eng.get_num_unfinished_requests()
    res["thread_cpu_s"] = dict(sorted(((k, round(v - c0.get(k, 0.0), 4)) for k, v in c1.items()),
                                      key=lambda kv: -kv[1]))  # every thread, busiest first (10 ms ticks)
    res["health"]["after_steps"] = host_health()
    if prof_out:
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            eng.step()
        prof.disable()
        res["profiled_ms_per_step"] = round((time.perf_counter() - t) / steps * 1e3, 3)
        prof.dump_stats(prof_out)
        res["profile"] = prof_out
    return res


def saturation(model: str, engines: list[str], requests: int, warm_steps: int, steps: int, max_model_len: int,
               eager: bool, prof_dir: str | None, json_out: str | None, rounds: int = 1) -> dict:
    """Each engine of ``engines`` (see the module docstring) in its own process, one after the
    other, ``rounds`` times (every second round in reverse order, so that no engine always runs
    first: the host's speed drifts between processes); returns and writes ``{"engines": {spec:
    [result per round]}, ...}``."""
    out = {"model": model, "requests": requests, "warm_steps": warm_steps, "steps": steps, "rounds": rounds,
           "engines": {spec: [] for spec in engines},
           "commit": common.git_commit(), "date": common.today(), "command": common.command_line()}
    order = [(r, spec) for r in range(rounds) for spec in (engines if r % 2 == 0 else engines[::-1])]
    for r, spec in order:
        kind, _, setting = spec.partition("@")
        if kind not in ("plain", "empty", "xmix"):
            raise SystemExit(f"profile saturation: unknown engine {spec!r} (plain, empty, xmix[@NAME=VALUE])")
        env = dict(os.environ)
        if kind == "plain":
            env["VLLM_PLUGINS"] = ""
        if setting:
            name, eq, value = setting.partition("=")
            if not eq:
                raise SystemExit(f"profile saturation: {spec!r}: expected ENGINE@NAME=VALUE")
            env[name] = value
        cmd = common.TOOL + ["profile", "saturation", "--_engine", kind, "--model", model, "--requests", str(requests),
                             "--warm-steps", str(warm_steps), "--steps", str(steps),
                             "--max-model-len", str(max_model_len)]
        if eager:
            cmd.append("--eager")
        if prof_dir:
            os.makedirs(prof_dir, exist_ok=True)
            name = spec.replace("@", "_").replace("=", "-") + (f"_r{r}" if rounds > 1 else "")
            cmd += ["--prof-out", os.path.join(prof_dir, name + ".prof")]
        p = subprocess.run(cmd, env=env, cwd=common.REPO, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith(MARK)]
        if p.returncode or not line:
            # one engine's failure is reported with its result and does not lose the others'
            sys.stderr.write(p.stderr[-4000:])
            out["engines"][spec].append({"engine": spec, "error": f"rc {p.returncode}", "stderr": p.stderr[-4000:]})
        else:
            out["engines"][spec].append(json.loads(line[-1][len(MARK):]))
        if json_out:  # after every engine: a run cut short keeps what it measured
            common.write_json(json_out, out)
    failed = [spec for spec, runs in out["engines"].items() for e in runs if "error" in e]
    if failed:
        raise SystemExit(f"profile saturation: engine(s) {', '.join(failed)} failed (their stderr is in the result)")
    return out


def report(r: dict) -> str:
    """One line per engine: ms per decode step, the interpreter's speed, the busiest threads."""
    lines = [f"{r['model']}: {r['requests']} requests, {r['steps']} decode steps timed after {r['warm_steps']}"]
    for spec, e in ((spec, e) for spec, runs in r["engines"].items() for e in runs):
        if "error" in e:
            lines.append(f"  {spec:28s} failed: {e['error']}")
            continue
        h = e["health"]
        host = e.get("host", {})
        others = ", ".join(f"{k} {v:.2f}" for k, v in list(host.get("other_procs_cpu_s", {}).items())[:3])
        busy = ", ".join(f"{k} {v:.2f}" for k, v in list(e["thread_cpu_s"].items())[:4])
        prof = f"; under cProfile {e['profiled_ms_per_step']:.2f}" if "profiled_ms_per_step" in e else ""
        sched = ", ".join(f"{k} {v:g}" for k, v in e.get("sched", {}).items())
        lines.append(f"  {spec:28s} {e['ms_per_step']:8.2f} ms/step{prof} (running {e['running']}); engine thread "
                     f"on a CPU {e.get('main_thread_on_cpu', float('nan')):.0%} of the time ({sched}); Python call "
                     f"{h['before_engine']['pyloop_ns']:.1f} / {h['after_engine']['pyloop_ns']:.1f} / "
                     f"{h['after_steps']['pyloop_ns']:.1f} ns (before / after the engine / after the steps); "
                     f"thread CPU s: {busy}; threads {h['after_steps']['threads']}; "
                     f"gc tracked {h['after_steps']['gc_tracked']}, frozen {h['after_steps']['gc_frozen']}; "
                     f"trace {h['after_steps']['trace']}, profile {h['after_steps']['profile']}, "
                     f"frame callback {h['after_steps']['eval_frame_callback']}; host busy cores "
                     f"{host.get('host_busy_cores', float('nan')):.2f}, other processes' CPU s: {others or '-'}; "
                     f"CPU {host.get('cpu', '?')} at {host.get('cpu_mhz', float('nan')):.0f} MHz; "
                     f"stolen: {host.get('steal_cores', float('nan')):.3f} of the host's cores, "
                     f"{host.get('cpu_steal', float('nan')):.1%} of that CPU's time; "
                     f"steps min / max {min(e['step_ms'], default=float('nan')):.1f} / "
                     f"{max(e['step_ms'], default=float('nan')):.1f} ms")
    return "\n".join(lines)
