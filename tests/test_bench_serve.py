"""The serving benchmark's commands as the GPU plans run them (benchmarks/plans/serve_steps_llama.sh),
on CPU servers of a small Llama config with dummy weights: `serve start` with a control server,
recorded engine steps and the API-server profiler; `serve rounds` at a request rate and at
saturation; `serve rounds --api-sample` (py-spy); `serve stop`. Each is the command line a plan
runs (`python -m benchmarks.xmix_bench serve ...`), so a plan's step that would fail on the GPU
machine fails here first. What the files hold is checked against what the runs did: every
configuration's run completed every request with the tokens asked for, and the A/A line goes to
latest.json's calibration, the apps to their lines."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)


def _free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def _serve_stop(out: str, env: dict) -> subprocess.CompletedProcess:
    """`serve stop --out OUT` as a plan runs it (in a test's finally: its result checked after)."""
    return subprocess.run([sys.executable, "-m", "benchmarks.xmix_bench", "serve", "stop", "--out", out],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _assert_stopped(stop: subprocess.CompletedProcess, out: str) -> None:
    """The stop succeeded and no server recorded in OUT's servers.json runs any more."""
    from benchmarks.xmix_bench import serve_servers

    assert stop.returncode == 0, stop.stderr[-3000:]
    st = json.load(open(os.path.join(out, "servers.json")))
    assert not any(serve_servers.Server.from_record(r).alive() for r in st["servers"].values())


def test_chained_plans_end_with_one_alldone(tmp_path):
    """benchmarks/plans/chain.sh runs plan command lines in order and drops their own ALLDONE
    lines (poll.sh stops at the first one), printing one at the very end, with each exit code."""
    r = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "plans", "chain.sh"),
                        "echo A; echo ALLDONE", "echo B; exit 3", "X=1 bash -c 'echo C$X'"],
                       env=dict(os.environ, XMIX_REPO=REPO), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [x for x in lines if not x.startswith("chain: ")] == ["A", "B", "C1", "ALLDONE"], lines
    assert [x for x in lines if x.startswith("chain: rc=")] == ["chain: rc=0", "chain: rc=3", "chain: rc=0"]


def test_each_server_compiles_into_caches_of_its_own(tmp_path):
    """A server's compile caches live under <out>/caches/<server>; they are cold until a start
    has put something in one of them, and no two servers share one."""
    from benchmarks.xmix_bench import serve_servers

    out = str(tmp_path)
    env, state = serve_servers.server_caches(out, "vanilla", {"PATH": "/bin"})
    assert state == "cold" and env["PATH"] == "/bin"
    assert set(serve_servers.CACHE_VARS) <= set(env)
    other, _ = serve_servers.server_caches(out, "xmix", {})
    for var in serve_servers.CACHE_VARS:
        assert env[var].startswith(os.path.join(out, "caches", "vanilla")) and env[var] != other[var]
    os.makedirs(env["VLLM_CACHE_ROOT"])  # an empty folder is no cache
    assert serve_servers.server_caches(out, "vanilla", {})[1] == "cold"
    os.makedirs(os.path.join(env["VLLM_CACHE_ROOT"], "modelinfos"))  # (vLLM's model registry: not compiled code)
    open(os.path.join(env["VLLM_CACHE_ROOT"], "modelinfos", "x.json"), "w").close()
    assert serve_servers.server_caches(out, "vanilla", {})[1] == "cold"
    os.makedirs(os.path.join(env["VLLM_CACHE_ROOT"], "torch_compile_cache", "abc"))
    assert serve_servers.server_caches(out, "vanilla", {})[1] == "warm"
    shutil.rmtree(os.path.join(env["VLLM_CACHE_ROOT"], "torch_compile_cache"))
    os.makedirs(os.path.join(env["TORCHINDUCTOR_CACHE_DIR"], "fxgraph"))
    assert serve_servers.server_caches(out, "vanilla", {})[1] == "warm"
    assert serve_servers.server_caches(out, "xmix", {})[1] == "cold"  # the other server's is its own


