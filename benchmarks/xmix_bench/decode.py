"""decode: tokens and decode step time of one offline engine, plain vLLM or the plugin's.

One invocation starts one ``LLM`` (dummy weights, token-id prompts, no tokenizer) and writes a
JSON file (``--out``):

* ``--mode plain``: vLLM without the plugin (run it with ``VLLM_PLUGINS=""``);
* ``--mode xmix``: the plugin with ``steer_all`` deployed (add at hook_resid_post of every layer;
  ``--with-probe``, ``--with-cond``, ``--with-ablate`` deploy more of the benchmark deployment):
  greedy tokens with the apps off, on, and off again; then, unless ``--eager``, offline
  throughput (``--bench-prompts`` fresh prompts of 128-1023 tokens per run, warm-up, then
  ``--repeats`` runs of every configuration interleaved) and the decode step time: 32-token
  prompts, 256 output tokens, batch 1 / 8 / 64, wall time of ``generate`` / 256, the first round
  a warm-up. Configurations: ``inactive`` (apps deployed, off), ``steer_all`` (or
  ``steer_all@S`` per ``--on-scales``) and each deployed app on every request.

``--compare FILE ...`` sets the files side by side: token equality (apps off == plain vLLM,
graphs == eager) and throughput and decode ratios to plain vLLM. With a plain and a plugin
file of compiled (graph) engines, the decode ratios to plain go to latest.json (``--latest``).
"""

from __future__ import annotations

import json
import time

from . import common

HELP = "decode step time and token checks of one offline engine (plain vLLM or the plugin's)"


def add_arguments(p) -> None:
    p.add_argument("--model", help="model config folder (benchmarks/models/...)")
    p.add_argument("--mode", choices=["plain", "xmix"], help="plain: vLLM without the plugin; xmix: the plugin")
    p.add_argument("--eager", action="store_true", help="enforce_eager=True (tokens only)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--check-prompts", type=int, default=64, help="prompts of the token checks")
    p.add_argument("--check-tokens", type=int, default=32, help="greedy tokens per check prompt")
    p.add_argument("--bench-prompts", type=int, default=512, help="prompts per throughput run")
    p.add_argument("--bench-out", type=int, default=128, help="output tokens per throughput prompt")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per configuration (decode: +2)")
    p.add_argument("--scale", type=float, default=0.5, help="deployed scale of the adds")
    p.add_argument("--on-scales", default="",
                   help="comma-separated per-request scales of steer_all to benchmark (default: the deployed scale)")
    p.add_argument("--skip-throughput", action="store_true", help="decode step time only")
    p.add_argument("--with-cond", action="store_true",
                   help="also deploy 'seal' (add at layers n/4..n/2-1 where the token id is a multiple of 5) "
                        "and 'cast' (cosine at layer 7n/32 decides, per request, an add at layers 15n/32..24n/32-1) "
                        "and benchmark them")
    p.add_argument("--with-probe", action="store_true",
                   help="also deploy 'probe_one' (a linear probe at blocks.{n/2}.hook_resid_post) and benchmark it")
    p.add_argument("--with-ablate", action="store_true",
                   help="also deploy 'ablate_all' (directional ablation at hook_resid_pre of every layer, "
                        "Arditi et al.) and benchmark it")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--fused-writes", choices=["auto", "none", "adds", "all", "norm"], default="auto",
                   help="the deployment's fused_writes (what compiled graphs apply as torch ops)")
    p.add_argument("--out", help="the JSON file to write")
    p.add_argument("--compare", nargs="+", metavar="FILE", help="compare files written by this command")
    p.add_argument("--latest", default=str(common.LATEST), help="with --compare: latest.json to update")
    p.add_argument("--no-latest", action="store_true", help="with --compare: do not update latest.json")
    p.add_argument("--model-name", help="with --compare: the model's name in latest.json (default: from the files)")
    p.add_argument("--commit", help="with --compare: the measured commit (default: from the plugin's file)")
    p.add_argument("--date", help="with --compare: the date measured (default: from the plugin's file)")
    p.add_argument("--command", help="with --compare: the command that measured (default: from the plugin's file)")
    p.add_argument("--source", default="", help="with --compare: where the numbers come from (kept in latest.json)")
    p.add_argument("--card", help="with --compare: the GPU the runs measured on (e.g. H100), for files that record "
                                  "none (default: the plugin's file's; a measurement naming none counts as the H200)")


def main(args) -> int:
    if args.compare:
        print(compare(args.compare, args))
        return 0
    missing = [o for o, v in (("--model", args.model), ("--mode", args.mode), ("--out", args.out)) if not v]
    if missing:
        args._parser.error(f"{', '.join(missing)} needed (or --compare FILE ...)")
    run(args)
    return 0


