"""The rounds of a serving A/B (``serve rounds``): runs of ``vllm bench serve`` against the
running servers, every configuration once per round.

For each ``--rates`` rate, ``--warmup`` discarded rounds, then ``--repeats`` rounds; in each round
every configuration once (vanilla, inactive, app1, app2, ..., ``serve_configs``; and with
``--order abba``, the default, the even-numbered rounds of the folder in reverse: a run's
position in its round, after the GPU ran another server's run or sat idle, and drift over the
rounds cancel over pairs of rounds). ``vllm bench serve`` runs in this process, and every run
replaces the first token of each prompt with a fresh one, so no run is served from another
run's prefix cache. Rounds add to ``<out>/results.json`` (numbered on from the rounds already
there; written after every run), then summary.md, overhead.png and latest.json
(``serve_results``) and ``sweep/`` (``serve_configs``).

Every run also records the CPU time of the server's processes over the run
(``cpu_usage.CpuMeter``: the API server and the engine core, each busy fraction and its
busiest thread's), so a throughput line can be traced to the process that bounded it, and
the split of its mean TTFT by vLLM's own per-request metrics (``server_metrics``: front end,
queue, prefill; a table of its own in summary.md), so a TTFT line can be traced to the part
of the serving path it lies in. With ``start --record-steps`` every run carries a summary of
the engine steps that ran during it (``engine_steps`` in results.json: step periods of decode
steps and of prefill-carrying steps up to / over 512 tokens, the host time of the scheduler's
two calls; a table of its own in summary.md).

``--profile CONFIGS`` (servers started with ``--profiler``): afterwards one run of vanilla and
of each listed configuration under vLLM's torch profiler; vLLM's per-kernel tables are kept
as ``profile_<config>.txt``, each trace's per-step summary (``profile trace``) as
``trace_<config>.json``, and ``trace_<config>_vs_vanilla.md`` sets them side by side; the raw
traces stay in ``prof_vanilla/`` and ``prof_xmix/``. ``--api-sample CONFIGS`` (any servers):
afterwards one run of vanilla and of each listed configuration with py-spy sampling the
server's API server (``api_sample``: GIL-held microseconds per output token, the functions
whose time grew); ``--api-profile CONFIGS`` (servers started with ``--profile-api``) the same
under cProfile (calls exact, times inflated).

Datasets (``--dataset``): ``sharegpt`` (default): ShareGPT-format conversations whose prompt
lengths follow LogNormal(mu=5.0, sigma=0.9) tokens clipped to [4, ``--max-prompt-len``] (median
~150, mean ~220: an approximation of ShareGPT v3 prompt lengths under a Llama-3 tokenizer, no
download); ``random``: vLLM's random dataset, ``--input-len`` tokens +-``--range-ratio``. Outputs
are ``--output-len`` tokens (ignore_eos).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time

from . import api_sample, common, cpu_pinning, engine_steps, server_metrics
from .cpu_usage import CpuMeter
from .cpu_usage import summary as cpu_summary
from .serve_configs import configs_for, k_selections, selected_configs, write_sweep_files
from .serve_results import api_profile_report, api_profile_summary, summarize, to_latest
from .serve_servers import STATE, Server


def _dataset(args, st: dict) -> tuple[list[str], str]:
    """vllm bench serve's dataset arguments and the workload's title."""
    if args.dataset == "random":
        lo, hi = int(args.input_len * (1 - args.range_ratio)), int(args.input_len * (1 + args.range_ratio))
        return (["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                 str(args.output_len), "--random-range-ratio", str(args.range_ratio)],
                f"{os.path.basename(st['model'])}, random dataset {args.input_len} input tokens "
                f"+-{args.range_ratio:.0%} ({lo}-{hi}), {args.num_prompts} prompts, {args.output_len} output tokens")
    name = f"sharegpt_{args.num_prompts}_{args.output_len}_{args.max_prompt_len}.json"
    path = os.path.join(os.path.abspath(args.out), name)
    if not os.path.exists(path):
        build_sharegpt(path, args.num_prompts, st["vocab_size"], output_len=args.output_len,
                       max_len=args.max_prompt_len)
    title = (f"{os.path.basename(st['model'])}, ShareGPT-like prompt lengths (LogNormal(5.0, 0.9), 4-"
             f"{args.max_prompt_len} tokens), {args.num_prompts} prompts, {args.output_len} output tokens")
    return ["--dataset-name", "sharegpt", "--dataset-path", path, "--sharegpt-output-len", str(args.output_len)], title


def build_sharegpt(path: str, n: int, vocab: int, seed: int = 0, output_len: int = 128, max_len: int = 1024) -> None:
    """ShareGPT-format conversations; prompt lengths LogNormal(5.0, 0.9) clipped to [4, max_len]
    (vLLM's ShareGPT loader drops prompts over 1024 tokens)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = np.clip(np.round(rng.lognormal(5.0, 0.9, n)), 4, max_len).astype(int)
    convs = []
    for i, L in enumerate(lens):
        ids = rng.integers(10, vocab - 10, int(L))
        out_ids = rng.integers(10, vocab - 10, output_len)
        convs.append({"id": f"synth-{i}", "conversations": [
            {"from": "human", "value": " ".join(f"t{x}" for x in ids)},
            {"from": "gpt", "value": " ".join(f"t{x}" for x in out_ids)}]})
    common.write_json(path, convs, indent=None)


def bench(server: Server, st: dict, dataset_args: list[str], rate: str, n: int, sel, result: str, seed: int,
          run_mark: int, profile: bool = False, api_profile: bool = False, api_sample_to: str | None = None) -> dict:
    """One ``vllm bench serve`` run (vLLM's client and metrics, in this process). ``api_profile``:
    the server's API-server profiler (``start --profile-api``) runs from just before the client
    starts (its ready check skipped) to the run's end; ``api_sample_to``: likewise py-spy samples
    the server's API server into that file (:class:`api_sample.Sampler`)."""
    argv = ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{server.port}", "--model", st["serving_dir"],
            "--tokenizer", st["serving_dir"]] + dataset_args + [
            "--num-prompts", str(n), "--ignore-eos", "--request-rate", rate, "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--save-result",
            "--result-dir", os.path.dirname(result), "--result-filename", os.path.basename(result),
            "--disable-tqdm", "--save-detailed"] + (["--profile"] if profile else [])
    if isinstance(sel, list):
        argv += ["--extra-body", json.dumps({"vllm_xargs": {"xmix": sel}})]
    common.XARGS_CYCLE = k_selections(int(sel[1:])) if isinstance(sel, str) else None
    common.RUN_MARK = f"t{run_mark}"  # a fresh first token: no prefix-cache hits across runs
    parts = server_metrics.MetricsMeter(f"http://127.0.0.1:{server.port}")  # where the TTFT went, by vLLM's metrics
    meter = CpuMeter(server.pid)  # which of the server's processes was busy during the run (after the
    # metrics read, whose rendering is API-server work of its own)
    steps = engine_steps.StepMeter(server.steps_dir) if server.steps_dir else None  # the run's engine steps
    on_ready = [steps.restart] if steps is not None else []
    if api_profile or api_sample_to:  # from the run's first request: no ready check (its request alone is not the run's)
        argv += ["--ready-check-timeout-sec", "0"]
    if api_profile:
        os.kill(server.pid, signal.SIGUSR1)
    sampler = api_sample.Sampler(server.pid, api_sample_to) if api_sample_to else None
    res = None
    try:
        with _after_ready_check(on_ready):
            res = common.bench_serve(argv)
    finally:
        common.XARGS_CYCLE = None
        if api_profile:
            os.kill(server.pid, signal.SIGUSR2)
        if sampler is not None:
            try:
                sampler.stop()
            except RuntimeError as e:
                if res is not None:  # the run itself succeeded: the sampler's failure is the error
                    raise
                # the run failed: its error propagates, the sampler's is only reported
                print(f"[serve] {result}: the API-server sampler failed too: {e}", file=sys.stderr)
    res["cpu"] = meter.stop(active_s=res.get("duration"))  # fractions of the benchmark's own duration
    if steps is not None:
        res["engine_steps"] = steps.stop(requests=res.get("completed"), save_to=os.path.splitext(result)[0] + "_steps.npz")
    res["server_metrics"] = parts.stop(expect=res.get("completed"))
    if res.get("completed", n) != n:
        raise RuntimeError(f"{result}: only {res.get('completed')} of {n} requests completed")
    res["timeline"] = timeline(res)
    return res


