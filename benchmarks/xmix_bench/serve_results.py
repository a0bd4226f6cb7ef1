"""The results of a serving A/B: what ``serve rounds`` (and ``serve summarize``, ``report
--add-serve``) make of the runs in ``<out>/results.json``, and ``serve start`` of the servers'
start-up.

* ``summary.md`` (:func:`summarize`): per workload and rate, medians and the ratio to vanilla
  with a bootstrap 95% CI over rounds (paired by round), the CPU busy fractions of each
  configuration's server, and tables of their own for the split of the mean TTFT and a
  request's whole time (vLLM's per-request metrics) and for the engine steps (``start
  --record-steps``); ``overhead.png`` (with matplotlib).
* latest.json (:func:`to_latest`): per configuration the median ratio and its range for mean
  ITL, P99 ITL, mean TTFT, throughput (the A/A lines under ``calibration``, the alternative
  variant policy's not at all); from ``serve start`` (:func:`startup_to_latest`) the servers'
  start-up times and CUDA-graph memory, with the state of their compile caches.
* the API server's profiles of ``rounds --api-profile`` per output token
  (:func:`api_profile_summary`, :func:`api_profile_report`).

With one round a ratio's interval is the point itself.
"""

from __future__ import annotations

import os
import sys

from . import common, engine_steps, server_metrics


def to_latest(path, runs: list[dict], model: str, rates=None, configs=None, setup: str = "", command: str = "",
              fused_writes: str | None = None, commit: str | None = None, date: str | None = None,
              source: str = "", title: str | None = None, card: str | None = None,
              one_at_a_time: bool = False) -> str:
    """Per (rate, workload) and configuration: each metric's median ratio to vanilla and its
    range over rounds, into latest.json (``serve[config]["rate=R"]``; an A/A configuration,
    ``aa_plain`` / ``aa_empty``, under ``calibration[config]["rate=R"]``: how far plain vLLM
    lies from itself, and the plugin with nothing deployed from plain vLLM, beside these lines,
    whichever ``configs`` are named). ``card``: the GPU the runs were measured on (each entry's
    ``card``; none recorded when None). ``one_at_a_time``: the servers ran one after the other
    (``start --servers``), so the workload says the rounds were not interleaved across them.
    An entry's commit and date are those of its paired rounds' last."""
    done = []
    for (rate, group_title), by_config in common.serve_groups(runs).items():
        if rates is not None and rate not in rates:
            continue
        for cfg, stats in common.serve_ratios(by_config).items():
            if configs is not None and cfg not in configs and not cfg.startswith("aa_"):
                continue
            if cfg.startswith("alt_"):
                continue  # another variant policy than the default's (start --alt-variants): summary.md only
            # (the rounds the ratios come from: those vanilla ran too)
            rounds_ = [by_config[cfg][i] for i in sorted(set(by_config[cfg]) & set(by_config.get("vanilla", {})))]
            n = stats.pop("rounds")
            if one_at_a_time:
                workload = (f"{title or group_title}, rate {rate}, " + ("1 round" if n == 1 else f"{n} rounds")
                            + ", the servers one at a time (not interleaved across them)")
            else:
                workload = (f"{title or group_title}, rate {rate}, "
                            + ("1 round" if n == 1 else f"{n} interleaved rounds"))
            if fused_writes:
                workload += f", fused_writes={fused_writes}"
            entry = {**stats, "commit": commit or rounds_[-1].get("commit") or "unknown",
                     "date": date or rounds_[-1].get("date") or "unknown", "workload": workload,
                     "command": command}
            if setup:
                entry["setup"] = setup
            if source:
                entry["source"] = source
            if card:
                entry["card"] = card
            # an A/A line (plain vLLM against itself) calibrates the pair: no budget line, kept apart
            common.update_latest(path, model, ("calibration" if cfg.startswith("aa_") else "serve", cfg,
                                               f"rate={rate}"), entry)
            done.append(f"{cfg}@{rate}")
    return f"latest.json ({path}): {model} serving {', '.join(done) or 'nothing (no paired vanilla rounds)'}"


