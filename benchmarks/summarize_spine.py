"""Compare the JSON files written by spine_check.py: token equalities and throughput ratios."""

from __future__ import annotations

import json
import sys


def _eq(a, b):
    same = sum(x == y for x, y in zip(a, b))
    first_div = []
    for x, y in zip(a, b):
        if x != y:
            first_div.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))))
    return same, len(a), first_div


def main(paths: list[str]) -> None:
    R = {}
    for p in paths:
        r = json.load(open(p))
        R[(r["mode"], r["eager"])] = r
    lines = []
    for k, r in R.items():
        lines.append(f"{k}: startup {r['startup_s']}s v2_runner={r['v2_runner']} cudagraph={r['cudagraph_mode']} compile={r['compile_mode']}")

    def cmp(name, a, b):
        s, n, fd = _eq(a, b)
        lines.append(f"{name}: {s}/{n} prompts identical" + (f" (first divergence at tokens {sorted(fd)[:10]})" if fd else ""))

    g_plain, g_x = R.get(("plain", False)), R.get(("xmix", False))
    e_plain, e_x = R.get(("plain", True)), R.get(("xmix", True))
    if g_plain and g_x:
        cmp("graphs: xmix steering off == plain vLLM", g_x["tokens_off"], g_plain["tokens_off"])
        cmp("graphs: xmix off after on == plain vLLM", g_x["tokens_off_after_on"], g_plain["tokens_off"])
        s, n, _ = _eq(g_x["tokens_on"], g_plain["tokens_off"])
        lines.append(f"graphs: steering on changed {n - s}/{n} prompts")
    if e_plain and e_x:
        cmp("eager: xmix steering off == plain vLLM", e_x["tokens_off"], e_plain["tokens_off"])
        s, n, _ = _eq(e_x["tokens_on"], e_plain["tokens_off"])
        lines.append(f"eager: steering on changed {n - s}/{n} prompts")
    if e_x and g_x:
        cmp("steered: eager == graphs", e_x["tokens_on"], g_x["tokens_on"])
    if e_plain and g_plain:
        cmp("control, plain vLLM: eager == graphs", e_plain["tokens_off"], g_plain["tokens_off"])
    if g_plain and g_x:
        base = g_plain["throughput_tok_s"]["plain"]["median"]
        for k, v in g_x["throughput_tok_s"].items():
            lines.append(f"throughput {k}: median {v['median']} tok/s ({(v['median'] / base - 1) * 100:+.2f}% vs plain {base}); runs {v['runs']}")
        lines.append(f"throughput plain: runs {g_plain['throughput_tok_s']['plain']['runs']}")
        if "decode_ms_per_step" in g_plain and "decode_ms_per_step" in g_x:
            for b, d in g_x["decode_ms_per_step"].items():
                base_d = g_plain["decode_ms_per_step"][b]["plain"]["median"]
                parts = [f"plain {base_d:.3f}"] + [f"{k} {v['median']:.3f} ({(v['median'] / base_d - 1) * 100:+.2f}%)" for k, v in d.items()]
                lines.append(f"decode ms/step batch {b}: " + ", ".join(parts))
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