def _config_name(c, mode: str) -> str:
    if c is False:
        return "inactive" if mode == "xmix" else "plain"
    if c is True:
        return "steer_all"
    return c if isinstance(c, str) else f"steer_all@{c:g}"


def _selection(c):
    """False: no app; True: steer_all at its deployed scale; a float: steer_all at that scale;
    a name: that app."""
    if c is False:
        return None
    if c is True:
        return ["steer_all"]
    return [c] if isinstance(c, str) else [{"name": "steer_all", "scale": float(c)}]


def run(args) -> None:
    cfg = common.load_config(args.model)
    vocab = cfg["vocab_size"]
    names = []
    if args.mode == "xmix":
        names = ["steer_all"] + ["ablate_all"] * args.with_ablate + ["probe_one"] * args.with_probe \
            + ["seal", "cast"] * args.with_cond
    apps = common.serving_apps(cfg, scale=args.scale, names=names) if names else []
    llm, startup = common.make_llm(args.model, apps=apps, fused_writes=args.fused_writes, eager=args.eager,
                                   dtype=args.dtype, max_model_len=args.max_model_len)
    res = dict(model=common.model_name(args.model), mode=args.mode, eager=args.eager, fused_writes=args.fused_writes,
               apps=[a.name for a in apps], scale=args.scale, startup_s=round(startup, 1), **common.engine_info(llm),
               commit=common.git_commit(), date=common.today(), command=common.command_line(),
               card=common.gpu_card())

    def sp(c, max_tokens: int):
        return common.sampling(_selection(c), temperature=0, max_tokens=max_tokens, ignore_eos=True)

    check = common.token_prompts(0, args.check_prompts, 16, 256, vocab)

    def toks(c):
        outs = llm.generate(check, sp(c, args.check_tokens), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    res["tokens_off"] = toks(False)
    if args.mode == "xmix":
        res["tokens_on"] = toks(True)
        res["tokens_off_after_on"] = toks(False)
    if not args.eager:
        configs = [False]
        if args.mode == "xmix":
            configs += [float(x) for x in args.on_scales.split(",")] if args.on_scales else [True]
            configs += [n for n in ("probe_one", "seal", "cast", "ablate_all") if n in names]
        name = {c: _config_name(c, args.mode) for c in configs}
        hi = min(1024, args.max_model_len - args.bench_out)

        def run_once(c, i: int) -> float:
            # fresh random prompts for every run (no prefix-cache hits across runs; run i of
            # every configuration uses prompt set i)
            bench = common.token_prompts(1000 + i, args.bench_prompts, 128, hi, vocab)
            n_in = sum(len(p["prompt_token_ids"]) for p in bench)
            t = time.perf_counter()
            outs = llm.generate(bench, sp(c, args.bench_out), use_tqdm=False)
            dt = time.perf_counter() - t
            return (n_in + sum(len(o.outputs[0].token_ids) for o in outs)) / dt

        if not args.skip_throughput:
            for c in configs:  # warm-up
                run_once(c, 0)
            tput = {c: [] for c in configs}
            for i in range(args.repeats):
                for c in configs:  # interleaved A B A B
                    tput[c].append(run_once(c, i + 1))
            res["throughput_tok_s"] = {name[c]: dict(runs=[round(x, 1) for x in v], median=round(common.median(v), 1))
                                       for c, v in tput.items()}
        dec = {}
        for b in (1, 8, 64):
            times = {c: [] for c in configs}
            for i in range(args.repeats + 3):
                for c in configs:
                    ps = common.token_prompts(10_000 + 100 * b + i, b, 32, 33, vocab)
                    t = time.perf_counter()
                    llm.generate(ps, sp(c, 256), use_tqdm=False)
                    if i >= 1:  # the first round is a warm-up
                        times[c].append((time.perf_counter() - t) / 256 * 1e3)
            dec[str(b)] = {name[c]: dict(runs=[round(x, 4) for x in v], median=round(common.median(v), 4))
                           for c, v in times.items()}
            print("DECODE", b, json.dumps({k: v["median"] for k, v in dec[str(b)].items()}), flush=True)
        res["decode_ms_per_step"] = dec
    common.write_json(args.out, res, indent=None)
    print("RESULT", json.dumps({k: v for k, v in res.items() if not k.startswith("tokens")}), flush=True)


# ------------------------------------------------------------------------------ comparison


def _canonical(name: str) -> str:
    """Configuration names of files written before the apps had their own names."""
    return "steer_all" + name[len("steer_on"):] if name.startswith("steer_on") else name


def _eq(a, b):
    same = sum(x == y for x, y in zip(a, b))
    first_div = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                 for x, y in zip(a, b) if x != y]
    return same, len(a), first_div