@contextlib.contextmanager
def _after_ready_check(callbacks: list):
    """While ``vllm bench serve`` runs: each of ``callbacks`` is called at the end of the
    client's ready check, which first sends one whole request alone (the full output length
    with ``--ignore-eos``: a mixed step and ``output_len - 1`` decode steps at batch 1 that are
    not the run's): the step meter's restart."""
    if not callbacks:
        yield
        return
    import vllm.benchmarks.serve as bench_mod

    orig = bench_mod.wait_for_endpoint

    async def wait_for_endpoint(*args, **kwargs):
        out = await orig(*args, **kwargs)
        for fn in callbacks:
            fn()
        return out

    bench_mod.wait_for_endpoint = wait_for_endpoint
    try:
        yield
    finally:
        bench_mod.wait_for_endpoint = orig


def timeline(res: dict, stall_ms: float = 20.0) -> dict:
    """What the per-request arrays of a run (``--save-detailed``: ``start_times``, ``ttfts``,
    ``itls``, seconds) say about how its latency is spread: TTFT percentiles (ms), and on the
    run's merged token timeline (every streamed token's arrival at the client, while some
    request was in flight) the gaps of at least ``stall_ms`` in which no request received a
    token: how many, their total and the longest (ms). A cost per engine step spreads over
    every request; a stall of the engine (or of the server's event loop) shows as such gaps.
    With ``output_lens``: ``chunks_per_output_token``, the streamed chunks that brought text
    (the first, and one per ITL entry) over the output tokens: 1.0 where every token came in a
    chunk of its own, less where the server merged the outputs of a stream that lagged (the
    front end's cost per chunk is then spread over several tokens)."""
    import numpy as np

    starts, ttfts, itls = res.get("start_times") or [], res.get("ttfts") or [], res.get("itls") or []
    if not (starts and ttfts and len(starts) == len(ttfts) == len(itls)):
        return {}
    tokens, spans = [], []
    for s0, f, gaps in zip(starts, ttfts, itls):
        if not f:
            continue
        t = s0 + f + np.concatenate([[0.0], np.cumsum(gaps)])
        tokens.append(t)
        spans.append((s0, t[-1]))
    if not tokens:
        return {}
    t = np.sort(np.concatenate(tokens))
    d = np.diff(t)
    # a gap counts only while a request was waiting for a token (started, not yet finished)
    lo, hi = np.array([a for a, _ in spans]), np.array([b for _, b in spans])
    mid = (t[:-1] + t[1:]) / 2
    waiting = (np.searchsorted(np.sort(lo), mid) - np.searchsorted(np.sort(hi), mid)) > 0
    big = d[(d * 1e3 >= stall_ms) & waiting] * 1e3
    q = np.percentile(np.array(ttfts) * 1e3, [10, 25, 50, 75, 90, 99])
    out = {"ttft_pct_ms": dict(zip(["p10", "p25", "p50", "p75", "p90", "p99"], [round(float(x), 2) for x in q])),
           "stall_ms": stall_ms, "stalls": int(big.size), "stall_total_ms": round(float(big.sum()), 1),
           "stall_max_ms": round(float(big.max()), 1) if big.size else 0.0,
           "ttfts_ms": [round(float(x) * 1e3, 2) for x in ttfts]}
    lens = res.get("output_lens") or []
    if len(lens) == len(ttfts) and sum(lens):  # (the requests that got a first token)
        got = [(len(g) + 1, n) for f, g, n in zip(ttfts, itls, lens) if f]
        out["chunks_per_output_token"] = round(sum(c for c, _ in got) / max(sum(n for _, n in got), 1), 4)
    return out


