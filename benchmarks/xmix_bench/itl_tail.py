"""itl-tail: where a served run's P99 inter-token latency comes from, read from the engine steps
its server recorded (``serve start --record-steps``), against plain vLLM's run of the same round.

Input: a serving folder of ``serve rounds`` (its ``results.json`` or ``results.json.gz``, and
``runs/<config>_r<rate>_<round>_steps.npz``, the rows of :func:`.engine_steps.save_rows`: per
engine step ``t0, t1`` before / after ``Scheduler.schedule()``, ``t2, t3`` before / after
``update_from_output()`` in ms, then the step's tokens and requests).

Terms (ms):

* ``gap(k) = t3(k) - t3(k-1)``: the time between two consecutive steps' outputs, the engine's
  inter-token interval of every request in both steps;
* a *mixed* step carries prompt tokens (tokens > requests); its *own* gap is ``gap(k)``, its *pre*
  gap ``gap(k-1)``: under async scheduling step ``k`` is launched before step ``k-1``'s output is
  processed, so a slow launch of a mixed step shows in the gap before it;
  ``launch(k) = t2(k-1) - t1(k)``: how long step ``k``'s launch (or the wait for step ``k-1``'s
  device work) held the previous output back; a *slow* launch: more than ``--slow-ms``;
* the *steps' P99*: the 99th percentile of the gaps, each weighted by the inter-token samples it
  makes (the step's requests, less those that get their first token in it). It leaves out the
  API server's and the client's part of the client's inter-token latency: where it tracks the
  recorded P99, the tail is the engine's.
* *swap*: the steps' P99 of a configuration's run with its gaps next to mixed steps (``pre``,
  ``own`` or both; all mixed steps, or those of one token bin) replaced by plain vLLM's of the
  same round: how much of the P99 excess those gaps carry.

Per run: the recorded mean ITL, P99 ITL and mean TTFT, the count and median period of decode and
mixed steps, the long steps (period above twice the decode median: count, summed period), the
median host time of ``schedule()`` in decode steps, the share of slow launches among mixed steps
of up to 512 tokens (the largest CUDA graph) and their median launch, and the steps' P99. Per configuration and round
against plain vLLM: mixed steps by token count (pre + own gap, median), the swaps, and the
inter-token samples above plain vLLM's recorded P99 in pre gaps, own gaps and the rest.
A bin's pre + own gap carries a 95% bootstrap interval of its ratio to plain vLLM's: what a
difference of medians there resolves.
Printed, and written to ``--out`` (JSON) when given.
"""

from __future__ import annotations

import gzip
import json
import os

from .engine_steps import GRAPH_TOKENS, step_periods

HELP = "a served run's P99 ITL from its recorded engine steps: which gaps set it, against plain vLLM's run"