def startup_to_latest(path, st: dict) -> None:
    v, x = st["servers"]["vanilla"], st["servers"]["xmix"]
    base = {"commit": st["commit"], "date": st["date"], "command": st["command"],
            "workload": f"server start-up, one server at a time, {len(st['apps'])} apps deployed "
                        f"({', '.join(st['apps'])}), fused_writes={st['fused_writes']}, "
                        f"{' '.join(st['server_args'])}"}
    if st.get("card"):
        base["card"] = st["card"]
    caches = {"plain": v.get("compile_cache", "shared"), "xmix": x.get("compile_cache", "shared")}
    common.update_latest(path, st["model_name"], ("startup",),
                         {"plain_s": v["startup_s"], "xmix_s": x["startup_s"],
                          "ratio": round(x["startup_s"] / v["startup_s"], 4), "caches": caches, **base})
    if "graph_gib" in v and "graph_gib" in x:
        common.update_latest(path, st["model_name"], ("graph_memory",),
                             {"plain_gib": v["graph_gib"], "xmix_gib": x["graph_gib"], "plain_s": v["graph_s"],
                              "xmix_s": x["graph_s"], **base})


def _cpu_cells(runs) -> str:
    """summary.md's CPU cells of one configuration: per role (API server, engine core) the
    median over rounds of its busy fraction and, in brackets, of its busiest thread's (1.00: one
    core the whole run)."""
    import numpy as np

    cells = ""
    for role in ("api_server", "engine_core"):
        rs = [r["cpu"][role] for r in runs if (r.get("cpu") or {}).get(role)]
        cells += (f" {np.median([x['busy'] for x in rs]):.2f} ({np.median([x['busiest_thread'] for x in rs]):.2f}) |"
                  if rs else " - |")
    return cells


def summarize(runs: list[dict], out_dir: str) -> str:
    """summary.md (per workload and rate: metric medians and ratios to vanilla with a bootstrap
    95% CI over rounds, paired by round) and overhead.png."""
    import numpy as np

    groups = common.serve_groups(runs)
    titles = list(dict.fromkeys(t for _, t in groups))
    lines, plot = [], {}
    for title in titles:
        lines += [f"# {title}", ""]
        rates = sorted({r for r, t in groups if t == title}, key=lambda x: float("inf") if x == "inf" else float(x))
        for rate in rates:
            by_config = groups[(rate, title)]
            base = by_config.get("vanilla", {})
            has_cpu = any(r.get("cpu") for cur in by_config.values() for r in cur.values())
            cpu_head = " API server CPU busy (busiest thread) | engine core CPU busy (busiest thread) |"
            lines += [f"## request rate {rate}", "",
                      "| config | " + " | ".join(f"{m[1]} (median)" for m in common.SERVE_METRICS) + " | "
                      + " | ".join(f"{m[1]} ratio [95% CI]" for m in common.SERVE_METRICS) + " |"
                      + (cpu_head if has_cpu else ""),
                      "|---" * (1 + 2 * len(common.SERVE_METRICS) + 2 * has_cpu) + "|"]
            for c, cur in by_config.items():
                meds = [f"{np.median([r['result'][k] for r in cur.values()]):.2f}" for k, _, _ in common.SERVE_METRICS]
                pairs = sorted(set(cur) & set(base))  # only rounds with both runs (a cut sweep keeps the rest)
                ratios = []
                for key, label, _ in common.SERVE_METRICS:
                    if c == "vanilla" or not pairs:
                        ratios.append("-")
                        continue
                    med, lo, hi = common.ratio_ci([cur[i]["result"][key] for i in pairs],
                                                  [base[i]["result"][key] for i in pairs])
                    ratios.append(f"{(med - 1) * 100:+.2f}% [{(lo - 1) * 100:+.2f}, {(hi - 1) * 100:+.2f}]")
                    plot.setdefault(f"{title}: rate {rate}", {}).setdefault(c, {})[label] = (med, lo, hi)
                lines.append(f"| {c} | " + " | ".join(meds) + " | " + " | ".join(ratios) + " |"
                             + (_cpu_cells(cur.values()) if has_cpu else ""))
            lines.append("")
            parts = server_metrics.table_rows({c: [r.get("server_metrics") or {} for r in cur.values()]
                                               for c, cur in by_config.items()})
            if parts:  # where the TTFT went, by vLLM's own per-request metrics
                lines += [f"TTFT parts at rate {rate} (vLLM's metrics; median over rounds of each run's mean):", ""]
                lines += parts + [""]
            e2e = server_metrics.e2e_rows({c: [r.get("server_metrics") or {} for r in cur.values()]
                                           for c, cur in by_config.items()},
                                          {c: [v for v in map(_api_us_per_token, cur.values()) if v is not None]
                                           for c, cur in by_config.items()})
            if e2e:  # a request's whole time: the engine core's part and the API server's, at both ends
                lines += [f"Request time at rate {rate} (vLLM's metrics; median over rounds of each run's mean; the "
                          "engine core's part by its own timestamps, the front end's the rest of e2e):", ""]
                lines += e2e + [""]
            steps = engine_steps.table_rows({c: [r["engine_steps"] for r in cur.values() if "engine_steps" in r]
                                             for c, cur in by_config.items()})
            if steps:  # the served engine steps of each run (start --record-steps)
                lines += [f"Engine steps at rate {rate} (recorded in the engine core; median over rounds of each "
                          "run's median step period, i.e. previous output processed or this step scheduled -> "
                          "this step's output, and host ms of the scheduler's schedule / update_from_output):", ""]
                lines += steps + [""]
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text)
    try:
        if plot:  # (no ratio without a paired vanilla run)
            _plot(plot, os.path.join(out_dir, "overhead.png"), titles[0] if len(titles) == 1 else "")
    except Exception as e:  # the numbers matter more than the picture
        print("plot not written:", e, file=sys.stderr)
    return text