def round_order(names: list[str], k: int, order: str = "abba") -> list[str]:
    """The configurations of measured round ``k`` (0, 1, ...) in the order they run: ``names``
    as given, and with ``order`` ``abba`` reversed in every odd round (A B C, C B A, A B C, ...),
    so that a run's position in its round and a linear drift cancel over each pair of rounds.

    Raises:
        ValueError: an order other than abba / fixed."""
    if order not in ("abba", "fixed"):
        raise ValueError(f"round order {order!r}: abba or fixed")
    return list(reversed(names)) if order == "abba" and k % 2 else list(names)


def rounds(args) -> int:
    out = os.path.abspath(args.out)
    st = common.read_json(os.path.join(out, STATE))
    if not st:
        raise SystemExit(f"{out}/{STATE}: no servers started here (serve start --out {args.out} ...)")
    # (start --servers: the ones the last start launched; one whose start failed has no record)
    up = [n for n in (st.get("up") or list(st["servers"])) if n in st["servers"]]
    servers = {n: Server.from_record(st["servers"][n]) for n in up}
    for s in servers.values():
        s.wait(args.wait)
    if st.get("pin_cpus"):  # the client (this process, its meters and samplers) on the cores start left it
        try:
            cpu_pinning.pin(st["pin_cpus"]["client"])
        except cpu_pinning.PinningError as e:
            raise SystemExit(f"{out}/{STATE}: the servers were started with --pin-cpus, and the client's CPUs "
                             f"cannot be taken here: {e}") from None
    all_configs = configs_for(st["apps"], st.get("second", "xmix"), st.get("control", False),
                              (st.get("alt_variants") or {}).get("mode"))
    down = sorted(n for n, (srv, _) in all_configs.items() if srv not in servers)
    asked = {*args.configs.split(","), *args.profile.split(","), *args.api_profile.split(","),
             *args.api_sample.split(",")} - {""}
    if down and (asked & set(down) or ((args.profile or args.api_profile or args.api_sample) and "vanilla" in down)):
        args._parser.error(f"configuration(s) {sorted(asked & set(down)) or ['vanilla']} need a server that is not "
                           f"running (servers up: {', '.join(up)}; start --servers chose them)")
    configs = all_configs
    profiled = [c for c in args.profile.split(",") if c]
    if any(c.startswith(("aa_", "alt_")) for c in profiled):
        args._parser.error("--profile: the A/A and alternative servers run without vLLM's profiler; profile the "
                           "plugin's configurations")
    unknown = sorted({*args.configs.split(","), *profiled} - set(configs) - {""})
    if unknown:
        args._parser.error(f"--configs/--profile: unknown configuration(s) {unknown}; known: {', '.join(configs)}")
    if profiled and not st.get("profiler"):
        args._parser.error("--profile: the servers were started without --profiler")
    def known(text: str, flag: str) -> list[str]:
        """The configurations a comma-separated option names, each one of ``configs``."""
        names = [c for c in text.split(",") if c]
        unknown = sorted(set(names) - set(configs))
        if unknown:
            args._parser.error(f"{flag}: unknown configuration(s) {unknown}; known: {', '.join(configs)}")
        return names

    api_profiled = known(args.api_profile, "--api-profile")
    if api_profiled and not st.get("profile_api"):
        args._parser.error("--api-profile: the servers were started without --profile-api")
    api_sampled = known(args.api_sample, "--api-sample")
    if api_sampled:
        try:
            api_sample.py_spy_path()
        except RuntimeError as e:
            args._parser.error(f"--api-sample: {e}")
    if args.configs:
        configs = selected_configs(configs, args.configs)
    configs = {n: c for n, c in configs.items() if c[0] in servers}  # (vanilla too, where its server is down)
    dataset_args, title = _dataset(args, st)
    if st.get("pin_cpus"):
        title += ", each server and the client on physical CPU cores of their own"
    rates = args.rates.split(",")
    write_sweep_files(os.path.join(out, "sweep"), st, dataset_args, configs, rates, args.num_prompts)
    res_path = os.path.join(out, "results.json")
    runs: list[dict] = common.read_json(res_path, []) or []
    commit, date, command = common.git_commit(), common.today(), common.command_line()
    mark = 0

    def next_mark() -> int:
        nonlocal mark
        mark += 1
        return (mark * 7919 + os.getpid()) % (st["vocab_size"] - 20) + 10

    for rate in rates:
        # numbered on from this folder's rounds of these configurations (vanilla's among them whenever
        # its server is up); without vanilla (start --servers) on from vanilla's latest rounds, the
        # ones these pair with, and refused where vanilla has none left to pair with
        first = 1 + max((r["round"] for r in runs if r["rate"] == rate and r.get("title", title) == title
                         and r["config"] in configs), default=0)
        if "vanilla" not in configs and args.repeats:
            van = sorted(r["round"] for r in runs if r["rate"] == rate and r.get("title", title) == title
                         and r["config"] == "vanilla")
            if van:
                first = max(first, van[-1] - args.repeats + 1)
            if not van or first + args.repeats - 1 > van[-1]:
                raise SystemExit(f"rate {rate}: vanilla's server is not up and results.json has no vanilla rounds "
                                 f"{first}..{first + args.repeats - 1} for these runs to pair with (vanilla's: "
                                 f"{van or 'none'}); start --servers vanilla and run its rounds first")
        plan = [(0, False)] * args.warmup + [(first + i, True) for i in range(args.repeats)]
        for rnd, measured in plan:  # warm-up rounds use seed 0 and are discarded
            # abba by the round's number in the folder: rounds added by later commands keep alternating
            for name in round_order(list(configs), rnd - 1 if measured else 0, args.order):
                srv, sel = configs[name]
                f = os.path.join(out, "runs", f"{name}_r{rate}_{rnd if measured else 'warmup'}.json")
                os.makedirs(os.path.dirname(f), exist_ok=True)
                n = args.num_prompts if measured or not args.warmup_prompts else args.warmup_prompts
                res = bench(servers[srv], st, dataset_args, rate, n, sel, f, seed=rnd, run_mark=next_mark())
                tl = res.get("timeline") or {}
                print(f"rate {rate} round {rnd if measured else 'warm-up'} {name}: itl {res['mean_itl_ms']:.3f} ms  "
                      f"tput {res['total_token_throughput']:.0f} tok/s  ttft p50 "
                      f"{tl.get('ttft_pct_ms', {}).get('p50', float('nan')):.2f} ms  stalls >= {tl.get('stall_ms')} ms: "
                      f"{tl.get('stalls')} ({tl.get('stall_total_ms')} ms, longest {tl.get('stall_max_ms')})  "
                      f"chunks/token {tl.get('chunks_per_output_token', 'n/a')}  cpu: {cpu_summary(res.get('cpu') or {})}  "
                      f"vLLM metrics: {server_metrics.summary(res.get('server_metrics') or {})}"
                      + (f"  engine steps: {engine_steps.summary(res['engine_steps'])}" if "engine_steps" in res
                         else ""), flush=True)
                if measured:
                    runs.append({"rate": rate, "round": rnd, "config": name, "title": title, "commit": commit,
                                 "date": date, "result": {k: res[k] for k, _, _ in common.SERVE_METRICS},
                                 "output_tokens": res.get("total_output_tokens"),
                                 "timeline": res.get("timeline", {}), "cpu": res.get("cpu", {}),
                                 "server_metrics": res.get("server_metrics", {}),
                                 **({"engine_steps": res["engine_steps"]} if "engine_steps" in res else {})})
                    common.write_json(res_path, runs)  # after every run: a cut command keeps its runs
    if api_profiled:  # where the API server's time goes, per output token: vanilla vs each configuration
        got = common.read_json(os.path.join(out, "api_profile.json"), {}) or {}  # (earlier configs kept)
        for name in ["vanilla"] + [c for c in api_profiled if c != "vanilla"]:
            srv, sel = all_configs[name]  # (also those left out of --configs)
            got[name] = api_profile_run(out, servers[srv], st, sel, name, dataset_args, rates[0], args.num_prompts,
                                        next_mark())
        common.write_json(os.path.join(out, "api_profile.json"), got)
        print(api_profile_report({"vanilla": got["vanilla"], **got}), flush=True)
    if api_sampled:  # the same question by sampling: no profiler inside the server
        got = common.read_json(os.path.join(out, "api_sample.json"), {}) or {}  # (earlier configs kept)
        for name in ["vanilla"] + [c for c in api_sampled if c != "vanilla"]:
            srv, sel = all_configs[name]
            got[name] = api_sample_run(out, servers[srv], st, sel, name, dataset_args, rates[0], args.num_prompts,
                                       next_mark())
        common.write_json(os.path.join(out, "api_sample.json"), got)
        print(api_sample.report({"vanilla": got["vanilla"], **got}), flush=True)
    if profiled:  # where the time goes: vanilla vs each profiled configuration, same rate and prompts
        rate = rates[0]
        for name in ["vanilla"] + profiled:
            profile_run(out, servers, st, configs_for(st["apps"])[name], name, dataset_args, rate,
                        min(args.num_prompts, 100), next_mark())
        from . import profile as trace_tools

        for name in profiled:
            a, b = (os.path.join(out, f"trace_{n}.json") for n in ("vanilla", name))
            if os.path.exists(a) and os.path.exists(b):
                md = trace_tools.compare(common.read_json(a), common.read_json(b), "vanilla", name)
                with open(os.path.join(out, f"trace_{name}_vs_vanilla.md"), "w") as fh:
                    fh.write(md + "\n")
                print(f"## {name} vs vanilla (engine steps of the profiled run)\n{md}", flush=True)
    if not runs:
        print("no measured rounds (--repeats 0: warm-up only); results.json is empty", flush=True)
        return 0
    print(summarize(runs, out))
    if not args.no_latest:
        print(to_latest(args.latest, runs, st["model_name"], rates=rates, configs=list(configs),
                        setup=st.get("command", ""), command=command, fused_writes=st.get("fused_writes"),
                        card=st.get("card") or common.gpu_card(), one_at_a_time=bool(st.get("one_at_a_time"))))
    return 0