@pytest.mark.slow
@pytest.mark.one_version
def test_the_plans_serving_commands_run_against_cpu_servers(tmp_path):
    from benchmarks.xmix_bench import common

    model = common.write_model_config(str(tmp_path / "cfg"), layers=4, d_model=64, vocab=512)
    out, latest = str(tmp_path / "serve"), str(tmp_path / "latest.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (REPO, os.environ.get("PYTHONPATH")) if x))

    def bench(*args, timeout=900):
        cmd = [sys.executable, "-m", "benchmarks.xmix_bench", "serve", *args, "--out", out]
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"{' '.join(args[:1])}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        return r.stdout

    try:
        # the ports are free when chosen, but each server binds its own only after its start-up,
        # and meanwhile another process (the other test worker's engine sockets) can take one: a
        # start that failed with "Address already in use" starts again on other ports (three tries)
        for attempt in range(3):
            cmd = [sys.executable, "-m", "benchmarks.xmix_bench", "serve", "start", "--out", out, "--model", model,
                   "--latest", latest, "--control", "--alt-variants", "onoff", "--record-steps", "--profile-api",
                   "--dtype", "float32",
                   "--max-model-len", "512", "--port", str(_free_ports(5)),
                   "--server-args", "--enforce-eager --max-num-seqs 8 --max-num-batched-tokens 512"]
            r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
            if r.returncode == 0:
                break
            logs = "".join(open(os.path.join(out, f)).read() for f in os.listdir(out) if f.endswith(".log"))
            assert "Address already in use" in logs and attempt < 2, f"start: exit {r.returncode}\n{r.stderr[-5000:]}"
        st = json.load(open(os.path.join(out, "servers.json")))
        # (the alternative server: the same deployment under another graph-variant policy, serve_lines.sh ALT)
        assert set(st["servers"]) == {"vanilla", "xmix", "control", "alt"}, st["servers"]
        assert st["alt_variants"] == {"mode": "onoff", "env": {"VLLM_XMIX_GRAPH_VARIANTS": "onoff"}}, st
        assert all(s["startup_s"] > 0 for s in st["servers"].values()), st["servers"]
        # each server compiled into caches of its own, first start in this folder: cold
        assert all(s["compile_cache"] == "cold" for s in st["servers"].values()), st["servers"]
        assert st["record_steps"] and st["profile_api"] and st["control"] == "plain"

        # the plan's rate step: a request rate, the A/A control and three configurations
        bench("rounds", "--latest", latest, "--rates", "16", "--num-prompts", "6", "--warmup", "0", "--repeats", "1",
              "--dataset", "random", "--input-len", "24", "--range-ratio", "0.5", "--output-len", "8",
              "--configs", "aa_plain,inactive,steer_all,probe_one,alt_steer_all")
        runs = json.load(open(os.path.join(out, "results.json")))
        assert sorted(r["config"] for r in runs) == ["aa_plain", "alt_steer_all", "inactive", "probe_one", "steer_all",
                                                     "vanilla"]
        # (the random dataset draws output lengths 8 +-50% too, the same for every configuration:
        # with ignore_eos each run gives exactly those tokens)
        assert len({r["output_tokens"] for r in runs}) == 1 and 6 * 4 <= runs[0]["output_tokens"] <= 6 * 12, runs
        for r in runs:
            assert r["rate"] == "16" and r["cpu"]["api_server"]["cpu_s"] > 0 and r["engine_steps"]["tokens"] > 0, r
            # the run's rows beside its result: as many steps and tokens as its summary counts
            saved = np.load(os.path.join(out, "runs", f"{r['config']}_r16_1_steps.npz"))
            rows = np.concatenate([saved[f"e{i}"] for i in range(len(saved["files"]))])
            assert len(rows) == r["engine_steps"]["steps"] and rows[:, 4].sum() == r["engine_steps"]["tokens"], r
        lines = json.load(open(latest))["models"]["cfg"]
        assert set(lines["serve"]) == {"inactive", "steer_all", "probe_one"}, lines["serve"].keys()  # (no alt_ line)
        assert set(lines["calibration"]) == {"aa_plain"}  # the A/A line: no budget line of its own
        assert lines["startup"]["plain_s"] > 0 and lines["startup"]["xmix_s"] > 0, lines["startup"]
        assert lines["startup"]["caches"] == {"plain": "cold", "xmix": "cold"}, lines["startup"]
        # each line's ratio is its run's value over vanilla's, as the client measured them (on a
        # loaded CPU host a run can get every request's tokens merged into one chunk: an ITL of 0)
        measured = {r["config"]: r["result"] for r in runs}
        metrics = (("mean_itl", "mean_itl_ms"), ("p99_itl", "p99_itl_ms"), ("mean_ttft", "mean_ttft_ms"),
                   ("throughput", "total_token_throughput"))
        for name, line in {**lines["serve"], **lines["calibration"]}.items():
            for metric, key in metrics:
                base = measured["vanilla"][key]
                if not base:  # (vanilla's own ITL 0: no ratio, the metric omitted)
                    assert metric not in line["rate=16"] and metric.endswith("_itl"), (name, metric, line)
                    continue
                got = line["rate=16"][metric]
                assert got["n"] == 1, (name, metric, line)
                assert got["ratio"] == pytest.approx(measured[name][key] / base, rel=1e-3, abs=1e-4), (name, metric)
            assert line["rate=16"]["mean_ttft"]["ratio"] > 0 and line["rate=16"]["throughput"]["ratio"] > 0, line

        # the plan's saturation step, with every app on at once
        bench("rounds", "--latest", latest, "--rates", "inf", "--num-prompts", "8", "--warmup", "0", "--repeats", "1",
              "--output-len", "5", "--max-prompt-len", "256", "--configs", "inactive,all_apps")
        runs = json.load(open(os.path.join(out, "results.json")))
        sat = [r for r in runs if r["rate"] == "inf"]
        assert sorted(r["config"] for r in sat) == ["all_apps", "inactive", "vanilla"]
        assert all(r["output_tokens"] == 8 * 5 for r in sat), sat
        lines = json.load(open(latest))["models"]["cfg"]["serve"]
        assert lines["all_apps"]["rate=inf"]["throughput"]["ratio"] > 0 and "rate=16" in lines["probe_one"]

        # the plan's API-server step: unmeasured runs sampled by py-spy, nothing added to the rounds
        printed = bench("rounds", "--no-latest", "--rates", "inf", "--num-prompts", "8", "--warmup", "0",
                        "--repeats", "0", "--output-len", "5", "--max-prompt-len", "256", "--api-sample", "inactive,probe_one")
        sampled = json.load(open(os.path.join(out, "api_sample.json")))
        assert set(sampled) == {"vanilla", "inactive", "probe_one"}, sampled.keys()
        for name, r in sampled.items():
            assert r["output_tokens"] == 8 * 5 and r["requests"] == 8, (name, r)
            assert os.path.exists(os.path.join(out, f"api_sample_{name}.txt")), name
        assert "microseconds per output token" in printed, printed[-2000:]
        assert len(json.load(open(os.path.join(out, "results.json")))) == len(runs)  # (no rounds: none added)
    finally:
        stop = _serve_stop(out, env)
    _assert_stopped(stop, out)


@pytest.mark.slow
@pytest.mark.one_version
def test_servers_one_at_a_time_pair_by_round(tmp_path):
    """Where two servers do not fit on the GPU (Mixtral-8x7B on an 80 GB card): `serve start
    --servers vanilla`, its rounds, stop, then `--servers xmix` in the same folder and its rounds.
    The plugin's rounds pair with vanilla's by round number, latest.json gets their lines (saying
    the servers ran one at a time) and the start-up line from both servers' records; a
    configuration whose server is down is refused, naming it."""
    from benchmarks.xmix_bench import common

    model = common.write_model_config(str(tmp_path / "cfg"), layers=4, d_model=64, vocab=512)
    out, latest = str(tmp_path / "serve"), str(tmp_path / "latest.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (REPO, os.environ.get("PYTHONPATH")) if x))

    def bench(*args, ok=True, timeout=900):
        cmd = [sys.executable, "-m", "benchmarks.xmix_bench", "serve", *args, "--out", out]
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if ok:
            assert r.returncode == 0, f"{args[0]}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        return r

    def start(name):
        for attempt in range(3):  # (a port taken meanwhile by another process: start again elsewhere)
            r = bench("start", "--model", model, "--latest", latest, "--servers", name, "--dtype", "float32",
                      "--max-model-len", "512", "--port", str(_free_ports(2)),
                      "--server-args", "--enforce-eager --max-num-seqs 8 --max-num-batched-tokens 512", ok=False)
            if r.returncode == 0:
                return json.load(open(os.path.join(out, "servers.json")))
            log = os.path.join(out, f"{name}.log")
            assert attempt < 2 and "Address already in use" in open(log).read(), r.stderr[-5000:]

    rate16 = ["--latest", latest, "--rates", "16", "--num-prompts", "4", "--warmup", "0", "--repeats", "1",
              "--dataset", "random", "--input-len", "24", "--range-ratio", "0.5", "--output-len", "4"]
    try:
        st = start("vanilla")
        assert set(st["servers"]) == {"vanilla"} and st["up"] == ["vanilla"] and st["one_at_a_time"], st
        refused = bench("rounds", *rate16, "--configs", "steer_all", ok=False)
        assert refused.returncode != 0 and "steer_all" in refused.stderr and "not running" in refused.stderr, \
            refused.stderr[-2000:]
        bench("rounds", *rate16)  # vanilla only
        assert [(r["config"], r["round"]) for r in json.load(open(os.path.join(out, "results.json")))] == [("vanilla", 1)]
        bench("stop")

        st = start("xmix")
        assert set(st["servers"]) == {"vanilla", "xmix"} and st["up"] == ["xmix"], st
        assert st["servers"]["vanilla"]["startup_s"] > 0  # (kept from the first start)
        bench("rounds", *rate16, "--configs", "inactive,steer_all")
        runs = json.load(open(os.path.join(out, "results.json")))
        assert sorted((r["config"], r["round"]) for r in runs) == [("inactive", 1), ("steer_all", 1), ("vanilla", 1)]
        lines = json.load(open(latest))["models"]["cfg"]
        assert set(lines["serve"]) == {"inactive", "steer_all"}, lines["serve"].keys()
        for name, line in lines["serve"].items():
            entry = line["rate=16"]
            assert entry["mean_itl"]["n"] == 1 and entry["mean_itl"]["ratio"] > 0, (name, entry)
            assert "one at a time" in entry["workload"], entry["workload"]
            # the ratio is to the vanilla run of the first start
            van = next(r for r in runs if r["config"] == "vanilla")["result"]["mean_itl_ms"]
            mine = next(r for r in runs if r["config"] == name)["result"]["mean_itl_ms"]
            assert abs(entry["mean_itl"]["ratio"] - mine / van) < 1e-4, (entry, mine, van)
        assert lines["startup"]["plain_s"] == st["servers"]["vanilla"]["startup_s"] and lines["startup"]["xmix_s"] > 0
        # more of the plugin's rounds than vanilla has: refused before any run, nothing unpaired added
        again = bench("rounds", *rate16, "--configs", "inactive", ok=False)
        assert again.returncode != 0 and "no vanilla rounds" in again.stderr + again.stdout, again.stderr[-2000:]
        assert len(json.load(open(os.path.join(out, "results.json")))) == 3
    finally:
        stop = _serve_stop(out, env)
    _assert_stopped(stop, out)
