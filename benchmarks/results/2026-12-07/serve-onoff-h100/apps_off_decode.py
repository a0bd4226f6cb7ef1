"""Apps off's decode-step period against plain vLLM's, in every recorded rate-16 serving sequence
of a dense model (the runs that recorded their engine steps: `serve start --record-steps`).

Per sequence: the median decode-step period of each run (`engine_steps.decode.period_ms_median`,
ms), plain vLLM's runs (vanilla, and aa_plain where a control ran) averaged, apps off's runs
(inactive, and alt_inactive where a second plugin server ran) averaged, and the ratio. Also the
plain runs' first and last period and the scheduler's host time per step in them (ms), to show
whether plain vLLM moved within the sequence. Run from the repository root:
`python benchmarks/results/2026-12-07/serve-onoff-h100/apps_off_decode.py`."""
import gzip
import json
import statistics

SEQUENCES = [  # (results file, rate-16 sequence index within the file, label)
    ("benchmarks/results/2026-12-05/serve-llama-r16-aa-h100/results.json", 0, "Llama 5429351"),
    ("benchmarks/results/2026-12-05/serve-llama-steps-h100/results.json", 0, "Llama 1e11595"),
    ("benchmarks/results/2026-12-06/serve-qwen-steps-h100/qwen/results.json.gz", 0, "Qwen3 f1b97ab"),
    ("benchmarks/results/2026-12-06/serve-rate16-pinned-h100/llama/results.json.gz", 0, "Llama 68b917d pinned"),
    ("benchmarks/results/2026-12-06/serve-rate16-pinned-h100/qwen/results.json.gz", 0, "Qwen3 68b917d pinned"),
    ("benchmarks/results/2026-12-06/serve-qwen-placement-h100/results.json.gz", 0, "Qwen3 c45d52a pinned"),
    ("benchmarks/results/2026-12-06/serve-qwen-placement-h100/results.json.gz", 1, "Qwen3 c45d52a unpinned"),
    ("benchmarks/results/2026-12-07/serve-r16-control-h100/results.json.gz", 0, "Llama a69609f pinned"),
    ("benchmarks/results/2026-12-07/serve-onoff-h100/results.json.gz", 0, "Llama 651b407 pinned"),
]
PLAIN, OFF = ("vanilla", "aa_plain"), ("inactive", "alt_inactive")


def load(path):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def sequences(runs):
    """The rate-16 runs split into sequences: a sequence starts again at vanilla's round 1."""
    out = []
    for r in runs:
        if str(r.get("rate")) not in ("16", "16.0") or not (r.get("engine_steps") or {}).get("decode"):
            continue
        if r["config"] == "vanilla" and r["round"] == 1:
            out.append([])
        if out:
            out[-1].append(r)
    return out


def main():
    ratios = []
    print("sequence | plain runs (ms) | apps-off runs (ms) | apps off / plain | plain first -> last (ms; schedule ms)")
    for path, i, label in SEQUENCES:
        seq = sequences(load(path))[i]
        per = lambda r: r["engine_steps"]["decode"]["period_ms_median"]
        plain = [r for r in seq if r["config"] in PLAIN]
        off = [r for r in seq if r["config"] in OFF]
        p, o = statistics.mean(map(per, plain)), statistics.mean(map(per, off))
        ratios.append(o / p - 1)
        first, last = plain[0], plain[-1]
        print(f"{label} | {' '.join(f'{per(r):.4f}' for r in plain)} | {' '.join(f'{per(r):.4f}' for r in off)} | "
              f"{100 * (o / p - 1):+.2f}% | {per(first):.4f} -> {per(last):.4f} "
              f"({first['engine_steps']['schedule_ms_median']:.3f} -> {last['engine_steps']['schedule_ms_median']:.3f})")
    print(f"median {100 * statistics.median(ratios):+.2f}%, positive in {sum(r > 0 for r in ratios)} of {len(ratios)}")


if __name__ == "__main__":
    main()
