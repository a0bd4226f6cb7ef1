"""Where the two-variant policy's cost lies, by kind of engine step, in the 651b407 sequence (each
app on the default server, a variant per app, and on the second plugin server with the app-free
and every-site variants only, `--alt-variants onoff`; same rounds, pinned servers, recorded steps).

Per app and round: the decode steps' median period (`engine_steps.decode.period_ms_median`, ms)
on each server and their ratio; the prefill part of TTFT (vLLM's metrics, `server_metrics.
prefill_ms`, ms) on each server and the difference; mean ITL (ms) on each server and the
difference in points of plain vLLM's mean ITL. What a policy that keeps each app's own FULL graphs
for decode batches and the every-site piecewise graphs for prefill-carrying steps
(`--alt-variants pieces64`) would be expected to keep of the two-variant policy's cost is the
prefill part; its decode steps replay the same graphs as the default's. Run from the repository
root: `python benchmarks/results/2026-12-07/serve-onoff-h100/steps_by_kind.py`."""
import gzip
import json
import statistics

PATH = "benchmarks/results/2026-12-07/serve-onoff-h100/results.json.gz"
APPS = ["steer_one", "steer_all", "probe_one", "seal", "cast", "inactive"]


def main():
    with gzip.open(PATH, "rt") as f:
        runs = {(r["config"], r["round"]): r for r in json.load(f) if str(r.get("rate")) in ("16", "16.0")}
    print("app | round | decode period default / onoff (ms) | ratio | TTFT prefill part default / onoff (ms) "
          "| diff | mean ITL default / onoff (ms) | diff (points of plain vLLM's)")
    per_app = {}
    for app in APPS:
        for rd in (1, 2):
            d, a, v = runs.get((app, rd)), runs.get(("alt_" + app, rd)), runs.get(("vanilla", rd))
            if d is None or a is None or v is None:
                continue
            dd, da = d["engine_steps"]["decode"]["period_ms_median"], a["engine_steps"]["decode"]["period_ms_median"]
            pd, pa = d["server_metrics"]["prefill_ms"], a["server_metrics"]["prefill_ms"]
            id_, ia, iv = (x["result"]["mean_itl_ms"] for x in (d, a, v))
            per_app.setdefault(app, []).append((da / dd - 1, pa - pd, (ia - id_) / iv))
            print(f"{app} | {rd} | {dd:.4f} / {da:.4f} | {100 * (da / dd - 1):+.2f}% | {pd:.2f} / {pa:.2f} | "
                  f"{pa - pd:+.2f} | {id_:.3f} / {ia:.3f} | {100 * (ia - id_) / iv:+.2f}")
    print("mean over rounds: app | decode ratio | prefill part diff (ms) | mean ITL diff (points)")
    for app, xs in per_app.items():
        print(f"{app} | {100 * statistics.mean(x[0] for x in xs):+.2f}% | {statistics.mean(x[1] for x in xs):+.2f} | "
              f"{100 * statistics.mean(x[2] for x in xs):+.2f}")


if __name__ == "__main__":
    main()
