"""The serving benchmark's CPU meter (benchmarks/xmix_bench/cpu_usage.py) on a real process tree:
a parent process (the API server's place) and a child named as vLLM names its engine core, each
burning a known amount of CPU time in one thread before the meter's first read (not counted)
and between its two reads (counted)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.xmix_bench.cpu_usage import CpuMeter, summary  # noqa: E402

BURN = """
import time
def burn(s):
    t = time.thread_time()
    while time.thread_time() - t < s:
        pass
"""

CHILD = BURN + """
import sys
from setproctitle import setproctitle
setproctitle("VLLM::EngineCore")
burn(0.2)  # before the meter's first read: not counted
print("up", flush=True)
sys.stdin.readline()
burn(0.6)
print("done", flush=True)
sys.stdin.readline()  # until the parent closes it
"""

PARENT = BURN + f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "up"
burn(0.2)  # before the meter's first read: not counted
print("up", flush=True)
sys.stdin.readline()
child.stdin.write("go\\n"); child.stdin.flush()
burn(0.3)  # in the main thread (an event loop's place), which is still there at the meter's second read
assert child.stdout.readline().strip() == "done"
print("done", flush=True)
sys.stdin.readline()
child.stdin.close(); child.wait()
"""


def test_meter_splits_cpu_time_between_api_server_and_engine_core():
    p = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        meter = CpuMeter(p.pid)  # both processes exist, neither has burned yet
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "done"
        cpu = meter.stop()
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    api, engine, wall = cpu["api_server"], cpu["engine_core"], cpu["active_s"]
    assert cpu["active_s"] == cpu["wall_s"]  # no active time given: the fractions are of the wall time
    # CPU seconds, not wall time: independent of how busy the machine is (the kernel counts
    # them in clock ticks of 10 ms, hence the slack below the burnt amounts; on a loaded machine
    # a process's ticks were seen to lag its thread clock by up to 0.1 s, hence the slack above:
    # the two ranges stay apart)
    assert 0.28 <= api["cpu_s"] < 0.3 + 0.15, cpu
    assert 0.58 <= engine["cpu_s"] < 0.6 + 0.15, cpu
    assert api["busiest_thread"] * wall >= 0.28 and engine["busiest_thread"] * wall >= 0.58, cpu
    assert abs(api["busy"] * wall - api["cpu_s"]) < 0.01
    assert summary(cpu).startswith("api ") and ", engine " in summary(cpu)


def test_meter_of_a_process_that_is_gone_reports_nothing():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert {k for k in CpuMeter(p.pid).stop() if not k.endswith("_s")} == set()


def test_fractions_are_of_the_active_seconds_when_given():
    p = subprocess.Popen([sys.executable, "-c", BURN + "import sys\nburn(0.3)\nsys.stdin.readline()"],
                         stdin=subprocess.PIPE, text=True)
    try:
        meter = CpuMeter(p.pid)
        t = time.time()
        while time.time() - t < 30:  # until the burn is done (its CPU time, not a wall-clock wait)
            if meter.stop()["api_server"]["cpu_s"] >= 0.3:
                break
            time.sleep(0.05)
        cpu = meter.stop(active_s=2.0)
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    assert cpu["active_s"] == 2.0 and cpu["wall_s"] > 0
    assert abs(cpu["api_server"]["busy"] - cpu["api_server"]["cpu_s"] / 2.0) < 0.001


def test_summary_table_gives_median_busy_fractions_per_configuration(tmp_path):
    from benchmarks.xmix_bench import serve_results

    def run(cfg, rnd, itl, api, engine):
        return {"rate": "inf", "round": rnd, "config": cfg, "title": "m, 10 prompts",
                "result": {"mean_itl_ms": itl, "p99_itl_ms": itl, "mean_ttft_ms": 1.0, "total_token_throughput": 100.0},
                "cpu": {"wall_s": 10.0, "api_server": {"cpu_s": 10 * api, "busy": api, "busiest_thread": api - 0.1},
                        "engine_core": {"cpu_s": 10 * engine, "busy": engine, "busiest_thread": engine}}}

    runs = [run("vanilla", 1, 5.0, 0.5, 1.0), run("probe_one", 1, 5.5, 0.9, 1.0),
            run("vanilla", 2, 5.0, 0.7, 1.2), run("probe_one", 2, 5.5, 1.1, 1.0),
            run("vanilla", 3, 5.0, 0.6, 1.1), run("probe_one", 3, 5.5, 1.0, 1.0)]
    serve_results.summarize(runs, str(tmp_path))
    rows = {line.split(" | ")[0]: line for line in (tmp_path / "summary.md").read_text().splitlines()
            if line.startswith("| vanilla") or line.startswith("| probe_one")}
    assert rows["| vanilla"].endswith("| 0.60 (0.50) | 1.10 (1.10) |")
    assert rows["| probe_one"].endswith("| 1.00 (0.90) | 1.00 (1.00) |")
    assert "API server CPU busy (busiest thread)" in (tmp_path / "summary.md").read_text()


def test_several_api_server_processes_count_as_the_api_server():
    """With ``--api-server-count 2`` vLLM's launcher runs ``VLLM::APIServer_<k>`` processes below
    it: their CPU time is the API server's (summed), their busiest thread the busiest of them."""
    kid = BURN + """
import sys
from setproctitle import setproctitle
setproctitle(sys.argv[1])
print("up", flush=True)
sys.stdin.readline()
burn(float(sys.argv[2]))
print("done", flush=True)
sys.stdin.readline()
"""
    kids = [subprocess.Popen([sys.executable, "-c", kid, name, secs], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True) for name, secs in (("VLLM::APIServer_0", "0.3"), ("VLLM::APIServer_1", "0.2"))]
    # the launcher: the test process's place is taken by a parent that only waits
    try:
        for k in kids:
            assert k.stdout.readline().strip() == "up"
        meter = CpuMeter(os.getpid())
        for k in kids:
            k.stdin.write("go\n")
            k.stdin.flush()
        for k in kids:
            assert k.stdout.readline().strip() == "done"
        cpu = meter.stop()
    finally:
        for k in kids:
            k.stdin.close()
            k.wait(timeout=30)
    api, wall = cpu["api_server"], cpu["active_s"]
    assert 0.48 <= api["cpu_s"] < 0.5 + 0.3, cpu  # both children (the waiting test process adds little)
    assert api["busiest_thread"] * wall >= 0.28, cpu