def api_profile_run(out: str, server: Server, st: dict, sel, name: str, dataset_args, rate: str, n: int,
                    run_mark: int) -> dict:
    """One run of configuration ``name`` with its server's API server profiled (``bench(...,
    api_profile=True)``): the profile kept as ``<out>/api_profile_<name>.prof`` and summarized
    per output token (:func:`api_profile_summary`).

    Raises:
        RuntimeError: the server wrote no profile within 30 s of the run's end."""
    import glob

    if not server.api_profile:
        raise RuntimeError(f"{server.name}: started without --profile-api")
    before = set(glob.glob(server.api_profile + ".*[0-9]"))
    res = bench(server, st, dataset_args, rate, n, sel, os.path.join(out, "runs", f"api_profile_{name}.json"),
                seed=98, run_mark=run_mark, api_profile=True)
    for _ in range(60):
        new = sorted(set(glob.glob(server.api_profile + ".*[0-9]")) - before, key=os.path.getmtime)
        if new:
            break
        time.sleep(0.5)
    else:
        raise RuntimeError(f"{server.name}: no API-server profile written for {name} ({server.api_profile}.<k>)")
    kept = os.path.join(out, f"api_profile_{name}.prof")
    shutil.copy(new[-1], kept)
    return api_profile_summary(kept, res.get("total_output_tokens") or 0, res.get("completed") or 0)


