"""The benchmark's meters: the serving benchmark's TTFT split from vLLM's metrics
(benchmarks/xmix_bench/server_metrics.py: exposition text written by hand, two engines' label
sets, and the run's share of it; the same meter against a real server is in
tests/test_serve.py); `profile api-cpu` (benchmarks/xmix_bench/api_cpu.py) against its own CPU
server; `profile api-calls` (api_calls.py) against its own profiled CPU servers; `profile
norm-call` on a hosted norm; `serve rounds --api-sample`'s py-spy reading (api_sample.py); the
served engine-step recorder (benchmarks/xmix_bench/engine_steps.py:
its summary on rows written by hand, and a real CPU server started through recorded_server.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.xmix_bench.server_metrics import difference, e2e_rows, parse, table_rows  # noqa: E402


def exposition(ttft, queue, prefill, steps, hits, engines=2, decode=None, e2e=None) -> str:
    """vLLM-style text: each (sum, count) split evenly over ``engines`` label sets."""
    out = []
    fams = [("vllm:time_to_first_token_seconds", ttft), ("vllm:request_queue_time_seconds", queue),
            ("vllm:request_prefill_time_seconds", prefill), ("vllm:iteration_tokens_total", steps)]
    fams += [(f, v) for f, v in (("vllm:request_decode_time_seconds", decode),
                                 ("vllm:e2e_request_latency_seconds", e2e)) if v is not None]
    for fam, (s, n) in fams:
        out += [f"# HELP {fam} x", f"# TYPE {fam} histogram"]
        for e in range(engines):
            lab = f'engine="{e}",model_name="m"'
            out += [f'{fam}_bucket{{{lab},le="+Inf"}} {n / engines}', f"{fam}_count{{{lab}}} {n / engines}",
                    f"{fam}_sum{{{lab}}} {s / engines}"]
    out += ["# HELP vllm:prefix_cache_hits_total x", "# TYPE vllm:prefix_cache_hits_total counter"]
    out += [f'vllm:prefix_cache_hits_total{{engine="{e}",model_name="m"}} {hits / engines}' for e in range(engines)]
    return "\n".join(out) + "\n"


def test_a_runs_ttft_splits_into_front_end_queue_and_prefill():
    before = parse(exposition((1.0, 10), (0.1, 10), (0.5, 10), (4000, 100), 64))
    # the run: 4 requests, TTFT 0.2 s each, queued 0.01 s, prefill 0.15 s; 50 steps of 30 tokens
    after = parse(exposition((1.8, 14), (0.14, 14), (1.1, 14), (5500, 150), 96))
    d = difference(before, after)
    assert d["ttft_n"] == d["queue_n"] == d["prefill_n"] == 4
    assert abs(d["ttft_ms"] - 200.0) < 1e-6 and abs(d["queue_ms"] - 10.0) < 1e-6
    assert abs(d["prefill_ms"] - 150.0) < 1e-6
    assert abs(d["front_end_ms"] - 40.0) < 1e-6
    assert abs(d["step_tokens_mean"] - 30.0) < 1e-6
    assert d["prefix_cache_hits"] == 32
    assert "e2e_ms" not in d and "preemptions" not in d  # not in the text: not reported as 0


def test_a_requests_whole_time_splits_into_the_engine_cores_part_and_the_front_ends():
    # the run: 4 requests of e2e 2.0 s each: queued 0.5 s, prefill 0.1 s, decode 1.2 s in the
    # engine core (1.8 s), so 0.2 s at the API server's ends
    before = parse(exposition((1.0, 10), (0.1, 10), (0.5, 10), (4000, 100), 0, decode=(3.0, 10), e2e=(5.0, 10)))
    after = parse(exposition((3.6, 14), (2.1, 14), (0.9, 14), (5500, 150), 0, decode=(7.8, 14), e2e=(13.0, 14)))
    d = difference(before, after)
    assert abs(d["decode_ms"] - 1200.0) < 1e-6 and abs(d["e2e_ms"] - 2000.0) < 1e-6
    assert abs(d["engine_ms"] - 1800.0) < 1e-6
    assert abs(d["front_end_total_ms"] - 200.0) < 1e-6
    # runs recorded before the split was (their means and counts only) get it too
    old = {k: v for k, v in d.items() if k not in ("engine_ms", "front_end_total_ms")}
    rows = e2e_rows({"vanilla": [old], "probe_one": [{**d, "e2e_ms": 2700.0}, {**d, "e2e_ms": 2500.0},
                                                     {**d, "e2e_ms": 1900.0}]},
                    {"vanilla": [96.5], "probe_one": [150.0, 140.0]})
    assert rows[0].startswith("| config | e2e (ms) |") and rows[0].endswith("API server CPU per output token (us) |")
    assert rows[2] == "| vanilla | 2000.0 | 1800.0 | 1200.0 | 200.0 | 96.5 |"
    assert rows[3] == "| probe_one | 2500.0 | 1800.0 | 1200.0 | 700.0 | 145.0 |"  # medians over the runs
    # a decode count of other requests (a request still decoding when read) gives no split
    odd = difference(before, parse(exposition((3.6, 14), (2.1, 14), (0.9, 14), (5500, 150), 0, decode=(7.8, 13),
                                              e2e=(13.0, 14))))
    assert "engine_ms" not in odd and "front_end_total_ms" not in odd
    assert e2e_rows({"vanilla": [odd]}) == []


def test_no_new_requests_gives_no_means_and_the_table_says_so():
    text = exposition((1.0, 10), (0.1, 10), (0.5, 10), (4000, 100), 0)
    d = difference(parse(text), parse(text))
    assert "ttft_ms" not in d and "front_end_ms" not in d
    assert table_rows({"steer_all": [d]}) == []
    rows = table_rows({"vanilla": [{"ttft_ms": 20.0, "queue_ms": 1.0}, {"ttft_ms": 30.0, "queue_ms": 3.0}]})
    assert rows[2].startswith("| vanilla | 25.00 | - | 2.00 | - |")


@pytest.mark.one_version
def test_api_cpu_streams_every_chunk_and_meters_the_api_server():
    """`profile api-cpu` against its real CPU server: every streamed token of every request is
    counted (with and without a probe; a chunk may carry several), and the API server's CPU
    time per chunk and per token is measured."""
    from benchmarks.xmix_bench.api_cpu import api_cpu

    r = api_cpu(["none", "probe_one"], requests=6, tokens=5, concurrency=3, rounds=1)
    for c in ("none", "probe_one"):
        (run,) = r["configs"][c]["runs"]
        assert run["tokens"] == 6 * 5 and 6 <= run["chunks"] <= 6 * 5, (c, run)
        assert run["api_us_per_token"] > 0 and run["api_us_per_chunk"] >= run["api_us_per_token"], (c, run)


@pytest.mark.one_version
def test_ttft_parts_splits_every_measured_request_s_ttft():
    """`profile ttft-parts` against its real CPU server: each run's metrics cover exactly its
    requests (vLLM counted one TTFT, queue and prefill per request), the parts add up to the
    TTFT, no prompt came from the prefix cache, and a prompt longer than the server's context is
    refused before a server starts."""
    from benchmarks.xmix_bench.ttft_parts import ttft_parts

    with pytest.raises(ValueError, match="--prompt 300"):
        ttft_parts(["none"], prompt=300)
    r = ttft_parts(["none", "probe_one"], requests=3, prompt=40, rounds=1)
    for c in ("none", "probe_one"):
        (run,) = r["configs"][c]["runs"]
        assert run["prefix_cache_hits"] == 0, (c, run)
        assert run["ttft_ms"] > 0 and run["prefill_ms"] > 0 and run["front_end_ms"] is not None, (c, run)
        parts = run["queue_ms"] + run["prefill_ms"] + run["front_end_ms"]
        assert abs(parts - run["ttft_ms"]) < 1e-3, (c, run)


@pytest.mark.one_version
def test_api_calls_profiles_exactly_the_measured_requests():
    """`profile api-calls`: the profile covers the measured requests (every token counted; a
    probe's per-chunk work shows as calls of the plugin's read assembly, which a request without
    apps never makes, and as more calls in the plugin's code per token: exact counts, where the
    totals also hold the front end's per-batch work, which moves with timing), on a server with
    the plugin and one without it."""
    from benchmarks.xmix_bench.api_calls import api_calls, report

    r = api_calls(["plain", "none", "probe_one"], requests=4, tokens=6, concurrency=2)
    cf = r["configs"]
    for c in ("plain", "none", "probe_one"):
        assert cf[c]["tokens"] == 4 * 6 and cf[c]["calls_per_chunk"] > 0, (c, cf[c])
    # the probe's own functions, whatever the per-batch calls (which follow timing) do to the top
    # list: against plain vLLM, which runs no plugin function, the read assembly is the probe's alone
    probe_funcs = [k for k, _ in cf["probe_one"]["plugin_only"]]
    assert any("vllm_xmix/results.py" in k for k in probe_funcs), cf["probe_one"]["plugin_only"]
    assert cf["none"]["plugin_only"] and not any("vllm_xmix/results.py" in k for k, _ in cf["none"]["plugin_only"])
    assert cf["plain"]["plugin_calls_per_chunk"] == 0 < cf["none"]["plugin_calls_per_chunk"], cf
    assert cf["probe_one"]["plugin_calls_per_token"] > cf["none"]["plugin_calls_per_token"], cf
    assert "probe_one" in report(r)


def test_api_sample_counts_self_and_inclusive_samples_per_output_token(tmp_path):
    """`serve rounds --api-sample`'s reading of py-spy's raw stacks (a file written by hand): a
    function's lines add up, a frame repeated in one stack counts once inclusively, an empty stack
    counts under NO_FRAME, and the microseconds per output token are samples / rate / tokens; the
    report names what grew against vanilla; a line without a count is an error naming it."""
    from benchmarks.xmix_bench import api_sample

    raw = tmp_path / "a.txt"
    raw.write_text("a (x.py:1);b (y.py:2) 3\n"
                   "a (x.py:1);b (y.py:5) 2\n"
                   "a (x.py:1);c (z.py:3);a (x.py:9) 1\n"
                   " 4\n")
    incl, own, total = api_sample.load(str(raw))
    assert total == 10
    assert dict(own) == {"b (y.py)": 5, "a (x.py)": 1, api_sample.NO_FRAME: 4}
    assert dict(incl) == {"a (x.py)": 6, "b (y.py)": 5, "c (z.py)": 1, api_sample.NO_FRAME: 4}
    # 500 samples a second, 100 output tokens: a sample is 2 ms / 100 = 20 us per token
    r = api_sample.summary(str(raw), rate_hz=500, output_tokens=100, requests=2)
    assert (r["samples"], r["gil_us_per_token"]) == (10, 200.0)
    assert r["self"][0] == ["b (y.py)", 100.0] and ["a (x.py)", 120.0] in r["inclusive"]
    base = tmp_path / "base.txt"
    base.write_text("a (x.py:1);b (y.py:2) 1\n")
    text = api_sample.report({"vanilla": api_sample.summary(str(base), 500, 100, 2), "probe_one": r})
    assert "+180.0 on vanilla" in text and "+80.00 us  b (y.py)" in text and "+100.00 us  a (x.py)" in text
    bad = tmp_path / "bad.txt"
    bad.write_text("a (x.py:1);b (y.py:2)\n")
    with pytest.raises(ValueError, match="bad.txt:1: not a raw py-spy line"):
        api_sample.load(str(bad))


@pytest.mark.parametrize("bench_fails", [True, False])
def test_a_failing_api_sampler_never_hides_the_runs_own_error(monkeypatch, tmp_path, bench_fails):
    """`serve rounds --api-sample`: when the benchmark run fails, its error is the one raised
    (py-spy's failure to stop is only printed); when the run succeeds, py-spy's failure is the
    error (a sampled run without its samples is not a result)."""
    import socket
    import types

    from benchmarks.xmix_bench import api_sample, common, serve_rounds

    class BrokenSampler:
        def __init__(self, pid, path):
            pass

        def stop(self):
            raise RuntimeError("py-spy did not stop")

    def bench_serve(argv):
        if bench_fails:
            raise RuntimeError("the client lost its server")
        return {"completed": 1, "duration": 1.0}

    monkeypatch.setattr(api_sample, "Sampler", BrokenSampler)
    monkeypatch.setattr(common, "bench_serve", bench_serve)
    with socket.socket() as s:  # a port nothing listens on: the metrics read fails, as reported
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = types.SimpleNamespace(port=port, pid=os.getpid(), steps_dir=None)
    with pytest.raises(RuntimeError) as e:
        serve_rounds.bench(server, {"serving_dir": "m"}, [], "inf", 1, None, str(tmp_path / "r.json"), 0, 1,
                           api_sample_to=str(tmp_path / "s.txt"))
    assert str(e.value) == ("the client lost its server" if bench_fails else "py-spy did not stop")


@pytest.mark.one_version
def test_norm_call_times_a_norm_that_hosts_sites():
    """`profile norm-call` finds a norm that hosts hook sites (it raises otherwise) and times it
    against vLLM's norm called directly."""
    from benchmarks.xmix_bench.profile import norm_call

    r = norm_call(tokens=4, calls=200, repeats=1)
    assert r["hosted_us"][0] > 0 and r["direct_us"][0] > 0, r
    assert not r["on"] and r["sites_on"] == 0 and r["device"] == "cpu"
    # --on: the norm's sites have plans to apply (the timing is of the writes, not a no-op)
    r = norm_call(tokens=4, calls=50, repeats=1, on=True)
    assert r["on"] and r["sites_on"] >= 1 and r["hosted_us"][0] > 0, r


def test_stream_cost_times_every_chunk_and_the_decode_chunks_apart():
    """`profile stream`: microseconds per streamed chunk of a probe request, over the whole stream,
    over its decode chunks alone (the first carries the prompt's values, the last all) and for
    the last."""
    from benchmarks.xmix_bench.stream import stream_cost

    r = stream_cost(prompt=64, tokens=8, repeats=3)
    assert len(r["runs"]) == len(r["decode_runs"]) == len(r["final_runs"]) == 3, r
    assert r["us_per_chunk"] > 0 and r["us_per_decode_chunk"] > 0 and r["us_final_chunk"] > 0, r
    assert (r["prompt"], r["tokens"], r["layers"]) == (64, 8, 1), r
    # (no timing relation is asserted: on a loaded CI host one can flip; speed is what the
    # benchmark measures, not what a test checks)


def test_saturation_counts_another_process_cpu_by_pid_across_a_name_change():
    """The host's reading around the timed steps: a kernel worker renamed between the readings
    (its name follows the work it does) counts only the CPU time it took in between; a process
    started in between counts all of its own."""
    from benchmarks.xmix_bench.saturation import cpu_delta

    a = {"host_busy_s": 10.0, "procs": {7: ("kworker/0:0-events", 100.0), 8: ("python", 3.0)}}
    b = {"host_busy_s": 11.5, "procs": {7: ("kworker/0:0-mm_percpu_wq", 100.5), 8: ("python", 3.0),
                                        9: ("new", 0.2)}, "cpu": 1, "cpu_mhz": 2600.0}
    assert cpu_delta(a, b, 0.5) == {"host_busy_cores": 3.0, "other_procs_cpu_s": {"7:kworker/0:0-mm_percpu_wq": 0.5,
                                                                                  "9:new": 0.2},
                                    "cpu": 1, "cpu_mhz": 2600.0}


def test_saturation_reads_the_time_stolen_from_the_host_and_from_the_engine_threads_cpu():
    """A virtual machine's CPU can be "busy" with its thread making no progress: the hypervisor
    ran something else (steal). The host's stolen cores and the share stolen from the CPU the
    engine's thread ran on, from two readings of /proc/stat; this machine's own /proc/stat
    parses into them."""
    from benchmarks.xmix_bench.saturation import cpu_delta, host_cpu

    a = {"host_busy_s": 10.0, "host_steal_s": 4.0, "cpu_steal_s": {0: 1.0, 3: 2.0}, "procs": {}}
    b = {"host_busy_s": 12.0, "host_steal_s": 4.6, "cpu_steal_s": {0: 1.1, 3: 2.25}, "procs": {}, "cpu": 3}
    d = cpu_delta(a, b, 0.5)
    assert d["steal_cores"] == 1.2 and d["cpu_steal"] == 0.5 and d["host_busy_cores"] == 4.0
    assert "cpu_steal" not in cpu_delta(a, {**b, "cpu": 7}, 0.5)  # a CPU not in the readings
    if os.path.exists("/proc/stat"):
        h = host_cpu()
        assert h["host_steal_s"] >= 0 and set(h["cpu_steal_s"]) >= set(os.sched_getaffinity(0)), h.keys()


@pytest.mark.one_version
def test_saturation_runs_each_engine_in_its_own_process_and_reports_its_health(tmp_path):
    """`profile saturation`: plain vLLM without the plugin and the benchmark deployment, each in
    its own process, every request still decoding in the timed steps; the interpreter's speed,
    the threads' CPU time, each step's time, the host's busy cores and a profile per engine come
    back; an engine that fails is reported without losing the others; an unknown engine is refused."""
    from benchmarks.xmix_bench import common
    from benchmarks.xmix_bench.saturation import report, saturation

    model = common.write_model_config(str(tmp_path / "m"), layers=4)
    broken = "plain@PYTHONHASHSEED=bogus"  # the interpreter refuses to start: an engine that fails
    with pytest.raises(SystemExit, match="engine.s. plain@PYTHONHASHSEED=bogus failed"):
        saturation(model, ["plain", broken, "xmix@VLLM_XMIX_GRAPH_VARIANTS=0"], requests=6, warm_steps=3, steps=3,
                   max_model_len=512, eager=True, prof_dir=str(tmp_path / "prof"), json_out=str(tmp_path / "s.json"))
    r = common.read_json(str(tmp_path / "s.json"))  # the failure lost neither the engine before it nor after
    assert "PYTHONHASHSEED" in r["engines"][broken][0]["stderr"] and "failed" in report(r), r["engines"][broken]
    (plain,), (xmix,) = r["engines"]["plain"], r["engines"]["xmix@VLLM_XMIX_GRAPH_VARIANTS=0"]
    assert (plain["plugin_loaded"], xmix["plugin_loaded"]) == (False, True)
    for e in (plain, xmix):
        assert e["running"] == 6 and e["ms_per_step"] > 0 and e["profiled_ms_per_step"] > 0, e
        assert os.path.getsize(e["profile"]) > 0 and min(e["thread_cpu_s"].values()) >= 0, e
        assert any(k.endswith(":MainThread") for k in e["thread_cpu_s"]), e["thread_cpu_s"]  # Python names
        assert 0 < e["main_thread_on_cpu"] <= 1.01 and e["sched"]["nonvoluntary_ctxt_switches"] >= 0, e
        assert all(e["health"][k]["pyloop_ns"] > 0 for k in ("before_engine", "after_engine", "after_steps"))
        assert len(e["step_ms"]) == 3 and min(e["step_ms"]) > 0, e["step_ms"]
        assert e["host"]["host_busy_cores"] > 0 and e["host"]["cpu"] >= 0, e["host"]  # the machine around it
    assert "xmix@VLLM_XMIX_GRAPH_VARIANTS=0" in report(r) and (tmp_path / "s.json").exists()
    with pytest.raises(SystemExit, match="unknown engine 'fast'"):
        saturation(model, ["fast"], 1, 1, 1, 512, True, None, None)


def _steps_rows(tmp_path, name, rows, capacity=None):
    """A step file ``steps.<name>.bin`` in ``tmp_path`` with ``rows`` written by the recorder's writer."""
    from benchmarks.xmix_bench import engine_steps

    w = engine_steps.StepWriter(str(tmp_path / f"steps.{name}.bin"), **({"capacity": capacity} if capacity else {}))
    for r in rows:
        w.append(*r)
    return w


def test_step_summary_keeps_the_decode_steps_of_one_request_apart(tmp_path):
    """The decode steps of a single request, a group of their own (``decode_one``): on an MoE
    model the comparison that holds when an app changes the routing (one token reads its top-k
    experts whichever they are; a batch reads as many as its tokens are routed to)."""
    from benchmarks.xmix_bench import engine_steps

    approx = pytest.approx
    b = _steps_rows(tmp_path, 1, [(5.0, 5.001, 5.003, 5.004, 1, 1)])
    meter = engine_steps.StepMeter(str(tmp_path))
    for r in [(5.004, 5.0041, 5.011, 5.012, 1, 1),    # 1 request: 11 - max(4, 4) = 7 ms
              (5.012, 5.0121, 5.021, 5.022, 4, 4),    # 4 requests: 9 ms, decode only
              (5.022, 5.0221, 5.0295, 5.030, 1, 1)]:  # 1 request: 7.5 ms
        b.append(*r)
    one = meter.stop(requests=1)
    assert one["decode"]["n"] == 3 and one["decode"]["period_ms_median"] == approx(7.5), one
    assert one["decode_one"]["n"] == 2 and one["decode_one"]["period_ms_median"] == approx(7.25), one
    assert "decode of 1 7.25 ms (n 2)" in engine_steps.summary(one)


def test_step_summary_periods_groups_idle_gap_and_a_full_file(tmp_path):
    """The meter's summary of rows written with the recorder's own writer, periods computed by
    hand: a step scheduled before the previous one's output was processed (async scheduling)
    holds the pipeline from that processing on; after an idle gap from its own scheduling; the
    meter's first new row is measured from the row before it; each engine's file on its own;
    steps without tokens are counted apart; a file that filled up and a window without rows are
    reported, never an empty summary."""
    from benchmarks.xmix_bench import engine_steps

    # (t0, t1, t2, t3) in s, tokens, requests
    a = _steps_rows(tmp_path, 1, [(0.0, 0.001, 0.010, 0.011, 100, 1)])  # before the meter
    meter = engine_steps.StepMeter(str(tmp_path))
    for r in [(0.0015, 0.002, 0.015, 0.016, 2, 2),        # decode: 15 - max(11, 1.5) = 4 ms
              (0.0105, 0.0108, 0.020, 0.0205, 600, 3),    # mixed >512: 20 - max(16, 10.5) = 4 ms
              (1.0, 1.001, 1.006, 1.007, 3, 3),           # decode after an idle gap: 1006 - 1000 = 6 ms
              (1.0071, 1.0072, 1.0073, 1.0074, 0, 0),     # no tokens: counted apart
              (1.0075, 1.0076, 1.0126, 1.013, 3, 3)]:     # decode: 1012.6 - max(1007.4, 1007.5) = 5.1 ms
        a.append(*r)
    _steps_rows(tmp_path, 2, [(0.5, 0.5005, 0.508, 0.509, 40, 1)])  # another engine: 8 ms from its scheduling
    s = meter.stop(requests=3)
    approx = pytest.approx
    assert (s["engines"], s["steps"], s["empty_steps"], s["tokens"]) == (2, 6, 1, 648), s
    assert s["period_sum_ms"] == approx(4 + 4 + 6 + 5.1 + 8) and s["window_s"] == approx(1.013 - 0.0015)
    # from the previous step's t3 to this one's t0 where positive (idle gaps too; a file's first row has none)
    assert (s["between_ms_median"], s["between_ms_sum"]) == (approx(0.05), approx(979.5 + 0.1)), s
    assert s["unscheduled_steps"] == 0, s
    assert s["decode"] == approx({"n": 3, "period_ms_median": 5.1, "period_ms_p90": 5.82, "period_ms_p99": 5.982,
                                  "period_ms_mean": 5.0333, "tokens_median": 3.0, "schedule_ms_median": 0.5,
                                  "update_ms_median": 1.0, "long_n": 0, "long_excess_ms": 0.0,
                                  "long_schedule_ms_median": None, "long_update_ms_median": None}, abs=1e-3)
    assert (s["mixed_le512"]["n"], s["mixed_le512"]["period_ms_median"], s["mixed_le512"]["tokens_median"]) == (
        1, approx(8.0), 40.0)
    assert (s["mixed_gt512"]["n"], s["mixed_gt512"]["period_ms_median"]) == (1, approx(4.0))
    assert s["decode_one"] == {"n": 0}, s  # (every decode step here has 2 or 3 requests)
    assert engine_steps.summary(s) == ("decode 5.10 ms (n 3), decode of 1 - (n 0), mixed<=512 8.00 ms (n 1), "
                                       "mixed>512 4.00 ms (n 1)")
    rows = engine_steps.table_rows({"vanilla": [s, {"error": "x"}], "steer_all": []})
    assert rows[2] == "| vanilla | 5.100 | 3 | - | 0 | 8.000 | 1 | 4.000 | 1 | 0.500 | 1.000 |", rows
    assert rows[3] == "| steer_all | - | - | - | - | - | - | - | - | - | - |", rows

    idle = engine_steps.StepMeter(str(tmp_path)).stop(requests=4)
    assert idle["error"].startswith("no engine steps recorded (no row added to 2 step file(s)"), idle
    assert "while the run completed 4 requests" in idle["error"]
    empty = tmp_path / "none"
    empty.mkdir()
    assert "no steps.*.bin in" in engine_steps.StepMeter(str(empty)).stop()["error"]

    full = tmp_path / "full"
    full.mkdir()
    m = engine_steps.StepMeter(str(full))
    w = _steps_rows(full, 3, [(0.0, 0.0, 0.001, 0.001, 1, 1), (0.001, 0.001, 0.003, 0.003, 1, 1),
                              (0.003, 0.003, 0.004, 0.004, 1, 1)], capacity=2)
    assert engine_steps.read_header(w.path) == (2, True, 2)
    f = m.stop()
    assert f["steps"] == 2 and f["capacity_full"] == ["steps.3.bin (2 rows)"] and "recording stopped" in f["warning"], f
    assert "recording stopped" in engine_steps.summary(f)

    # a step whose schedule() the recorder did not see: no period, counted apart
    uns = tmp_path / "unscheduled"
    uns.mkdir()
    m = engine_steps.StepMeter(str(uns))
    _steps_rows(uns, 4, [(0.0, 0.001, 0.005, 0.006, 1, 1), (float("nan"), float("nan"), 0.010, 0.011, 1, 1)])
    u = m.stop()
    assert (u["steps"], u["unscheduled_steps"], u["decode"]["n"]) == (2, 1, 1), u
    assert u["period_sum_ms"] == approx(5.0) and u["window_s"] == approx(0.011), u


def test_a_groups_long_steps_are_counted_with_their_host_times_and_the_rows_saved(tmp_path):
    """The tail of a group: steps longer than twice its median, the time they add above it and
    their own schedule() / update_from_output() host times; the run's rows saved for a look at
    single steps (ms from the run's first t0)."""
    import numpy as np

    from benchmarks.xmix_bench import engine_steps

    meter = engine_steps.StepMeter(str(tmp_path))
    # idle gaps between the steps: each period is t2 - t0
    _steps_rows(tmp_path, 7, [(0.0, 0.0005, 0.005, 0.0051, 4, 4), (1.0, 1.0005, 1.005, 1.0051, 4, 4),
                              (2.0, 2.0005, 2.005, 2.0051, 4, 4), (3.0, 3.012, 3.020, 3.023, 4, 4)])
    npz = str(tmp_path / "run_steps.npz")
    s = meter.stop(save_to=npz)
    d = s["decode"]
    assert (d["n"], d["period_ms_median"], d["long_n"]) == (4, pytest.approx(5.0), 1), d
    assert d["long_excess_ms"] == pytest.approx(15.0) and d["period_ms_mean"] == pytest.approx(8.75), d
    assert (d["long_schedule_ms_median"], d["long_update_ms_median"]) == (pytest.approx(12.0), pytest.approx(3.0)), d
    assert d["schedule_ms_median"] == pytest.approx(0.5), d  # (the group's: the tail's step does not move it)
    saved = np.load(npz)
    assert sorted(saved.files) == ["e0", "e0_prev", "files"] and np.isnan(saved["e0_prev"]).all()
    assert list(saved["files"]) == ["steps.7.bin"]
    rows = saved["e0"]
    assert rows.dtype == np.float64 and rows.shape == (4, 6)
    np.testing.assert_allclose(rows[3], [3000.0, 3012.0, 3020.0, 3023.0, 4, 4], atol=1e-6)
    np.testing.assert_allclose(rows[:, 2] - rows[:, 0], [5.0, 5.0, 5.0, 20.0], atol=1e-6)

    # two engines' files, one with a row before the run: one origin (the earliest first t0), the
    # row before kept, each block named by its file; a run without steps leaves no old file behind
    two = tmp_path / "two"
    two.mkdir()
    w = _steps_rows(two, 11, [(10.0, 10.001, 10.004, 10.005, 2, 2)])
    meter = engine_steps.StepMeter(str(two))
    w.append(10.010, 10.011, 10.014, 10.015, 2, 2)
    _steps_rows(two, 12, [(10.002, 10.003, 10.009, 10.010, 30, 1)])
    npz2 = str(tmp_path / "two_steps.npz")
    assert meter.stop(save_to=npz2)["steps"] == 2
    saved = np.load(npz2)
    assert list(saved["files"]) == ["steps.11.bin", "steps.12.bin"]
    np.testing.assert_allclose(saved["e0"][0, :4], [8.0, 9.0, 12.0, 13.0], atol=1e-6)  # ms from t0 = 10.002 s
    np.testing.assert_allclose(saved["e0_prev"][0, :4], [-2.0, -1.0, 2.0, 3.0], atol=1e-6)
    np.testing.assert_allclose(saved["e1"][0, :4], [0.0, 1.0, 7.0, 8.0], atol=1e-6)
    assert np.isnan(saved["e1_prev"]).all()
    assert "error" in engine_steps.StepMeter(str(two)).stop(save_to=npz2)  # (nothing new)
    assert not os.path.exists(npz2)


def test_step_recorder_forgets_its_file_in_a_forked_child(tmp_path):
    """A process forked from one that records (vLLM's engine core with
    VLLM_WORKER_MULTIPROC_METHOD=fork) writes a file of its own, under its own pid, at its first row."""
    from benchmarks.xmix_bench import engine_steps

    assert engine_steps._open_writer(str(tmp_path)) is not None
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if engine_steps._writer is None and not engine_steps._scheduled else 1)
        assert os.waitpid(pid, 0)[1] == 0
        assert engine_steps._writer is not None and engine_steps._writer.path == engine_steps.step_file(str(tmp_path))
    finally:
        engine_steps._writer = None


def _stream(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[int, int]:
    """A streamed completion of a token-id prompt: (prompt tokens, completion tokens) of its usage."""
    import json
    import urllib.request

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    usage = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage["prompt_tokens"], usage["completion_tokens"]


@pytest.mark.one_version
def test_recorded_server_records_every_engine_step_of_its_engine_core(tiny_llama, tmp_path):
    """A real CPU server (the plugin loaded, nothing deployed) started through recorded_server.py:
    its engine core (spawned on a CPU, so the recorder is installed in it by the module's import
    there) records every step; one request alone gives exactly its prefill and its decode steps;
    concurrent requests' steps carry every prompt token and every generated token but the last
    (distinct prompts: no prefix-cache hit), one step with the long prompt; every row lies in
    the client's time window; an idle window has no step, and the meter says so."""
    import threading
    import time

    from conftest import running_server

    from benchmarks.xmix_bench import common, engine_steps

    steps = tmp_path / "steps"
    steps.mkdir()
    args = ["-m", "benchmarks.xmix_bench.recorded_server", "serve", tiny_llama, "--dtype", "float32",
            "--max-model-len", "1024", "--max-num-batched-tokens", "2048", "--enforce-eager", "--max-num-seqs", "8"]
    prof = tmp_path / "api" / "prof"  # the API server's profiler (serve start --profile-api), switched by signal
    prof.parent.mkdir()
    env = {engine_steps.ENV: str(steps), "XMIX_PROFILE_OUT": str(prof), "PYTHONPATH": os.pathsep.join(
        x for x in (str(common.REPO), os.environ.get("PYTHONPATH")) if x)}
    procs: list = []
    with running_server(args, tmp_path / "server.log", env=env, proc_out=procs) as url:
        t_before = time.perf_counter()
        meter = engine_steps.StepMeter(str(steps))
        assert _stream(url, tiny_llama, [11] + list(range(100, 129)), 6) == (30, 6)
        one = meter.stop(requests=1)
        (path,) = [str(p) for p in steps.glob("steps.*.bin")]
        pid = int(path.split(".")[-2])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert pid != procs[0].pid and b"EngineCore" in f.read(), path  # the engine core's file
        assert (one["mixed_le512"]["n"], one["mixed_le512"]["tokens_median"]) == (1, 30), one
        assert (one["decode"]["n"], one["decode"]["tokens_median"], one["mixed_gt512"]["n"]) == (5, 1, 0), one
        assert one["tokens"] == 30 + 5 and one["decode"]["period_ms_median"] > 0, one
        assert one["schedule_ms_median"] > 0 and one["update_ms_median"] > 0, one

        prompts = [[12] + list(range(200, 799)), [13] + list(range(300, 339)), [14] + list(range(400, 416)),
                   [15] + list(range(500, 589))]  # 600, 40, 17, 90 tokens
        meter = engine_steps.StepMeter(str(steps))
        got = [0] * len(prompts)

        def run(i):
            got[i] = _stream(url, tiny_llama, prompts[i], 8)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_after = time.perf_counter()
        many = meter.stop(requests=len(prompts))
        assert got == [(len(p), 8) for p in prompts]
        assert many["tokens"] == sum(len(p) + 8 - 1 for p in prompts), many
        assert many["mixed_gt512"]["n"] == 1 and many["mixed_gt512"]["tokens_median"] >= 600, many
        assert many["decode"]["n"] >= 7 and many["decode"]["tokens_median"] >= 1, many
        assert 0 < many["period_sum_ms"] <= many["window_s"] * 1e3 + 1e-6, many

        n, full, _ = engine_steps.read_header(path)
        rows = engine_steps.read_rows(path, 0, n)
        busy = rows[rows[:, 4] > 0]
        assert len(busy) >= 1 + 5 + 1 + 7 and not full
        assert (t_before <= busy[:, 0]).all() and (busy[:, 3] <= t_after).all(), (t_before, t_after, busy[:, :4])
        assert (busy[:, 0] <= busy[:, 1]).all() and (busy[:, 1] <= busy[:, 2]).all() and (busy[:, 2] <= busy[:, 3]).all()

        # the engine core may still run a step after the last request's output (vLLM's step with no
        # token once a request has finished): the idle window starts once the file stays still
        deadline, last = time.monotonic() + 20, None
        while time.monotonic() < deadline and last != engine_steps.read_header(path)[0]:
            last = engine_steps.read_header(path)[0]
            time.sleep(0.5)
        meter = engine_steps.StepMeter(str(steps))
        time.sleep(1.0)
        idle = meter.stop()
        assert idle["error"].startswith("no engine steps recorded (no row added"), idle

        # the benchmark client's ready check (one whole request of its own, before the measured
        # ones) is not the run's: serve_rounds.bench counts the steps from its end
        import asyncio

        import aiohttp
        import vllm.benchmarks.serve as bench_mod
        from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS, RequestFuncInput

        from benchmarks.xmix_bench import serve_results, serve_rounds, serve_servers

        async def ready_check():
            async with aiohttp.ClientSession() as session:
                probe = RequestFuncInput(prompt=[16] + list(range(600, 624)), api_url=f"{url}/v1/completions",
                                         prompt_len=25, output_len=5, model=tiny_llama, ignore_eos=True)
                out = await bench_mod.wait_for_endpoint(ASYNC_REQUEST_FUNCS["vllm"], probe, session, timeout_seconds=60)
                assert out.success, out.error

        meter = engine_steps.StepMeter(str(steps))
        with serve_rounds._after_ready_check([meter.restart]):
            asyncio.run(ready_check())
            assert _stream(url, tiny_llama, [17] + list(range(700, 711)), 3) == (12, 3)
        run = meter.stop(requests=1)
        assert run["tokens"] == 12 + 3 - 1, run  # not the ready check's 25 + 5 - 1 as well

        # the API server's profiler: off until SIGUSR1, a profile of its main thread at SIGUSR2
        # (the server process itself; the engine core writes none)
        import signal

        assert not list(prof.parent.iterdir())
        os.kill(procs[0].pid, signal.SIGUSR1)
        assert _stream(url, tiny_llama, [18] + list(range(800, 819)), 8) == (20, 8)
        os.kill(procs[0].pid, signal.SIGUSR2)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (prof.parent / "prof.0").exists():
            time.sleep(0.2)
        assert sorted(p.name for p in prof.parent.iterdir()) == ["prof.0", "prof.0.gc.json"]
        r = serve_results.api_profile_summary(str(prof.parent / "prof.0"), output_tokens=8, requests=1)
        assert r["calls_per_token"] > 50 and r["profiled_us_per_token"] > 0, r
        assert r["plugin_calls_per_token"] > 0, r  # the plugin's route guard and selection check ran
        import pstats

        profiled = {fn for _, _, fn in pstats.Stats(str(prof.parent / "prof.0")).stats}
        assert "completion_stream_generator" in profiled, sorted(profiled)[:20]  # the API server's own work
        assert "schedule" not in profiled  # not the engine core's (the scheduler runs in that process)
        assert "vanilla" in serve_results.api_profile_report({"vanilla": r, "inactive": r})

        # rounds --api-profile's run: vLLM's benchmark client against this server, its requests
        # alone profiled (no ready check), the profile kept and counted per output token
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        server = serve_servers.Server("s", port, str(tmp_path / "server.log"), procs[0].pid, api_profile=str(prof))
        got = serve_rounds.api_profile_run(str(tmp_path), server, {"serving_dir": tiny_llama}, None, "vanilla",
                                           ["--dataset-name", "random", "--random-input-len", "16",
                                            "--random-output-len", "4", "--random-range-ratio", "0"], "inf", 3,
                                           run_mark=7)
        assert got["requests"] == 3 and got["output_tokens"] == 3 * 4, got
        assert got["calls_per_token"] > 50 and (tmp_path / "api_profile_vanilla.prof").exists(), got

        # rounds --api-sample's run: the same, with py-spy sampling the API server from outside
        # (a run long enough for the API server's request path to be sampled, not only the
        # metrics page the meters read around it)
        sampled = serve_rounds.api_sample_run(str(tmp_path), server, {"serving_dir": tiny_llama}, None, "vanilla",
                                              ["--dataset-name", "random", "--random-input-len", "16",
                                               "--random-output-len", "48", "--random-range-ratio", "0"], "inf", 16,
                                              run_mark=8)
        assert sampled["requests"] == 16 and sampled["output_tokens"] == 16 * 48, sampled
        assert sampled["samples"] > 0 and sampled["gil_us_per_token"] > 0, sampled
        stacks = (tmp_path / "api_sample_vanilla.txt").read_text()
        assert any(f in stacks for f in ("completion_stream_generator", "OutputProcessor.process_outputs",
                                         "create_completion")), stacks[:2000]
        assert "EngineCore" not in stacks and "schedule (" not in stacks  # the API server's, not the engine core's
        assert bench_mod.wait_for_endpoint.__name__ == "wait_for_endpoint" and not hasattr(
            bench_mod.wait_for_endpoint, "__wrapped__") and bench_mod.wait_for_endpoint.__module__.endswith("ready_checker")
