"""The benchmark tool's report: RESULTS.md's Current block generated from a latest.json.

No engine: a small latest.json written here, the real `report` subcommand run on it.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.xmix_bench import common, report, serve_configs, serve_rounds, serve_servers  # noqa: E402
from benchmarks.xmix_bench.__main__ import main  # noqa: E402

MODEL = "Llama-3.1-8B"
HISTORY = "## History\n\n### 2026-11-29: something measured (abc1234)\n\nA finding.\n"


def _stat(ratio, lo=None, hi=None, n=1):
    s = {"ratio": ratio, "n": n}
    if lo is not None:
        s.update(min=lo, max=hi)
    return s


def _entry(commit, date, **metrics):
    return {**metrics, "commit": commit, "date": date, "workload": "rate 16, 3 rounds", "command": "serve rounds ..."}


LATEST = {"models": {MODEL: {
    "serve": {
        "inactive": {"rate=16": _entry("c1", "2026-12-01", mean_itl=_stat(0.999), p99_itl=_stat(0.99),
                                       mean_ttft=_stat(1.002)),
                     "rate=inf": _entry("c0", "2026-11-30", throughput=_stat(1.0, 0.998, 1.001, 3))},
        "steer_all": {"rate=16": _entry("c1", "2026-12-01", mean_itl=_stat(1.04, 1.03, 1.05, 3),
                                        p99_itl=_stat(1.005, 0.98, 1.02, 3), mean_ttft=_stat(1.0, 0.99, 1.005, 3)),
                      "rate=inf": _entry("c0", "2026-11-30", throughput=_stat(0.99, 0.97, 1.01, 2))},
        "probe_one": {"rate=16": _entry("c1", "2026-12-01", mean_itl=_stat(1.005, 1.002, 1.008, 3),
                                        p99_itl=_stat(1.0, 0.995, 1.004, 3), mean_ttft=_stat(1.009, 1.0, 1.0095, 3))},
        "steer_all_K256": {"rate=inf": _entry("c0", "2026-11-30", throughput=_stat(0.97, 0.96, 0.975, 2))},
    },
    "decode": {"inactive": _entry("c0", "2026-11-30", batch={b: _stat(1.001, 0.999, 1.002, 4) for b in ("1", "8", "64")})},
    "startup": _entry("c1", "2026-12-01", plain_s=80.0, xmix_s=100.0, ratio=1.25),
}}}


def _files(tmp_path, latest=LATEST):
    lp, md = tmp_path / "latest.json", tmp_path / "RESULTS.md"
    lp.write_text(json.dumps(latest))
    md.write_text("# Benchmark results\n\n" + HISTORY)
    return str(lp), str(md)


def _run(lp, md, *extra) -> int:
    return main(["report", "--latest", lp, "--results-md", md, *extra])


def _row(text: str, config: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith("|") and f"| {config} |" in line]
    assert len(rows) == 1, (config, rows)
    return rows[0]


def test_block_has_a_row_per_configuration_and_marks_what_was_not_measured(tmp_path):
    lp, md = _files(tmp_path)
    assert _run(lp, md) == 0
    text = open(md).read()
    assert text.startswith("# Benchmark results\n\n## Current\n")
    assert text.rstrip().endswith(HISTORY.rstrip())  # the history below is kept as it was
    for _, configs, _, _ in report.BUDGETS:
        for cfg in configs:
            if cfg not in report.WHERE_MEASURED:
                _row(text, cfg)
    assert "| router_mask |" not in text  # (an MoE app: a row only where it was measured)
    assert text.count(f"### {MODEL}") == 1
    # measured: values with their range and a status against the bound
    steer = _row(text, "steer_all")
    assert "+4.0% [+3.0, +5.0]" in steer and "c1 2026-12-01; c0 2026-11-30" in steer
    # a missed metric does not hide the ones whose range straddles the bound
    assert "| missed: mean ITL; unresolved: P99 ITL, throughput; not measured: decode step |" in steer
    inactive = _row(text, "inactive")
    assert "-0.10%" in inactive and "+0.10 / +0.10 / +0.10%" in inactive and "| unresolved: mean ITL, P99 ITL, mean TTFT |" in inactive  # one round: never met
    assert "met; not measured: throughput, decode step" in _row(text, "probe_one")
    assert "missed: throughput" in _row(text, "steer_all_K256")
    # an entry that does not say which compile caches the servers started with: not judged
    assert "unresolved: 100 s vs 80 s (1.25x; compile caches not recorded)" in _row(text, "server start-up")
    # never measured: every cell of the row, and the graph-memory line
    ablate = _row(text, "ablate_all")
    assert ablate.count("not measured") == 6, ablate
    assert "| not measured | – |" in _row(text, "all_apps")
    assert "| not measured | – |" in _row(text, "CUDA-graph capture")
    assert "Qwen3-8B, Mixtral-8x7B: not measured." in text


def test_a_measurement_marked_not_comparable_gets_no_verdict(tmp_path):
    """An MoE model's row for router_mask shows once measured; a measurement marked
    ``not_comparable`` (an app that changes the model's work) says why instead of met/missed,
    and a ``note`` is added to its row's status."""
    moe = "Mixtral-8x7B"
    latest = {"models": {moe: {"serve": {
        "steer_all": {"rate=16": _entry("c2", "2026-12-07", mean_itl=_stat(0.66, 0.65, 0.67, 2),
                                        p99_itl=_stat(0.9, 0.8, 0.99, 2), mean_ttft=_stat(0.6, 0.3, 0.8, 2),
                                        not_comparable="the routing moved")},
        "router_mask": {"rate=16": _entry("c2", "2026-12-07", mean_itl=_stat(1.02, 1.015, 1.03, 2),
                                          p99_itl=_stat(0.99, 0.98, 0.995, 2), mean_ttft=_stat(0.99, 0.98, 0.995, 2),
                                          note="one expert fewer")},
    }}}}
    lp, md = _files(tmp_path, latest)
    assert _run(lp, md) == 0
    text = open(md).read()
    steer = _row(text, "steer_all")
    assert "| not comparable: the routing moved; not measured: throughput" not in steer  # (no verdict text at all)
    assert "| not comparable: the routing moved |" in steer and "met" not in steer.split("|")[-3], steer
    assert "-34.0% [-35.0, -33.0]" in steer  # the values are still shown
    mask = _row(text, "router_mask")
    assert "| missed: mean ITL; not measured: throughput, decode step; one expert fewer |" in mask, mask


@pytest.mark.parametrize("caches, status", [
    ({"plain": "cold", "xmix": "cold"}, "met: 100 s vs 80 s (1.25x, compile caches both cold)"),
    ({"plain": "warm", "xmix": "warm"}, "met: 100 s vs 80 s (1.25x, compile caches both warm)"),
    # the plain server compiled on a cold cache, the plugin's found what it had compiled
    ({"plain": "cold", "xmix": "shared"}, "unresolved: 100 s vs 80 s (1.25x; compile caches: plain cold, plugin shared)"),
    ({"plain": "cold", "xmix": "warm"}, "unresolved: 100 s vs 80 s (1.25x; compile caches: plain cold, plugin warm)"),
])
def test_start_up_is_judged_only_between_alike_compile_caches(tmp_path, caches, status):
    latest = json.loads(json.dumps(LATEST))
    latest["models"][MODEL]["startup"]["caches"] = caches
    lp, md = _files(tmp_path, latest)
    assert _run(lp, md) == 0
    assert f"| {status} |" in _row(open(md).read(), "server start-up")
    # over the bound with alike caches: missed
    latest["models"][MODEL]["startup"].update(caches=caches, xmix_s=130.0, ratio=1.625)
    lp, md = _files(tmp_path, latest)
    assert _run(lp, md) == 0
    row = _row(open(md).read(), "server start-up")
    assert ("missed: 130 s vs 80 s (1.62x" if caches["plain"] == caches["xmix"] else "unresolved: 130 s") in row, row


def test_report_is_idempotent_and_check_sees_a_stale_block(tmp_path):
    lp, md = _files(tmp_path)
    assert _run(lp, md) == 0
    first = open(md).read()
    assert _run(lp, md) == 0
    assert open(md).read() == first
    assert _run(lp, md, "--check") == 0
    data = json.loads(open(lp).read())
    data["models"][MODEL]["serve"]["seal"] = {"rate=16": _entry("c2", "2026-12-02", mean_itl=_stat(1.02),
                                                                p99_itl=_stat(1.0), mean_ttft=_stat(1.0))}
    open(lp, "w").write(json.dumps(data))
    assert _run(lp, md, "--check") == 1
    assert open(md).read() == first  # --check writes nothing
    assert _run(lp, md) == 0
    assert "missed: mean ITL" in _row(open(md).read(), "seal")


def test_merge_and_serving_runs_update_latest(tmp_path):
    lp, md = _files(tmp_path)
    # a serve folder's results.json: vanilla and inactive in 3 rounds, ratios paired by round
    runs = []
    for rnd, (van, ina) in enumerate(((5.0, 5.05), (5.2, 5.2), (5.1, 5.0)), start=1):
        for cfg, itl in (("vanilla", van), ("aa_plain", van), ("aa_empty", 1.02 * van), ("inactive", ina),
                         ("alt_inactive", 1.5 * ina)):
            runs.append({"rate": "16", "round": rnd, "config": cfg, "title": "llama31_8b, 400 prompts",
                         "commit": "c3", "date": "2026-12-03",
                         "result": {"mean_itl_ms": itl, "p99_itl_ms": 2 * itl, "mean_ttft_ms": 30.0,
                                    "total_token_throughput": 5000.0}})
    out = tmp_path / "serve-llama"
    out.mkdir()
    common.write_json(str(out / "results.json"), runs)
    assert main(["report", "--latest", lp, "--results-md", md, "--add-serve", str(out)]) == 0
    e = json.loads(open(lp).read())["models"][MODEL]["serve"]["inactive"]["rate=16"]
    assert e["mean_itl"] == {"ratio": 1.0, "min": round(5.0 / 5.1, 5), "max": 1.01, "n": 3}
    assert (e["commit"], e["date"]) == ("c3", "2026-12-03")
    model = json.loads(open(lp).read())["models"][MODEL]
    assert "aa_plain" not in model["serve"]  # calibration, no budget line
    # another graph-variant policy than the default's (start --alt-variants): no line of latest.json
    assert not any(c.startswith("alt_") for c in [*model["serve"], *model["calibration"]])
    cal = model["calibration"]["aa_plain"]["rate=16"]  # the A/A pair: identical values, ratio 1 every round
    assert cal["mean_itl"] == {"ratio": 1.0, "min": 1.0, "max": 1.0, "n": 3}
    row = _row(open(md).read(), "aa_plain")
    assert row.startswith(f"| {report.CALIBRATION} | aa_plain | +0.00% [+0.00, +0.00] |") and "no budget" in row
    # the plugin loaded with nothing deployed: a calibration row of its own, named as such
    row = _row(open(md).read(), "aa_empty")
    assert row.startswith(f"| {report.CALIBRATION_ROWS['aa_empty'][0]} | aa_empty | +2.0% [+2.0, +2.0] |"), row
    assert "patches alone" in row and "noise floor" not in row
    assert "3 interleaved rounds" in e["workload"]
    assert e["throughput"]["ratio"] == 1.0 and "rate=inf" in json.loads(open(lp).read())["models"][MODEL][
        "serve"]["inactive"]  # the saturation entry stays
    assert "c3 2026-12-03" in _row(open(md).read(), "inactive")
    # another latest.json (e.g. written on the GPU machine) replaces what it measured, nothing else
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"models": {MODEL: {"graph_memory": _entry("c4", "2026-12-04", plain_gib=1.0,
                                                                              xmix_gib=2.5)}}}))
    assert _run(lp, md, "--merge", str(other)) == 0
    merged = json.loads(open(lp).read())["models"][MODEL]
    assert merged["graph_memory"]["xmix_gib"] == 2.5 and merged["startup"]["xmix_s"] == 100.0
    assert "missed: 2.5 vs 1 GiB (+1.50 GiB)" in _row(open(md).read(), "CUDA-graph capture")
    assert serve_configs.configs_for(["steer_all", "router_mask"])["all_apps"] == ("xmix", ["steer_all"])
    # the A/A calibration: the second server (plain vLLM again, or the plugin with nothing deployed) alone
    assert serve_configs.configs_for([], "plain") == {"vanilla": ("vanilla", None), "aa_plain": ("xmix", None)}
    assert serve_configs.configs_for([], "empty") == {"vanilla": ("vanilla", None), "aa_empty": ("xmix", None)}
    # --control: a third server (plain vLLM) measured right after vanilla in every round
    assert list(serve_configs.configs_for(["steer_all"], control=True))[:3] == ["vanilla", "aa_plain", "inactive"]
    assert serve_configs.configs_for(["steer_all"], control=True)["aa_plain"] == ("control", None)
    assert "aa_plain" not in serve_configs.configs_for(["steer_all"])
    # --control plain,empty: also the plugin with nothing deployed, each on its own server
    both = serve_configs.configs_for(["steer_all"], control="empty,plain")
    assert list(both)[:4] == ["vanilla", "aa_plain", "aa_empty", "inactive"]
    assert both["aa_empty"] == ("control_empty", None) and both["aa_plain"] == ("control", None)
    assert (serve_configs.configs_for(["steer_all"], control="plain")
            == serve_configs.configs_for(["steer_all"], control=True))
    with pytest.raises(ValueError, match="unknown server kind"):
        serve_configs.configs_for(["steer_all"], control="plain,emtpy")
    # --alt-variants: the same deployment on a server with another graph-variant policy
    alt = serve_configs.configs_for(["steer_all", "probe_one"], alt="onoff")
    assert alt["alt_inactive"] == ("alt", None) and alt["alt_steer_all"] == ("alt", ["steer_all"])
    assert alt["steer_all"] == ("xmix", ["steer_all"]) and "alt_all_apps" not in alt
    assert not any(c.startswith("alt_") for c in serve_configs.configs_for(["steer_all"]))
    assert serve_configs.ALT_VARIANTS["onoff"] == {"VLLM_XMIX_GRAPH_VARIANTS": "onoff"}
    from vllm_xmix.runtime.variants import app_capture_size_setting, graph_variant_settings, piecewise_variant_setting

    for mode, env in serve_configs.ALT_VARIANTS.items():  # each mode's environment is one the runtime takes
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            assert (graph_variant_settings()[0], piecewise_variant_setting(), app_capture_size_setting()) == {
                "onoff": ("onoff", "apps", None), "pieces": ("apps", "onoff", None), "pieces64": ("apps", "onoff", 64),
                "none": ("0", "apps", None)}[mode]
    with pytest.raises(SystemExit):
        main(["serve", "start", "--out", str(tmp_path / "x"), "--model", "m", "--alt-variants", "onof"])
    # rounds run A B C, C B A, ... (abba) so that a run's position in its round cancels over pairs
    assert [serve_rounds.round_order(["a", "b", "c"], k) for k in range(3)] == [["a", "b", "c"], ["c", "b", "a"],
                                                                                 ["a", "b", "c"]]
    assert serve_rounds.round_order(["a", "b"], 1, "fixed") == ["a", "b"]
    # --configs sets the order after vanilla (a witness such as aa_plain can sit mid-round)
    known = serve_configs.configs_for(["steer_all", "cast"], control=True)
    assert list(serve_configs.selected_configs(known, "cast,aa_plain,steer_all,cast,vanilla")) == [
        "vanilla", "cast", "aa_plain", "steer_all"]
    assert list(serve_configs.selected_configs(known, "steer_all")) == ["vanilla", "steer_all"]