def compare(paths: list[str], args=None) -> str:
    R = {}
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        for key in ("throughput_tok_s", "decode_ms_per_step"):
            if key in r:
                r[key] = ({_canonical(k): v for k, v in r[key].items()} if key == "throughput_tok_s" else
                          {b: {_canonical(k): v for k, v in d.items()} for b, d in r[key].items()})
        R[(r["mode"], r["eager"])] = r
    lines = [f"{k}: startup {r['startup_s']}s v2_runner={r['v2_runner']} cudagraph={r['cudagraph_mode']} "
             f"compile={r['compile_mode']}" for k, r in R.items()]

    def cmp(label, a, b):
        s, n, fd = _eq(a, b)
        lines.append(f"{label}: {s}/{n} prompts identical"
                     + (f" (first divergence at tokens {sorted(fd)[:10]})" if fd else ""))

    g_plain, g_x = R.get(("plain", False)), R.get(("xmix", False))
    e_plain, e_x = R.get(("plain", True)), R.get(("xmix", True))
    if g_plain and g_x:
        cmp("graphs: apps off == plain vLLM", g_x["tokens_off"], g_plain["tokens_off"])
        cmp("graphs: apps off after on == plain vLLM", g_x["tokens_off_after_on"], g_plain["tokens_off"])
        s, n, _ = _eq(g_x["tokens_on"], g_plain["tokens_off"])
        lines.append(f"graphs: steering on changed {n - s}/{n} prompts")
    if e_plain and e_x:
        cmp("eager: apps off == plain vLLM", e_x["tokens_off"], e_plain["tokens_off"])
        s, n, _ = _eq(e_x["tokens_on"], e_plain["tokens_off"])
        lines.append(f"eager: steering on changed {n - s}/{n} prompts")
    if e_x and g_x:
        cmp("steered: eager == graphs", e_x["tokens_on"], g_x["tokens_on"])
    if e_plain and g_plain:
        cmp("control, plain vLLM: eager == graphs", e_plain["tokens_off"], g_plain["tokens_off"])
    if g_plain and g_x and "throughput_tok_s" in g_plain and "throughput_tok_s" in g_x:
        base = g_plain["throughput_tok_s"]["plain"]["median"]
        for k, v in g_x["throughput_tok_s"].items():
            lines.append(f"throughput {k}: median {v['median']} tok/s ({(v['median'] / base - 1) * 100:+.2f}% vs plain "
                         f"{base}); runs {v['runs']}")
        lines.append(f"throughput plain: runs {g_plain['throughput_tok_s']['plain']['runs']}")
    if g_plain and g_x and "decode_ms_per_step" in g_plain and "decode_ms_per_step" in g_x:
        for b, d in g_x["decode_ms_per_step"].items():
            base_d = g_plain["decode_ms_per_step"][b]["plain"]["median"]
            parts = [f"plain {base_d:.3f}"] + [f"{k} {v['median']:.3f} ({(v['median'] / base_d - 1) * 100:+.2f}%)"
                                               for k, v in d.items()]
            lines.append(f"decode ms/step batch {b}: " + ", ".join(parts))
        if args is not None and not args.no_latest:
            lines.append(_to_latest(g_plain, g_x, paths, args))
    return "\n".join(lines)


def _to_latest(plain: dict, x: dict, paths: list[str], args) -> str:
    """Decode ratios to plain vLLM, per configuration and batch size, into latest.json."""
    model = args.model_name or x.get("model")
    if not model:
        return "latest.json not updated: the files name no model (give --model-name)"
    commit, date = args.commit or x.get("commit"), args.date or x.get("date")
    if not commit or not date:
        return "latest.json not updated: the files record no commit / date (give --commit and --date)"
    dec, pd = x["decode_ms_per_step"], plain["decode_ms_per_step"]
    names = list(next(iter(dec.values())))
    deployed = f"steer_all@{x.get('scale', 0.5):g}"
    apps = x.get("apps") or ["steer_all"] + [n for n in names if n in common.APP_NAMES and n != "steer_all"]
    n_runs = len(next(iter(next(iter(dec.values())).values()))["runs"])
    workload = (f"32-token prompts, 256 output tokens, batch 1 / 8 / 64, median of {n_runs} runs after "
                f"a warm-up; apps deployed: {', '.join(apps)}; fused_writes={x.get('fused_writes', 'none')}")
    done = []
    for name in names:
        key = name
        if name == deployed and "steer_all" not in names:
            key = "steer_all"  # the deployed scale, given per request
        elif "@" in name:
            continue
        entry = {"batch": {b: common.ratio_of_medians(dec[b][name]["runs"], pd[b]["plain"]["runs"]) for b in dec},
                 "commit": commit, "date": date, "workload": workload,
                 "command": args.command or x.get("command") or "", "source": args.source or ", ".join(paths)}
        card = getattr(args, "card", None) or x.get("card")
        if card:
            entry["card"] = card
        common.update_latest(args.latest, model, ("decode", key), entry)
        done.append(key)
    return f"latest.json ({args.latest}): decode lines of {model} for {', '.join(done)}"
