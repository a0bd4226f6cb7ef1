"""CPU time of a vLLM server's processes over one benchmark run: which process was busy.

A ``vllm serve`` server is an API-server process (the OpenAI front end: HTTP, tokenization,
detokenization and output processing, the streamed chunks; one asyncio event loop) and an
engine-core process (the scheduler and the model runner) below it. At saturation one of them
bounds the throughput; when the API server's busiest thread runs near 100% of a core, its event
loop is what requests wait for, and per-token work added there (the values of a request with
reads, spliced into every streamed chunk) costs throughput even though the GPU is not busier.

:class:`CpuMeter` reads the processes' CPU times (user + system, all threads, via psutil) at the
start and at the end of a run: per role, CPU seconds and the busy fraction of the run's active
seconds (the benchmark's own duration where given, else the time between the reads; 1.0 = one
core all the time), and for each process its busiest thread's fraction (a Python process's
event loop is one thread: near 1.0 means that thread was the bottleneck).
"""

from __future__ import annotations

import time

#: the engine-core process's name (vLLM sets it with setproctitle: ``VLLM::EngineCore``)
ENGINE_CORE = "EngineCore"
#: the name of each of several API server processes (``vllm serve --api-server-count N``:
#: ``VLLM::APIServer_<k>``, below a launcher process)
API_SERVER = "APIServer"


def _role(proc, root_pid: int) -> str:
    if proc.pid == root_pid:
        return "api_server"
    try:
        name = proc.name() + " " + " ".join(proc.cmdline()[:1])
    except Exception:  # gone, or not ours to read
        return "other"
    if ENGINE_CORE in name:
        return "engine_core"
    return "api_server" if API_SERVER in name else "other"


def _times(root_pid: int) -> dict[int, tuple[str, float, dict[int, float]]]:
    """pid -> (role, CPU seconds of the process, {thread id: CPU seconds}) for the root process
    and its descendants (a process that is gone by now is left out)."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            threads = {th.id: th.user_time + th.system_time for th in p.threads()}
            out[p.pid] = (_role(p, root_pid), t.user + t.system, threads)
        except psutil.Error:
            continue
    return out


class CpuMeter:
    """CPU time of process ``pid`` and its descendants between :meth:`__init__` and :meth:`stop`.

    ``stop(active_s)`` returns ``{role: {"cpu_s": CPU seconds, "busy": cpu_s / active seconds,
    "busiest_thread": the largest fraction of the active seconds one thread of a process of that
    role ran}}`` for the roles ``api_server`` (the root process, and with ``--api-server-count N``
    the N API server processes below it: their sum, so ``busy`` may reach N), ``engine_core`` and ``other``
    (processes present at the second read; one started in between counts from 0), ``"wall_s"``
    (between the reads) and ``"active_s"``: the seconds the fractions are of, ``active_s`` if
    given (a benchmark's own duration, from its first request to its last answer: the client's
    set-up before it, in which the server idles, would dilute them), else ``wall_s``. Raises
    nothing: a process that cannot be read is left out."""

    def __init__(self, pid: int):
        self.pid = pid
        self._t0 = time.perf_counter()
        self._start = _times(pid)

    def stop(self, active_s: float | None = None) -> dict:
        end = _times(self.pid)
        wall_s = time.perf_counter() - self._t0
        wall = max(active_s if active_s else wall_s, 1e-9)
        roles: dict[str, dict] = {}
        for pid, (role, cpu, threads) in end.items():
            _, cpu0, threads0 = self._start.get(pid, (role, 0.0, {}))
            r = roles.setdefault(role, {"cpu_s": 0.0, "busy": 0.0, "busiest_thread": 0.0})
            r["cpu_s"] += cpu - cpu0
            busiest = max((s - threads0.get(tid, 0.0) for tid, s in threads.items()), default=0.0)
            r["busiest_thread"] = max(r["busiest_thread"], busiest / wall)
        for r in roles.values():
            r["busy"] = r["cpu_s"] / wall
            for k in r:
                r[k] = round(r[k], 3)
        return {"wall_s": round(wall_s, 3), "active_s": round(wall, 3), **roles}


def summary(cpu: dict) -> str:
    """One line: ``api 0.85 (thread 0.80), engine 1.10 (thread 0.95)`` (busy fractions)."""
    parts = []
    for role, label in (("api_server", "api"), ("engine_core", "engine")):
        r = cpu.get(role)
        if r:
            parts.append(f"{label} {r['busy']:.2f} (thread {r['busiest_thread']:.2f})")
    return ", ".join(parts) or "no CPU times"
