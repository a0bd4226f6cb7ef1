"""The benchmark's meters: the serving benchmark's TTFT split from vLLM's metrics
(benchmarks/xmix_bench/server_metrics.py: exposition text written by hand, two engines' label
sets, and the run's share of it; the same meter against a real server is in
tests/test_serve.py); `profile api-cpu` (benchmarks/xmix_bench/api_cpu.py) against its own CPU
server; `profile api-calls` (api_calls.py) against its own profiled CPU servers; `profile
norm-call` on a hosted norm."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.xmix_bench.server_metrics import difference, parse, table_rows  # noqa: E402


def exposition(ttft, queue, prefill, steps, hits, engines=2) -> str:
    """vLLM-style text: each (sum, count) split evenly over ``engines`` label sets."""
    out = []
    for fam, (s, n) in (("vllm:time_to_first_token_seconds", ttft), ("vllm:request_queue_time_seconds", queue),
                        ("vllm:request_prefill_time_seconds", prefill), ("vllm:iteration_tokens_total", steps)):
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
    probe_funcs = [k for k, here, ref in cf["probe_one"]["changed"] if "vllm_xmix/" in k and ref == 0]
    assert probe_funcs, cf["probe_one"]["changed"]
    assert not any("vllm_xmix/results.py" in k and here > 0 for k, here, ref in cf["none"]["changed"])
    assert cf["plain"]["plugin_calls_per_chunk"] == 0 < cf["none"]["plugin_calls_per_chunk"], cf
    assert cf["probe_one"]["plugin_calls_per_token"] > cf["none"]["plugin_calls_per_token"], cf
    assert "probe_one" in report(r)


@pytest.mark.one_version
def test_norm_call_times_a_norm_that_hosts_sites():
    """`profile norm-call` finds a norm that hosts hook sites (it raises otherwise) and times it
    against vLLM's norm called directly."""
    from benchmarks.xmix_bench.profile import norm_call

    r = norm_call(tokens=4, calls=200, repeats=1)
    assert r["hosted_us"][0] > 0 and r["direct_us"][0] > 0, r


def test_stream_cost_times_every_chunk_and_the_decode_chunks_apart():
    """`profile stream`: microseconds per streamed chunk of a probe request, over the whole stream,
    over its decode chunks alone (the first carries the prompt's values, the last all) and for
    the last."""
    from benchmarks.xmix_bench.stream import stream_cost

    r = stream_cost(prompt=64, tokens=8, repeats=3)
    assert len(r["runs"]) == len(r["decode_runs"]) == len(r["final_runs"]) == 3, r
    assert r["us_per_chunk"] > 0 and r["us_per_decode_chunk"] > 0 and r["us_final_chunk"] > 0, r
    # the prompt's 64 values and the final 71 are more work than one decode step's value
    assert r["us_per_decode_chunk"] < r["us_per_chunk"], r


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
