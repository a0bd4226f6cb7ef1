"""itl-tail (benchmarks/xmix_bench/itl_tail.py): the steps' P99 and the swaps on recorded step rows
built here, where every gap and its weight is known."""

import gzip
import json

import numpy as np
import pytest

from benchmarks.xmix_bench import itl_tail
from benchmarks.xmix_bench.engine_steps import save_rows


def _rows(gaps, tokens, reqs):
    """Step rows (t0, t1, t2, t3 in s, tokens, requests) whose consecutive outputs lie ``gaps`` ms
    apart (t3 of each step), schedule() taking 0.2 ms, update 0.1 ms."""
    t3 = np.cumsum(np.r_[5.0, gaps]) / 1e3
    rows = np.stack([t3 - 0.004, t3 - 0.0038, t3 - 0.0001, t3, np.r_[8, tokens], np.r_[8, reqs]], axis=1)
    return rows[1:], rows[0]


def _workload(pre_extra: float = 0.0):
    """Decode steps of 8 requests at 6 ms, a mixed step of 300 tokens (a new request: 9) every 10th
    step at 15 ms; ``pre_extra`` ms added to each gap before a mixed step."""
    gaps, tokens, reqs = [], [], []
    n = 8
    for k in range(200):
        if k % 10 == 9:
            n += 1
            gaps.append(15.0); tokens.append(300 + n - 1); reqs.append(n)
        else:
            gaps.append(6.0 + (pre_extra if k % 10 == 8 else 0.0) + 0.01 * (k % 7)); tokens.append(n); reqs.append(n)
    return np.array(gaps), np.array(tokens, float), np.array(reqs, float)


def _save(path, gaps, tokens, reqs):
    rows, prev = _rows(gaps, tokens, reqs)
    save_rows(str(path), [(rows, prev)], ["steps.1.bin"])


def _expected_p99(gaps, tokens, reqs):
    """The weighted 99th percentile written out: each gap repeated once per inter-token sample it
    makes (a mixed step's new request makes none), the first gap left out."""
    reqs_prev = np.r_[reqs[0], reqs[:-1]]
    mixed = tokens > reqs
    w = np.where(mixed, reqs - np.maximum(1, reqs - reqs_prev), reqs).astype(int)
    samples = np.repeat(gaps[1:], w[1:])
    return float(np.percentile(samples, 99, method="inverted_cdf"))


def test_steps_p99_is_the_weighted_percentile_of_the_gaps(tmp_path):
    g, t, r = _workload()
    _save(tmp_path / "a.npz", g, t, r)
    s = itl_tail.load_steps(str(tmp_path / "a.npz"))
    np.testing.assert_allclose(s["gap"][1:], g[1:], atol=1e-6)
    assert s["mixed"].sum() == 20 and itl_tail._near(s, "pre").sum() == 20
    assert itl_tail.steps_p99(s) == pytest.approx(_expected_p99(g, t, r), abs=1e-6)


def test_swapping_the_base_gaps_before_mixed_steps_gives_the_base_p99(tmp_path):
    g, t, r = _workload()
    gx, _, _ = _workload(pre_extra=12.0)  # the gaps before mixed steps 12 ms longer, nothing else
    _save(tmp_path / "b.npz", g, t, r)
    _save(tmp_path / "c.npz", gx, t, r)
    b, c = itl_tail.load_steps(str(tmp_path / "b.npz")), itl_tail.load_steps(str(tmp_path / "c.npz"))
    p99 = itl_tail.steps_p99(c)
    assert p99 == pytest.approx(_expected_p99(gx, t, r), abs=1e-6) and 18.0 <= p99 <= 18.07  # a pre gap: 6 + 12 + jitter
    assert itl_tail.steps_p99(c) > itl_tail.steps_p99(b)
    assert itl_tail.steps_p99(c, b, "pre") == pytest.approx(itl_tail.steps_p99(b), abs=1e-9)
    assert itl_tail.steps_p99(c, b, "own") == pytest.approx(itl_tail.steps_p99(c), abs=1e-9)


def test_analyse_a_serving_folder(tmp_path):
    g, t, r = _workload()
    gx, _, _ = _workload(pre_extra=12.0)
    (tmp_path / "runs").mkdir()
    runs = []
    for cfg, gaps in (("vanilla", g), ("steer_all", gx)):
        _save(tmp_path / "runs" / f"{cfg}_r16_1_steps.npz", gaps, t, r)
        runs.append({"config": cfg, "round": 1, "rate": "16", "commit": "abc1234",
                     "result": {"mean_itl_ms": 7.0, "p99_itl_ms": 15.5, "mean_ttft_ms": 30.0}})
    with gzip.open(tmp_path / "results.json.gz", "wt") as f:
        json.dump(runs, f)
    a = itl_tail.analyse(str(tmp_path))
    assert a["commit"] == "abc1234"
    c = a["vs_base"]["steer_all"]["1"]
    mine, base = c["samples_above_base_p99"]
    # every gap before a mixed step above 15.5 ms, each with its decode step's 8 .. 27 requests
    assert mine["pre"] == sum(range(8, 28)) and base["pre"] == 0
    assert c["bins"]["257-512"]["n"] == [20, 20]
    assert c["bins"]["257-512"]["pair_median"][0] == pytest.approx(c["bins"]["257-512"]["pair_median"][1] + 12.0, abs=0.02)
    # every mixed step has 300-330 tokens: swapping that bin's gaps gives plain vLLM's P99, the other bins' nothing
    p99_base, p99_cfg = (a["runs"][k]["1"]["steps"]["steps_p99"] for k in ("vanilla", "steer_all"))
    assert c["bins"]["257-512"]["swap_p99"]["pre"] == pytest.approx(p99_base, abs=1e-9)
    assert c["bins"]["1-256"]["swap_p99"]["both"] == pytest.approx(p99_cfg, abs=1e-9) and p99_cfg > p99_base + 2
    lo, hi = c["bins"]["257-512"]["pair_ratio_ci95"]  # every pair 12 ms longer: (21 + 12) / 21 or so
    assert 0.5 < lo <= hi < 0.65
    assert "steer_all 1" in itl_tail.table(a)


def test_a_round_without_the_base_run_is_an_error(tmp_path):
    g, t, r = _workload()
    (tmp_path / "runs").mkdir()
    _save(tmp_path / "runs" / "cast_r16_1_steps.npz", g, t, r)
    (tmp_path / "results.json").write_text(json.dumps([{"config": "cast", "round": 1, "rate": "16", "commit": "x",
                                                         "result": {"p99_itl_ms": 1.0}}]))
    with pytest.raises(ValueError, match="not vanilla's"):
        itl_tail.analyse(str(tmp_path))


def test_the_command_names_a_folder_without_results(tmp_path, capsys):
    from benchmarks.xmix_bench.__main__ import main

    assert main(["itl-tail", str(tmp_path)]) == 2
    assert "no results.json" in capsys.readouterr().err
    assert main(["itl-tail", str(tmp_path / "missing")]) == 2
    assert "missing: no such folder" in capsys.readouterr().err