def _api_us_per_token(run: dict) -> float | None:
    """A run's API-server CPU time per output token (us), or None where the run lacks either."""
    cpu_s = ((run.get("cpu") or {}).get("api_server") or {}).get("cpu_s")
    tokens = run.get("output_tokens")
    return cpu_s * 1e6 / tokens if cpu_s is not None and tokens else None


def _plot(plot: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = list(plot)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    labels = [m[1] for m in common.SERVE_METRICS]
    width = 0.8 / len(labels)
    for ax, panel in zip(axes[0], panels):
        configs = list(plot[panel])
        for j, lab in enumerate(labels):
            vals = [(plot[panel][c][lab][0] - 1) * 100 for c in configs]
            err = [[(plot[panel][c][lab][0] - plot[panel][c][lab][1]) * 100 for c in configs],
                   [(plot[panel][c][lab][2] - plot[panel][c][lab][0]) * 100 for c in configs]]
            ax.bar(np.arange(len(configs)) + j * width, vals, width, yerr=err, label=lab, capsize=2)
        ax.axhline(0, color="k", lw=0.8)
        for y in (-1, 1):
            ax.axhline(y, color="r", lw=0.6, ls="--")
        ax.set_xticks(np.arange(len(configs)) + 0.4 - width / 2)
        ax.set_xticklabels(configs, rotation=30, ha="right")
        ax.set_ylabel("change vs vanilla vLLM (%)")
        ax.set_title(panel.split(": ")[-1] if title else panel, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def api_profile_summary(path: str, output_tokens: int, requests: int, top: int = 40) -> dict:
    """A pstats file of the API server's main thread over one run: Python calls and profiled
    seconds (the functions' own time, summed) per output token, calls made in or directly from
    the plugin's functions per output token, and the ``top`` functions by own time (us per
    output token, calls per output token)."""
    import pstats

    from .api_calls import _is_plugin, _label

    calls = plugin = 0
    own = 0.0
    funcs = []
    for (f, ln, fn), (cc, nc, tt, ct, callers) in pstats.Stats(path).stats.items():
        calls += nc
        own += tt
        plugin += nc if _is_plugin(f) else sum(v[1] for (cf, _, _), v in callers.items() if _is_plugin(cf))
        funcs.append((tt, nc, _label(f, ln, fn)))
    per = 1.0 / max(output_tokens, 1)
    funcs.sort(reverse=True)
    return {"output_tokens": output_tokens, "requests": requests, "calls_per_token": round(calls * per, 2),
            "plugin_calls_per_token": round(plugin * per, 2), "profiled_us_per_token": round(own * 1e6 * per, 2),
            "top": [{"function": name, "us_per_token": round(tt * 1e6 * per, 3), "calls_per_token": round(nc * per, 3)}
                    for tt, nc, name in funcs[:top]]}


def api_profile_report(got: dict) -> str:
    """Lines of :func:`api_profile_run` results (``{config: summary}``, vanilla first): per
    configuration its per-token numbers, then the functions whose own time per token grew most
    against vanilla's."""
    lines = ["API server's main thread under cProfile, per output token (profiled: times are inflated, calls exact):"]
    base = got.get("vanilla") or {}
    for name, r in got.items():
        lines.append(f"  {name:16s} {r['calls_per_token']:8.1f} calls ({r['plugin_calls_per_token']:.1f} in the "
                     f"plugin), {r['profiled_us_per_token']:8.1f} us")
        if name == "vanilla" or not base:
            continue
        was = {t["function"]: t["us_per_token"] for t in base.get("top", [])}
        grown = sorted(((t["us_per_token"] - was.get(t["function"], 0.0), t["function"]) for t in r["top"]),
                       reverse=True)[:8]
        lines += [f"      {d:+8.2f} us  {fn}" for d, fn in grown if d > 0]
    return "\n".join(lines)