def test_server_log_yields_the_capture_and_each_graph_variants_cost(tmp_path, caplog):
    """serve start reads vLLM's capture line and the plugin's per-variant capture lines from a
    server log; the plugin writes the latter with ``_vllm_compat.graph_capture``'s logger."""
    import logging

    from vllm_xmix._vllm_compat.graph_capture import _log_variant_costs

    costs = [{"mask": "0x0", "s": 5.2, "graphs": 2278, "gib": 0.412, "pool_gib": 0.031, "driver_gib": 0.381},
             {"mask": "0x1f", "s": 7.0, "graphs": 2278, "gib": -0.01, "pool_gib": 0.0, "driver_gib": -0.01}]
    with caplog.at_level(logging.INFO, logger="vllm.xmix"):
        _log_variant_costs(costs)
    log = tmp_path / "xmix.log"
    log.write_text("".join(f"INFO 12-03 10:00:00 [graph_capture.py:1] {r.getMessage()}\n" for r in caplog.records)
                   + "INFO 12-03 10:00:01 [model_runner.py:748] Graph capturing finished in 49 secs, took 3.43 GiB\n")
    got = serve_servers.graph_capture(str(log))
    assert got["graph_s"] == 49.0 and got["graph_gib"] == 3.43
    assert got["variants"] == costs
    plain = tmp_path / "vanilla.log"
    plain.write_text("INFO Graph capturing finished in 6 secs, took 0.98 GiB\n")
    assert serve_servers.graph_capture(str(plain)) == {"graph_s": 6.0, "graph_gib": 0.98}