def api_sample_run(out: str, server: Server, st: dict, sel, name: str, dataset_args, rate: str, n: int,
                   run_mark: int) -> dict:
    """One run of configuration ``name`` with its server's API server sampled by py-spy
    (``bench(..., api_sample_to=...)``): the raw stacks kept as ``<out>/api_sample_<name>.txt``
    and summarized per output token (:func:`api_sample.summary`).

    Raises:
        RuntimeError: py-spy is missing, could not attach, or wrote nothing."""
    path = os.path.join(out, f"api_sample_{name}.txt")
    res = bench(server, st, dataset_args, rate, n, sel, os.path.join(out, "runs", f"api_sample_{name}.json"),
                seed=97, run_mark=run_mark, api_sample_to=path)
    return api_sample.summary(path, api_sample.RATE_HZ, res.get("total_output_tokens") or 0, res.get("completed") or 0)


def profile_run(out: str, servers: dict, st: dict, config, name: str, dataset_args, rate: str, n: int,
                run_mark: int) -> None:
    """One ``vllm bench serve --profile`` run of configuration ``name``; keeps vLLM's per-kernel
    table as ``<out>/profile_<name>.txt`` and the trace's per-step summary as ``trace_<name>.json``."""
    import glob

    from . import profile as trace_tools

    srv, sel = config
    pdir = os.path.join(out, f"prof_{srv}")
    before = set(glob.glob(os.path.join(pdir, "*.pt.trace.json*")))
    bench(servers[srv], st, dataset_args, rate, n, sel, os.path.join(out, "runs", f"profile_{name}.json"), seed=99,
          run_mark=run_mark, profile=True)
    table = os.path.join(pdir, "profiler_out_0.txt")
    for _ in range(90):  # the worker writes the trace, then the table, when the profiler stops
        if os.path.exists(table):
            break
        time.sleep(2)
    kept = os.path.join(out, f"profile_{name}.txt")
    if os.path.exists(table):
        shutil.copy(table, kept)
        os.remove(table)
    new = sorted(set(glob.glob(os.path.join(pdir, "*.pt.trace.json*"))) - before, key=os.path.getmtime)
    summary = os.path.join(out, f"trace_{name}.json")
    if new:
        try:
            common.write_json(summary, trace_tools.summarize(new[-1]))
        except ValueError as e:
            print(f"profile {name}: {e}", flush=True)
    print(f"profile {name}: table {'kept' if os.path.exists(kept) else 'missing'}, "
          f"trace {'summarized' if os.path.exists(summary) else 'missing'}", flush=True)