#: token-count bins of mixed steps (the largest CUDA graph: vLLM's default 512 tokens)
BINS = ((1, GRAPH_TOKENS // 2), (GRAPH_TOKENS // 2 + 1, GRAPH_TOKENS), (GRAPH_TOKENS + 1, None))
#: resamples of a bin's ratio of medians (its 95% interval: ``pair_ratio_ci95``)
BOOTSTRAP = 1000


def add_arguments(p) -> None:
    p.add_argument("serve_dir", metavar="SERVE_DIR",
                   help="a serving folder: results.json(.gz) and runs/*_steps.npz (serve start --record-steps)")
    p.add_argument("--rate", default="16", help="the request rate of the runs, as results.json names it (default: 16)")
    p.add_argument("--commit", default=None, help="only runs of this commit (default: the newest run's)")
    p.add_argument("--base", default="vanilla", help="the configuration compared against (default: vanilla, plain vLLM)")
    p.add_argument("--configs", default=None, help="comma-separated configurations (default: all with steps)")
    p.add_argument("--slow-ms", type=float, default=10.0, help="a launch that held the previous output back longer (ms) is slow (default: 10)")
    p.add_argument("--out", default=None, help="JSON file to write")


def load_steps(path: str) -> dict:
    """One run's recorded steps as arrays (numpy float64, ms): ``gap``, ``period``
    (:func:`.engine_steps.step_periods`), ``launch`` (NaN where undefined), ``tokens``,
    ``requests``, ``w`` (inter-token samples per gap), the masks ``decode`` and ``mixed``, and
    the ``schedule`` host time per step.

    Raises:
        ValueError: the file holds no engine's rows, or several engines' (data parallelism:
            gaps are per engine and are not merged here)."""
    import numpy as np

    z = np.load(path)
    engines = sorted(k for k in z.files if k.startswith("e") and not k.endswith("_prev"))
    if engines != ["e0"]:
        raise ValueError(f"{path}: one engine's steps expected, found {engines or 'none'}")
    a, prev = z["e0"], z["e0_prev"][0]
    if not len(a):
        raise ValueError(f"{path}: no steps")
    prev_t3 = np.r_[prev[3], a[:-1, 3]]
    gap = a[:, 3] - prev_t3
    gap[0] = np.nan  # (the step before the run is the server's ready check's)
    tokens, reqs = a[:, 4], a[:, 5]
    busy = tokens > 0
    mixed, decode = busy & (tokens > reqs), busy & (tokens == reqs)
    # requests that get their first token in a mixed step make no inter-token sample there
    new = np.where(mixed, np.maximum(1, reqs - np.r_[reqs[0], reqs[:-1]]), 0)
    w = np.where(busy, np.maximum(reqs - new, 0), 0).astype(float)
    w[0] = 0.0
    return {"gap": gap, "period": step_periods(a, prev_t3),
            "launch": np.r_[np.nan, a[:-1, 2] - a[1:, 1]], "tokens": tokens, "requests": reqs, "w": w,
            "decode": decode, "mixed": mixed, "schedule": a[:, 1] - a[:, 0]}


def weighted_percentile(x, w, q: float) -> float:
    """The smallest ``x`` at which the cumulative weight reaches ``q`` percent of the total
    (``x``, ``w``: 1-D arrays of equal length, ``w`` >= 0 with a positive sum)."""
    import numpy as np

    o = np.argsort(x, kind="stable")
    x, c = np.asarray(x)[o], np.cumsum(np.asarray(w, dtype=float)[o])
    return float(x[min(np.searchsorted(c, q / 100.0 * c[-1]), len(x) - 1)])


def _near(s: dict, part: str, tokens: tuple | None = None):
    """The gaps of kind ``part`` (``pre``, ``own``, ``both``) next to mixed steps, of the mixed
    steps whose token count lies in ``tokens`` (``(lo, hi)``, ``hi`` None: no bound) only if given."""
    import numpy as np

    m = s["mixed"]
    if tokens is not None:
        lo, hi = tokens
        m = m & (s["tokens"] >= lo) & (s["tokens"] <= (hi or np.inf))
    pre = np.r_[m[1:], False] & ~s["mixed"]
    return {"pre": pre, "own": m, "both": pre | m}[part]


def steps_p99(s: dict, base: dict | None = None, part: str | None = None, tokens: tuple | None = None) -> float:
    """The steps' P99 of run ``s`` (:func:`load_steps`); with ``base`` and ``part`` (``pre``,
    ``own``, ``both``) the gaps of that kind replaced by ``base``'s (the swap), with ``tokens``
    (``(lo, hi)``) only those next to mixed steps of that many tokens."""
    import numpy as np

    ok = ~np.isnan(s["gap"]) & (s["w"] > 0)
    if base is None:
        return weighted_percentile(s["gap"][ok], s["w"][ok], 99)
    keep = ok & ~_near(s, part, tokens)
    okb = ~np.isnan(base["gap"]) & (base["w"] > 0) & _near(base, part, tokens)
    return weighted_percentile(np.r_[s["gap"][keep], base["gap"][okb]], np.r_[s["w"][keep], base["w"][okb]], 99)


def run_row(s: dict, slow_ms: float) -> dict:
    """Per-run figures (the module docstring's list), ms."""
    import numpy as np

    p, d, m = s["period"], s["decode"], s["mixed"]
    dmed = float(np.median(p[d]))
    long = (d | m) & (p > 2 * dmed)
    small = m & (s["tokens"] <= GRAPH_TOKENS) & ~np.isnan(s["launch"])
    return {"decode_n": int(d.sum()), "decode_period_median": dmed, "mixed_n": int(m.sum()),
            "mixed_gt512_n": int((m & (s["tokens"] > GRAPH_TOKENS)).sum()),
            "mixed_period_median": float(np.median(p[m])) if m.any() else None,
            "long_n": int(long.sum()), "long_period_sum": float(p[long].sum()),
            "schedule_decode_median": float(np.median(s["schedule"][d])),
            "slow_launch_share": float(np.mean(s["launch"][small] > slow_ms)) if small.any() else None,
            "slow_launch_median": (float(np.median(s["launch"][small][s["launch"][small] > slow_ms]))
                                   if (s["launch"][small] > slow_ms).any() else None),
            "steps_p99": steps_p99(s)}


def compare(s: dict, b: dict, base_p99: float) -> dict:
    """Run ``s`` against plain vLLM's run ``b`` of the same round: pre + own gap of mixed steps
    per token bin (median, count, the 95% bootstrap interval of the ratio of the medians less 1,
    from bins of at least 10 steps each, and the swaps of that bin's gaps alone), the swaps, and inter-token samples above ``base_p99``
    (plain vLLM's recorded P99) per kind of gap, for both runs."""
    import numpy as np

    bins = {}
    rng = np.random.default_rng(0)
    for lo, hi in BINS:
        pairs = []
        for r in (s, b):
            k = np.flatnonzero(r["mixed"] & (r["tokens"] >= lo) & (r["tokens"] <= (hi or np.inf)))
            k = k[k >= 2]
            pairs.append(r["gap"][k - 1] + r["gap"][k])
        ci = None
        if min(len(pairs[0]), len(pairs[1])) >= 10:  # the ratio of medians, resampled: what the bin resolves
            ratios = [np.median(rng.choice(pairs[0], len(pairs[0]))) / np.median(rng.choice(pairs[1], len(pairs[1])))
                      for _ in range(BOOTSTRAP)]
            ci = [float(x) - 1.0 for x in np.percentile(ratios, [2.5, 97.5])]
        bins[f"{lo}-{hi or ''}"] = {"n": [len(pairs[0]), len(pairs[1])],
                                    "pair_median": [float(np.median(x)) if len(x) else None for x in pairs],
                                    "pair_ratio_ci95": ci,
                                    "swap_p99": {part: steps_p99(s, b, part, (lo, hi)) for part in ("pre", "own", "both")}}

    def above(r):
        big = ~np.isnan(r["gap"]) & (r["gap"] > base_p99) & (r["w"] > 0)
        return {kind: float(r["w"][big & sel].sum()) for kind, sel in
                (("pre", _near(r, "pre")), ("own", r["mixed"]), ("other", ~_near(r, "both")))}

    return {"bins": bins, "swap_p99": {part: steps_p99(s, b, part) for part in ("pre", "own", "both")},
            "samples_above_base_p99": [above(s), above(b)]}


def _results(serve_dir: str) -> list[dict]:
    if not os.path.isdir(serve_dir):
        raise FileNotFoundError(f"{serve_dir}: no such folder")
    for name in ("results.json", "results.json.gz"):
        path = os.path.join(serve_dir, name)
        if os.path.exists(path):
            with (gzip.open(path, "rt") if name.endswith(".gz") else open(path)) as f:
                return json.load(f)
    raise FileNotFoundError(f"{serve_dir}: no results.json or results.json.gz")


def analyse(serve_dir: str, rate: str = "16", commit: str | None = None, base: str = "vanilla",
            configs: list[str] | None = None, slow_ms: float = 10.0) -> dict:
    """``{"commit", "rate", "runs": {config: {round: {"result", "steps"}}}, "vs_base": {config:
    {round: compare(...)}}}`` for the runs of ``serve_dir`` that have recorded steps.

    Raises:
        FileNotFoundError: no such folder, or no results file in it.
        ValueError: no run with recorded steps, or no ``base`` run in a round that has others."""
    runs = [r for r in _results(serve_dir) if str(r.get("rate")) == str(rate) and r.get("round") != "warmup"]
    commit = commit or (runs[-1]["commit"] if runs else None)
    out: dict = {"commit": commit, "rate": rate, "runs": {}, "vs_base": {}}
    loaded = {}
    for r in runs:
        if r.get("commit") != commit or (configs and r["config"] not in configs + [base]):
            continue
        path = os.path.join(serve_dir, "runs", f"{r['config']}_r{rate}_{r['round']}_steps.npz")
        if not os.path.exists(path):
            continue
        s = loaded[(r["config"], r["round"])] = load_steps(path)
        res = r["result"]
        out["runs"].setdefault(r["config"], {})[str(r["round"])] = {
            "result": {k: res.get(k) for k in ("mean_itl_ms", "p99_itl_ms", "mean_ttft_ms")},
            "steps": run_row(s, slow_ms)}
    if not loaded:
        raise ValueError(f"{serve_dir}: no run of commit {commit} at rate {rate} has recorded steps (runs/*_steps.npz)")
    for (config, rnd), s in loaded.items():
        if config == base:
            continue
        b = loaded.get((base, rnd))
        if b is None:
            raise ValueError(f"{serve_dir}: round {rnd} has {config}'s steps but not {base}'s")
        base_p99 = out["runs"][base][str(rnd)]["result"]["p99_itl_ms"]
        out["vs_base"].setdefault(config, {})[str(rnd)] = compare(s, b, base_p99)
    return out


def table(a: dict, base: str = "vanilla") -> str:
    """The analysis as text: one line per run, then one per configuration and round against ``base``."""
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    lines = [f"commit {a['commit']}, rate {a['rate']}",
             "config r | mean ITL, P99 ITL, mean TTFT (recorded) | decode n, median | mixed n (>512), median "
             "| long n, sum | schedule (decode) | slow launches: share, median | steps' P99"]
    for config, rounds in a["runs"].items():
        for rnd, x in sorted(rounds.items()):
            r, s = x["result"], x["steps"]
            lines.append(f"{config} {rnd} | {f(r['mean_itl_ms'])} {f(r['p99_itl_ms'])} {f(r['mean_ttft_ms'])} | "
                         f"{s['decode_n']} {f(s['decode_period_median'])} | {s['mixed_n']} ({s['mixed_gt512_n']}) "
                         f"{f(s['mixed_period_median'])} | {s['long_n']} {s['long_period_sum']:.0f} | "
                         f"{s['schedule_decode_median']:.3f} | {f(s['slow_launch_share'])}, {f(s['slow_launch_median'])} | "
                         f"{s['steps_p99']:.2f}")
    lines.append(f"against {base}, same round: pre + own gap of mixed steps per token bin (median, config / {base}, "
                 f"the steps' P99 with {base}'s pre / own / both gaps of that bin alone swapped in); "
                 f"steps' P99 with {base}'s pre / own / both gaps swapped in; samples above {base}'s recorded P99 "
                 "(pre / own / other, config vs base)")
    for config, rounds in a["vs_base"].items():
        for rnd, c in sorted(rounds.items()):
            bins = "  ".join(f"{k}: {f(v['pair_median'][0])}/{f(v['pair_median'][1])} (n {v['n'][0]}/{v['n'][1]}"
                             + (f", [{v['pair_ratio_ci95'][0]:+.1%}, {v['pair_ratio_ci95'][1]:+.1%}]"
                                if v["pair_ratio_ci95"] else "")
                             + f"; swap {v['swap_p99']['pre']:.2f}/{v['swap_p99']['own']:.2f}/{v['swap_p99']['both']:.2f})"
                             for k, v in c["bins"].items())
            sw = c["swap_p99"]
            mine, theirs = c["samples_above_base_p99"]
            lines.append(f"{config} {rnd} | {bins} | swap {sw['pre']:.2f} / {sw['own']:.2f} / {sw['both']:.2f} | "
                         f"{mine['pre']:.0f}/{mine['own']:.0f}/{mine['other']:.0f} vs "
                         f"{theirs['pre']:.0f}/{theirs['own']:.0f}/{theirs['other']:.0f}")
    return "\n".join(lines)


def main(args) -> int:
    import sys

    configs = args.configs.split(",") if args.configs else None
    try:
        a = analyse(args.serve_dir, args.rate, args.commit, args.base, configs, args.slow_ms)
    except (FileNotFoundError, ValueError) as e:
        print(f"itl-tail: {e}", file=sys.stderr)
        return 2
    print(table(a, args.base))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(a, f, indent=1)
    return 0