def test_a_single_round_inside_the_bound_is_unresolved_not_met():
    """One round has no spread: inside the bound it is unresolved; outside it is still missed."""
    one_in = {"ratio": 1.004, "min": 1.004, "max": 1.004, "n": 1}
    one_out = {"ratio": 1.03, "min": 1.03, "max": 1.03, "n": 1}
    three_in = {"ratio": 1.004, "min": 1.001, "max": 1.008, "n": 3}
    assert report.judge(one_in, 1.0, False) == "unsure"
    assert report.judge(one_out, 1.0, False) == "fail"
    assert report.judge(three_in, 1.0, False) == "ok"
    assert report.judge({"ratio": 0.999, "min": 0.999, "max": 0.999, "n": 1}, 1.0, True) == "unsure"


def test_checkpoint_writes_the_same_weights_for_a_seed_and_loads_in_transformers(tmp_path):
    """``checkpoint`` (the same weights for TP=1 and TP=2 engines): a seed gives the same tensors,
    another seed others, ``--layers`` keeps the first N layers; transformers loads the folder."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    cfg = common.write_model_config(str(tmp_path / "cfg"), layers=3)
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        assert main(["checkpoint", "--model", cfg, "--out", str(tmp_path / name), "--dtype", "float32",
                     "--seed", str(seed), "--layers", "2"]) == 0
    a, b, c = (load_file(str(tmp_path / n / "model.safetensors")) for n in "abc")
    assert set(a) == set(b) and all((a[k] == b[k]).all() for k in a)
    assert any(not (a[k] == c[k]).all() for k in a if k.endswith("proj.weight"))
    assert {k.split(".")[2] for k in a if k.startswith("model.layers.")} == {"0", "1"}
    m = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"))
    assert m.config.num_hidden_layers == 2


def test_hooks_check_compare_names_what_ran_and_takes_a_plain_file(tmp_path, capsys):
    """``hooks-check --compare`` of a plugin file against a TP=2 file and against a ``--plain``
    one (no-app tokens only): counts per app, labels from the files, nothing else compared."""
    from benchmarks.xmix_bench import hooks_check

    t = {"none": [[1, 2], [3, 4]], "add": [[1, 5], [3, 4]], "probe": [[1, 2], [3, 4]]}
    a = {"eager": False, "tp": 1, "tokens": t, "reads": {"probe": [{"p": [0.5, 1.0]}, {"p": [1.0]}]}}
    b = {"eager": False, "tp": 2, "tokens": {"none": [[1, 2], [3, 4]], "add": [[1, 5], [3, 9]],
                                             "probe": [[1, 2], [3, 4]]},
         "reads": {"probe": [{"p": [0.5, 1.1]}, {"p": [1.0]}]}}
    plain = {"eager": False, "tp": 2, "plain": True, "tokens": {"none": [[1, 2], [3, 7]]},
             "logprobs_none": [[-0.5, -0.25], [-1.0, -2.0]]}
    a["logprobs_none"] = [[-0.5, -0.2500001], [-1.0, -9.0]]  # the second request's tokens differ: not compared
    for n, r in (("a", a), ("b", b), ("p", plain)):
        (tmp_path / f"{n}.json").write_text(json.dumps(r))
    hooks_check.compare(str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    out = capsys.readouterr().out
    assert "add                  graphs==graphs-tp2 1/2   changed vs no-app 1/2" in out
    assert "probe                reads graphs vs graphs-tp2: 3 values, max rel err 0.0909" in out
    hooks_check.compare(str(tmp_path / "a.json"), str(tmp_path / "p.json"))
    out = capsys.readouterr().out
    assert "none                 graphs==plain-graphs-tp2 1/2" in out and "add " not in out
    assert "logprobs graphs vs plain-graphs-tp2: bit-identical 0/1 requests with equal tokens, max |diff| 1e-07" in out
    # a file kept compressed reads the same; a missing one is named, not an AttributeError
    import gzip

    with gzip.open(tmp_path / "b.json.gz", "wt") as f:
        f.write(json.dumps(b))
    hooks_check.compare(str(tmp_path / "a.json"), str(tmp_path / "b.json.gz"))
    assert "add                  graphs==graphs-tp2 1/2" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="no result file .*missing.json"):
        hooks_check.compare(str(tmp_path / "a.json"), str(tmp_path / "missing.json"))


def test_serving_timeline_counts_the_gaps_in_which_no_request_got_a_token():
    """The per-run timeline of the serving A/B: gaps of >= 20 ms between consecutive streamed
    tokens of all requests count as stalls only while some request was in flight (worked out by
    hand: tokens at 20, 25, 30, 40, 45, 95, 130, 510, 515 ms; the 380 ms gap has no request
    in flight)."""
    from benchmarks.xmix_bench.serve_rounds import timeline

    res = {"start_times": [0.0, 0.01, 0.5], "ttfts": [0.02, 0.03, 0.01],
           "itls": [[0.005, 0.005, 0.1], [0.005, 0.05], [0.005]]}
    tl = timeline(res)
    assert (tl["stalls"], tl["stall_total_ms"], tl["stall_max_ms"]) == (2, 85.0, 50.0)
    assert tl["ttft_pct_ms"]["p50"] == 20.0 and tl["ttfts_ms"] == [20.0, 30.0, 10.0]
    assert timeline({"start_times": [], "ttfts": [], "itls": []}) == {}
    assert "chunks_per_output_token" not in tl  # (no output_lens: not counted)
    # chunks: 4 + 3 + 2 = 9 for 4 + 6 + 2 = 12 output tokens (the second stream merged outputs)
    res["output_lens"] = [4, 6, 2]
    assert timeline(res)["chunks_per_output_token"] == 0.75


def test_steps_pairs_each_requests_ttft_with_the_first_configuration():
    """`steps` sends every configuration of a round the same arrivals: a request's TTFT minus its
    TTFT under the first configuration, median over requests, per round; requests without a
    first token on either side are left out."""
    from benchmarks.xmix_bench.steps import _pair_ttfts, summary

    per = {"inactive": [{"ttfts_ms": [10.0, 20.0, 30.0, 40.0]}, {"ttfts_ms": [5.0, 5.0, 5.0]}],
           "ablate_all": [{"ttfts_ms": [12.0, 25.0, 29.0, None]}, {"ttfts_ms": [6.0, 9.0, 5.5]}]}
    _pair_ttfts(per, "inactive")
    assert [r["ttft_paired_ms"] for r in per["inactive"]] == [0.0, 0.0]
    assert [r["ttft_paired_ms"] for r in per["ablate_all"]] == [2.0, 1.0]  # medians of (2, 5, -1) and (1, 4, 0.5)
    runs = [{**r, "steps": {}} for r in per["ablate_all"]]
    assert summary(runs)["ttft_paired_ms"] == 1.5


def test_a_measurement_on_another_card_is_named_where_it_is_shown(tmp_path, capsys):
    """Ratios are to plain vLLM on the same card, and the table says which card where it is not
    the default one: in the row's last column and in its "Measured with" line; --merge --card
    stamps the merged measurements that name none, and leaves those that do."""
    lp, md = _files(tmp_path)
    assert _run(lp, md) == 0
    assert "H100" not in open(md).read()  # the default card is not named
    other = tmp_path / "h100.json"
    other.write_text(json.dumps({"models": {MODEL: {
        "serve": {"steer_all": {"rate=16": _entry("c9", "2026-12-06", mean_itl=_stat(1.003, 1.001, 1.005, 2),
                                                  p99_itl=_stat(0.97, 0.95, 0.98, 2),
                                                  mean_ttft=_stat(0.98, 0.96, 0.99, 2))}},
        "startup": {**_entry("c9", "2026-12-06", plain_s=124.0, xmix_s=142.0, ratio=1.145), "card": "H200"}}}}))
    assert _run(lp, md, "--merge", str(other), "--card", "H100") == 0
    model = json.loads(open(lp).read())["models"][MODEL]
    assert model["serve"]["steer_all"]["rate=16"]["card"] == "H100"
    assert model["startup"]["card"] == "H200"  # named already: kept
    assert "card" not in model["serve"]["inactive"]["rate=16"]  # not merged: untouched
    text = open(md).read()
    row = _row(text, "steer_all")
    assert row.startswith("| Each app on every request") and "| +0.30% [+0.10, +0.50] |" in row
    assert row.endswith("| c9 2026-12-06 H100; c0 2026-11-30 |"), row  # latency on the H100, throughput not
    assert "- c9, 2026-12-06, H100 (latency (rate 16): steer_all): rate 16, 3 rounds." in text
    assert _row(text, "server start-up").endswith("| c9 2026-12-06 |")
    # a serve folder's runs added with the card they ran on
    out = tmp_path / "serve-h100"
    out.mkdir()
    common.write_json(str(out / "results.json"), [
        {"rate": "16", "round": 1, "config": c, "title": "llama31_8b, 400 prompts", "commit": "c9", "date": "2026-12-06",
         "result": {"mean_itl_ms": itl, "p99_itl_ms": 10.0, "mean_ttft_ms": 30.0, "total_token_throughput": 5e3}}
        for c, itl in (("vanilla", 7.0), ("cast", 7.175))])
    assert _run(lp, md, "--add-serve", str(out), "--card", "H100") == 0
    assert json.loads(open(lp).read())["models"][MODEL]["serve"]["cast"]["rate=16"]["card"] == "H100"
    assert _row(open(md).read(), "cast").endswith("| c9 2026-12-06 H100 |")
    # an option that would do nothing is refused, not ignored
    before = (open(lp).read(), open(md).read())
    for extra, named in ((["--card", "H100"], "--card"), (["--commit", "c9"], "--commit"), (["--source", "x"], "--source")):
        with pytest.raises(SystemExit):
            _run(lp, md, *extra)
        assert f"{named}: only with --add-serve" in capsys.readouterr().err
    assert (open(lp).read(), open(md).read()) == before
    # --add-serve without --card: the card the folder's servers.json names (serve start records it)
    common.write_json(str(out / "servers.json"), {"card": "H200"})
    assert _run(lp, md, "--add-serve", str(out)) == 0
    assert json.loads(open(lp).read())["models"][MODEL]["serve"]["cast"]["rate=16"]["card"] == "H200"
    # serve rounds and serve start record the card nvidia-smi names, in short
    assert [common.card_name(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "Tesla T4 ", "NVIDIA A100-SXM4-80GB",
                                          "NVIDIA GeForce RTX 4090", "Some GPU")] == [
        "H100", "H200", "T4", "A100", "GeForce RTX 4090", "Some GPU"]


def test_decode_compare_carries_the_card_into_latest(tmp_path):
    """decode --compare writes the decode ratios with the card the plugin's run recorded (a run
    records nvidia-smi's card), or --card for files that record none; none without either."""
    from types import SimpleNamespace as NS

    from benchmarks.xmix_bench import decode

    def run_file(name, mode, ms, card=None):
        d = {"mode": mode, "eager": False, "startup_s": 1.0, "v2_runner": True, "cudagraph_mode": "FULL_AND_PIECEWISE",
             "compile_mode": "3", "model": MODEL, "commit": "c7", "date": "2026-12-06", "command": "decode ...",
             "tokens_off": [[1, 2]], "tokens_off_after_on": [[1, 2]], "tokens_on": [[1, 3]],
             "decode_ms_per_step": {"1": {("plain" if mode == "plain" else "steer_all"): {"median": ms, "runs": [ms]}}}}
        if card:
            d["card"] = card
        p = tmp_path / name
        p.write_text(json.dumps(d))
        return str(p)

    def args(latest, card=None):
        return NS(no_latest=False, latest=str(latest), model_name=None, commit=None, date=None, command=None,
                  source="", card=card)

    plain = run_file("plain.json", "plain", 5.0)
    for x_card, opt, want in (("H100", None, "H100"), (None, "H100", "H100"), ("H100", "A100", "A100"), (None, None, None)):
        latest = tmp_path / f"latest-{x_card}-{opt}.json"
        x = run_file(f"x-{x_card}.json", "xmix", 5.1, card=x_card)
        out = decode.compare([plain, x], args(latest, opt))
        assert "decode lines of Llama-3.1-8B for steer_all" in out, out
        entry = json.loads(latest.read_text())["models"][MODEL]["decode"]["steer_all"]
        assert entry.get("card") == want and entry["batch"]["1"]["ratio"] == pytest.approx(1.02), entry


def test_a_round_whose_vanilla_metric_is_zero_gives_that_metric_no_ratio():
    """A tiny run can get every request's tokens in one chunk (mean ITL 0): that round gives
    the metric no ratio (no division by 0), the other rounds still do, and a metric with none
    left is omitted, which the report shows as not measured."""
    def run(itl, ttft):
        return {"result": {"mean_itl_ms": itl, "p99_itl_ms": itl, "mean_ttft_ms": ttft, "total_token_throughput": 100.0}}

    by = {"vanilla": {1: run(0.0, 10.0), 2: run(2.0, 10.0)}, "steer_all": {1: run(1.0, 11.0), 2: run(3.0, 12.0)}}
    got = common.serve_ratios(by)["steer_all"]
    assert got["mean_itl"] == {"ratio": 1.5, "min": 1.5, "max": 1.5, "n": 1}
    assert got["mean_ttft"]["n"] == 2 and got["mean_ttft"]["ratio"] == 1.15 and got["rounds"] == 2
    by["vanilla"][2] = run(0.0, 10.0)
    got = common.serve_ratios(by)["steer_all"]
    assert "mean_itl" not in got and "p99_itl" not in got and got["throughput"]["ratio"] == 1.0
