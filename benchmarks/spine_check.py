"""GPU check and first throughput A/B for the spine (one engine per process).

Each invocation starts one ``LLM`` (dummy weights, token-id prompts, no tokenizer) and prints a
JSON line with what it measured; ``benchmarks/run_spine_gpu.sh`` runs the set and
``benchmarks/summarize_spine.py`` compares them.

Modes (``--mode``):
  plain      the plugin not loaded (run with VLLM_PLUGINS="")
  xmix       plugin loaded, a steering app on all layers deployed: tokens off/on, and
             throughput for installed-inactive vs steering on every request (interleaved)
Add ``--eager`` for enforce_eager=True (tokens only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=["plain", "xmix"], required=True)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--check-prompts", type=int, default=64)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--bench-prompts", type=int, default=512)
    ap.add_argument("--bench-out", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--on-scales", default="",
                    help="comma-separated per-request scales to benchmark (default: the deployed scale only)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--with-cond", action="store_true",
                    help="also deploy 'seal' (add at layers n/4..n/2-1 where the token id is a multiple of 5) "
                         "and 'cast' (cosine at layer 7n/32 decides, per request, an add at layers 15n/32..24n/32-1) "
                         "and benchmark them")
    ap.add_argument("--with-probe", action="store_true",
                    help="also deploy 'probe_one' (a linear probe at blocks.{n/2}.hook_resid_post) and "
                         "benchmark it as a configuration")
    ap.add_argument("--with-ablate", action="store_true",
                    help="also deploy 'ablate_all' (directional ablation at hook_resid_pre of every layer, "
                         "Arditi et al.) and benchmark it")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--fused-writes", choices=["none", "adds", "all"], default="none",
                    help="the deployment's fused_writes (what compiled graphs apply as torch ops)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    cfg = json.load(open(os.path.join(args.model, "config.json")))
    d_model, n_layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kw = dict(model=args.model, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
              max_model_len=args.max_model_len, enforce_eager=args.eager, seed=0)
    if args.mode == "xmix":
        from vllm_xmix import MIApp, deploy

        v = np.random.default_rng(1).standard_normal(d_model).astype(np.float32)
        app = MIApp("steer_all")
        app.write("add", vector=v, scale=args.scale).layers("all").submodule("hook_resid_post")
        apps = [app]
        if args.with_probe:
            w = np.random.default_rng(2).standard_normal(d_model).astype(np.float32) / np.sqrt(d_model)
            probe = MIApp("probe_one")
            probe.read("linear_probe", weight=w, sigmoid=True).layers([n_layers // 2]).submodule("hook_resid_post")
            apps.append(probe)
        if args.with_cond:
            rng = np.random.default_rng(3)
            c = rng.standard_normal(d_model).astype(np.float32)
            seal = MIApp("seal")
            seal.write("add", vector=v, scale=args.scale).layers(range(n_layers // 4, n_layers // 2)).cond(
                tokens=list(range(0, vocab, 5)))
            cast = MIApp("cast")
            cast.read("cosine", weight=c, buffer="sim", scope="request").layers([7 * n_layers // 32])
            cast.write("add", vector=v, scale=args.scale).layers(
                range(15 * n_layers // 32, 24 * n_layers // 32)).cond(buffer="sim", op=">", threshold=-1.0)
            apps += [seal, cast]
        if args.with_ablate:
            r = np.random.default_rng(4).standard_normal(d_model).astype(np.float32)
            abl = MIApp("ablate_all")
            abl.write("ablate", vector=r).layers("all").submodule("hook_resid_pre")
            apps.append(abl)
        kw["additional_config"] = deploy(*apps, fused_writes=args.fused_writes)
    t0 = time.time()
    llm = LLM(**kw)
    startup = time.time() - t0
    vc = llm.llm_engine.vllm_config
    info = dict(mode=args.mode, eager=args.eager, fused_writes=args.fused_writes, startup_s=round(startup, 1),
                v2_runner=bool(getattr(vc, "use_v2_model_runner", False)),
                cudagraph_mode=str(vc.compilation_config.cudagraph_mode),
                compile_mode=str(vc.compilation_config.mode))

    rng = np.random.default_rng(0)
    check = [{"prompt_token_ids": rng.integers(10, vocab - 10, int(n)).tolist()}
             for n in rng.integers(16, 256, args.check_prompts)]

    def sp(on, max_tokens: int):
        """on: False (no app), True (deployed scale), a float (per-request scale) or an app name."""
        app = {"name": "steer_all"}
        if isinstance(on, str):
            app = {"name": on}
        elif on is not True and on is not False:
            app["scale"] = float(on)
        extra = {"xmix": {"apps": [app]}} if on is not False else None
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)

    def toks(on: bool):
        outs = llm.generate(check, sp(on, args.check_tokens), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    res = dict(info)
    res["tokens_off"] = toks(False)
    if args.mode == "xmix":
        res["tokens_on"] = toks(True)
        res["tokens_off_after_on"] = toks(False)
    if not args.eager:
        # Throughput: fresh random prompts for every run (no prefix-cache hits across runs;
        # run i of every configuration uses prompt set i).
        def prompt_set(i: int, n: int, lo: int, hi: int):
            r = np.random.default_rng(1000 + i)
            return [{"prompt_token_ids": r.integers(10, vocab - 10, int(k)).tolist()} for k in r.integers(lo, hi, n)]

        hi = min(1024, args.max_model_len - args.bench_out)

        def run(on: bool, i: int) -> float:
            bench = prompt_set(i, args.bench_prompts, 128, hi)
            n_in = sum(len(p["prompt_token_ids"]) for p in bench)
            t = time.perf_counter()
            outs = llm.generate(bench, sp(on, args.bench_out), use_tqdm=False)
            dt = time.perf_counter() - t
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            return (n_in + n_out) / dt

        configs = [False] if args.mode == "plain" else [False, True]
        if args.mode == "xmix" and args.on_scales:
            configs = [False] + [float(x) for x in args.on_scales.split(",")]
        if args.mode == "xmix" and args.with_probe:
            configs.append("probe_one")
        if args.mode == "xmix" and args.with_cond:
            configs += ["seal", "cast"]
        if args.mode == "xmix" and args.with_ablate:
            configs.append("ablate_all")
        name = {c: (c if isinstance(c, str) else f"steer_on@{c:g}" if not isinstance(c, bool) else None)
                for c in configs}
        name[False] = "inactive" if args.mode == "xmix" else "plain"
        name[True] = "steer_on"
        if not args.skip_throughput:
            for c in configs:  # warm-up
                run(c, 0)
            tput = {c: [] for c in configs}
            for i in range(args.repeats):
                for c in configs:  # interleaved A B A B
                    tput[c].append(run(c, i + 1))
            res["throughput_tok_s"] = {name[c]: dict(runs=[round(x, 1) for x in v], median=round(statistics.median(v), 1))
                                       for c, v in tput.items()}
        # Decode step time: 32-token prompts, 256 output tokens, batch 1 / 8 / 64.
        dec = {}
        for b in (1, 8, 64):
            times = {c: [] for c in configs}
            for i in range(args.repeats + 3):
                for c in configs:
                    ps = prompt_set(10_000 + 100 * b + i, b, 32, 33)
                    t = time.perf_counter()
                    llm.generate(ps, sp(c, 256), use_tqdm=False)
                    if i >= 1:  # first round is warm-up
                        times[c].append((time.perf_counter() - t) / 256 * 1e3)
            dec[str(b)] = {name[c]: dict(runs=[round(x, 4) for x in v], median=round(statistics.median(v), 4))
                           for c, v in times.items()}
            print("DECODE", b, json.dumps({k: v["median"] for k, v in dec[str(b)].items()}), flush=True)
        res["decode_ms_per_step"] = dec
    with open(args.out, "w") as f:
        json.dump(res, f)
    print("RESULT", json.dumps({k: v for k, v in res.items() if not k.startswith("tokens")}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
