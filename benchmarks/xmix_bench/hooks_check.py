"""hooks-check: every hook point, write, read and condition kind, CUDA graphs against eager.

One engine per invocation (``--eager`` or not); both write ``{app: tokens}`` and the read
results to ``--out``; ``--compare A.json B.json`` sets two files side by side. The ``none``
entry (no app) is the control: plain vLLM's own eager-vs-graphs agreement in bf16 bounds what
the apps can show. Prompts are 16-600 tokens with ``max_num_batched_tokens=512``, so long
prompts are prefilled in chunks. Inside each run:

* a mixed batch (half the requests with apps of different kinds and output lengths, so later
  steps hold fewer apps, then app-free requests only: the every-site, per-app and app-free
  graph variants in turn) must give each request its solo tokens;
* read alignment (teacher forcing): the probe values of a generated request must equal,
  position by position, those of a second request whose prompt is that request's prompt +
  generated tokens (one prefill, no decode); an off-by-one or a lost chunk shows as a large
  error, bf16 prefill-vs-decode noise as a small one.
"""

from __future__ import annotations

import gzip
import json
import math
import os

from . import common

HELP = "every hook point, write, read and condition kind: CUDA graphs against eager"
READS = ("probe_mid", "probe_all", "capture_mid", "router_read")


def add_arguments(p) -> None:
    p.add_argument("--model", help="model config folder (benchmarks/models/...)")
    p.add_argument("--eager", action="store_true", help="enforce_eager=True")
    p.add_argument("--out", help="the JSON file to write")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--gpu-mem", type=float, default=0.9, help="gpu_memory_utilization")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--fused-writes", choices=["auto", "none", "adds", "all", "norm"], default="auto",
                   help="the deployment's fused_writes (what compiled graphs apply as torch ops)")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (TP=2 against TP=1: the same weights, "
                   "see the checkpoint subcommand and --load-format auto)")
    p.add_argument("--load-format", default="dummy", help="vLLM load_format: dummy (random per rank), auto (the "
                   "checkpoint in --model)")
    p.add_argument("--quantization", default=None, help="vLLM quantization, e.g. fp8 (online: the dummy weights "
                   "quantized as they load; Mixtral-8x7B in fp8 is ~47 GB)")
    p.add_argument("--plain", action="store_true", help="no apps deployed: the no-app tokens only (run with "
                   "VLLM_PLUGINS= for plain vLLM), to compare with the plugin's 'none'")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two files written by this command")


def main(args) -> int:
    if args.compare:
        compare(*args.compare)
        return 0
    if not args.model or not args.out:
        args._parser.error("--model and --out needed (or --compare A B)")
    run(args)
    return 0


def apps_for(cfg: dict) -> list:
    """The check's apps: an add at each hook point, ablation, clamp, router mask (MoE), reads,
    SEAL- and CAST-style conditional writes, a latch."""
    import numpy as np

    from vllm_xmix import MIApp

    d, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    rng = np.random.default_rng(0)
    mid = [n // 2, n // 2 + 1]
    out = []
    for hook in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"):
        a = MIApp(f"add_{hook[5:]}")
        a.write("add", vector=rng.standard_normal(d).astype(np.float32), scale=0.5).layers(mid).submodule(hook)
        out.append(a)
    a = MIApp("ablate_all")
    a.write("ablate", vector=rng.standard_normal(d).astype(np.float32)).layers("all").submodule("hook_resid_pre")
    out.append(a)
    a = MIApp("clamp_mlp")
    a.write("clamp", vector=rng.standard_normal(d).astype(np.float32), value=1.0).layers(mid).submodule("hook_mlp_out")
    out.append(a)
    n_exp = cfg.get("num_local_experts")
    if n_exp:
        bias = [0.0] * n_exp
        bias[0] = -math.inf
        a = MIApp("router_mask0")
        a.write("router_bias", vector=bias).layers("all").submodule("mlp.hook_router_logits")
        out.append(a)
    a = MIApp("probe_mid")
    a.read("linear_probe", weight=rng.standard_normal(d).astype(np.float32) / np.sqrt(d)).layers(
        [n // 2]).submodule("hook_resid_post")
    out.append(a)
    # every layer's input (layer 0: the embeddings, which differ strongly from token to token, so
    # a misaligned position cannot hide; dummy weights make the deeper stream nearly constant)
    a = MIApp("probe_all")
    a.read("linear_probe", weight=rng.standard_normal(d).astype(np.float32) / np.sqrt(d)).layers(
        "all").submodule("hook_resid_pre")
    out.append(a)
    a = MIApp("capture_mid")
    a.read("capture", positions="all", name="all").layers([n // 2]).submodule("hook_resid_mid")
    a.read("capture", positions="generated", name="gen").layers([1]).submodule("hook_mlp_out")
    a.read("capture", positions="last", name="last").layers([n - 1]).submodule("hook_resid_post")
    out.append(a)
    # conditional writes: SEAL-style token sets, CAST-style cosine conditions
    vocab = cfg["vocab_size"]
    trig = list(range(0, vocab, 5))  # every 5th token id: ~20% of random tokens trigger
    v = rng.standard_normal(d).astype(np.float32)
    c = rng.standard_normal(d).astype(np.float32)
    a = MIApp("seal")
    a.write("add", vector=v, scale=0.5).layers(range(n // 4, n // 2)).cond(tokens=trig)
    out.append(a)
    a = MIApp("seal_prev_gen")
    a.write("add", vector=v, scale=0.5).layers(range(n // 4, n // 2)).cond(tokens_prev=trig, positions="generated")
    out.append(a)
    # CAST's shape: a condition at layer 7 decides steering at layers 15-23 (scaled to n). On dummy
    # weights every prompt's mean similarity is ~0, a knife edge for bf16 graphs vs eager, so the
    # threshold is -1 (always true): this checks the gating from the last prompt token on; the
    # decision on both sides of a threshold is checked against HF on CPU (tests/test_conditions.py)
    a = MIApp("cast")
    a.read("cosine", weight=c, buffer="sim", scope="request").layers([7 * n // 32]).submodule("hook_resid_post")
    a.write("add", vector=v, scale=0.5).layers(range(15 * n // 32, 24 * n // 32)).cond(buffer="sim", op=">", threshold=-1.0)
    out.append(a)
    a = MIApp("cast_tok")
    a.read("cosine", weight=c, buffer="sim").layers([7 * n // 32]).submodule("hook_resid_post")
    a.write("add", vector=v, scale=0.5).layers(range(15 * n // 32, 24 * n // 32)).cond(buffer="sim", op=">", threshold=0.0)
    out.append(a)
    # a latch (cond(latch=...)): the trigger read's latch kernel and the latched writes' gate in
    # the graphs; a cosine above -1 crosses at once (position 0), so the writes apply from the
    # first token on whatever bf16 does (the crossing position itself: tests/test_latch.py on CPU)
    a = MIApp("latch")
    a.read("cosine", weight=c, name="sim").layers([7 * n // 32]).submodule("hook_resid_post").on(
        ">", -1.0, action="latch")
    a.write("add", vector=v, scale=0.5).layers(range(15 * n // 32, 24 * n // 32)).cond(latch="sim")
    out.append(a)
    if n_exp:
        a = MIApp("router_read")
        a.read("capture", name="logits").layers([1, n - 1]).submodule("mlp.hook_router_logits")
        out.append(a)
    return out


def _flat(res: dict) -> dict:
    """mi_results of one request -> {"app.read[@L]": list}; captures as per-row L2 norms."""
    import numpy as np

    out = {}
    for app, reads in res.items():
        for name, v in reads.items():
            for L, arr in (v.items() if isinstance(v, dict) else [(None, v)]):
                a = np.asarray(arr, dtype=np.float64)
                if a.ndim == 2 or (name == "last"):
                    a = np.linalg.norm(a.reshape(-1, a.shape[-1]), axis=1)
                out[f"{app}.{name}" + (f"@{L}" if L is not None else "")] = a.tolist()
    return out


def run(args) -> None:
    import numpy as np

    cfg = common.load_config(args.model)
    apps = [] if args.plain else apps_for(cfg)
    llm, startup = common.make_llm(args.model, apps=apps, fused_writes=args.fused_writes, eager=args.eager,
                                   dtype=args.dtype, max_model_len=1024, gpu_memory_utilization=args.gpu_mem,
                                   max_num_batched_tokens=512, tensor_parallel_size=args.tp,
                                   load_format=args.load_format,
                                   **({"quantization": args.quantization} if args.quantization else {}))
    info = common.engine_info(llm)
    prompts = common.token_prompts(1, args.prompts, 16, 600, cfg["vocab_size"])
    res = {"startup_s": round(startup, 1), "eager": args.eager, "fused_writes": args.fused_writes, "tokens": {},
           "reads": {}, "async_scheduling": info["async_scheduling"], "v2_runner": info["v2_runner"],
           "tp": args.tp, "load_format": args.load_format, "quantization": args.quantization, "plain": args.plain,
           "commit": common.git_commit(), "date": common.today(), "command": common.command_line()}

    def sp(name, n):
        return common.sampling(None if name == "none" else [name], temperature=0, max_tokens=n, ignore_eos=True)

    def no_app_run():  # the no-app requests, with each generated token's logprob (against plain vLLM)
        outs = llm.generate(prompts, common.sampling(None, temperature=0, max_tokens=args.tokens, ignore_eos=True,
                                                     logprobs=1), use_tqdm=False)
        res["tokens"]["none"] = [list(o.outputs[0].token_ids) for o in outs]
        res["logprobs_none"] = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                                for o in outs]

    names = ["none"] + [a.name for a in apps]
    if args.plain:
        no_app_run()
        common.write_json(args.out, res, indent=None)
        print("DONE", args.out, res["startup_s"], flush=True)
        return
    no_app_run()
    for name in names[1:]:
        outs = llm.generate(prompts, sp(name, args.tokens), use_tqdm=False)
        res["tokens"][name] = [list(o.outputs[0].token_ids) for o in outs]
        if name in READS:
            res["reads"][name] = [_flat(o.mi_results) for o in outs]
            n_pos = [len(p["prompt_token_ids"]) + args.tokens - 1 for p in prompts]
            first = next(iter(res["reads"][name][0]))
            if name != "capture_mid":
                assert all(len(r[first]) == k for r, k in zip(res["reads"][name], n_pos)), f"{name}: value count"
    # graph variants: a batch where half the requests have an app on, different apps (with
    # different output lengths, so later steps hold fewer apps, then app-free requests only: the
    # every-site, per-app and app-free variants in turn) must give each request its solo tokens
    kinds = [k for k in ("add_resid_post", "seal", "ablate_all", "cast") if k in names]
    mixed_names = [(kinds[(i // 2) % len(kinds)] if i % 2 == 0 else "none") for i in range(len(prompts))]
    lens = [args.tokens + (8 if i % 4 == 1 else 4 if i % 4 == 0 else 0) for i in range(len(prompts))]
    outs = llm.generate(prompts, [sp(nm, k) for nm, k in zip(mixed_names, lens)], use_tqdm=False)
    mixed = [list(o.outputs[0].token_ids)[: args.tokens] for o in outs]
    solo = [res["tokens"][nm][i] for i, nm in enumerate(mixed_names)]
    res["mixed_equals_solo"] = sum(x == y for x, y in zip(mixed, solo))
    res["mixed_kinds"] = kinds
    print("MIXED", res["mixed_equals_solo"], "/", len(prompts), kinds, flush=True)
    # teacher forcing: prompt + generated[:-1] as one prompt, probe values must line up
    tf = {}
    for name in ("probe_mid", "probe_all"):
        gen = llm.generate(prompts[:8], sp(name, args.tokens), use_tqdm=False)
        forced = [{"prompt_token_ids": p["prompt_token_ids"] + list(o.outputs[0].token_ids)[:-1]}
                  for p, o in zip(prompts[:8], gen)]
        again = llm.generate(forced, sp(name, 1), use_tqdm=False)
        errs = []
        for o1, o2 in zip(gen, again):
            a, b = _flat(o1.mi_results), _flat(o2.mi_results)
            for k in a:
                x, y = np.array(a[k]), np.array(b[k])
                assert x.shape == y.shape, (name, k, x.shape, y.shape)
                errs.append(float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-6)))
        tf[name] = {"max_rel_err": max(errs), "median_rel_err": float(np.median(errs))}
    res["teacher_forced"] = tf
    print("TEACHER_FORCED", json.dumps(tf), flush=True)
    common.write_json(args.out, res, indent=None)
    print("DONE", args.out, res["startup_s"], flush=True)


def _label(r: dict) -> str:
    """What a result file ran: graphs / eager, TP=n where n > 1, plain vLLM."""
    lab = "eager" if r.get("eager") else "graphs"
    if r.get("tp", 1) > 1:
        lab += f"-tp{r['tp']}"
    return ("plain-" + lab) if r.get("plain") else lab


def read_result(path: str) -> dict:
    """A hooks-check result file: ``.json``, or ``.json.gz`` as kept under ``results/``.

    Raises:
        FileNotFoundError: naming the file (its engine's run failed or wrote elsewhere)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"hooks-check --compare: no result file {path} (did that engine's run fail? "
                                "see its log)")
    if path.endswith(".gz"):
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return common.read_json(path)


def compare(a_path: str, b_path: str) -> None:
    import numpy as np

    a, b = read_result(a_path), read_result(b_path)
    la, lb = _label(a), _label(b)
    base = a["tokens"]["none"]
    for name, ta in a["tokens"].items():
        if name not in b["tokens"]:
            continue  # a --plain file has the no-app tokens only
        tb = b["tokens"][name]
        same = sum(x == y for x, y in zip(ta, tb))
        changed = sum(x != y for x, y in zip(ta, base)) if name != "none" else 0
        print(f"{name:20s} {la}=={lb} {same}/{len(ta)}   changed vs no-app {changed}/{len(ta)}")
    if a.get("logprobs_none") and b.get("logprobs_none"):  # no app: how close, bit for bit
        pairs = [(np.array(x), np.array(y)) for x, y, tx, ty in
                 zip(a["logprobs_none"], b["logprobs_none"], a["tokens"]["none"], b["tokens"]["none"]) if tx == ty]
        if pairs:
            same = sum(np.array_equal(x, y) for x, y in pairs)
            diff = max(float(np.max(np.abs(x - y))) for x, y in pairs)
            print(f"{'none':20s} logprobs {la} vs {lb}: bit-identical {same}/{len(pairs)} requests with equal tokens, "
                  f"max |diff| {diff:.3g}")
    for name, ra in a.get("reads", {}).items():
        if name not in b.get("reads", {}):
            continue
        rb = b["reads"][name]
        errs, n_vals = [], 0
        for x, y, tx, ty in zip(ra, rb, a["tokens"][name], b["tokens"][name]):
            if tx != ty:
                continue  # different tokens => different positions after the first difference
            for k in x:
                u, v = np.array(x[k]), np.array(y[k])
                n_vals += u.size
                errs.append(float(np.max(np.abs(u - v)) / max(np.max(np.abs(v)), 1e-6)))
        if not errs:
            print(f"{name:20s} reads {la} vs {lb}: no request with equal tokens")
            continue
        print(f"{name:20s} reads {la} vs {lb}: {n_vals} values, max rel err {max(errs):.3g}, "
              f"median {np.median(errs):.3g}")
    for tag, r in (("A", a), ("B", b)):
        print(f"teacher-forced alignment {tag}: {r.get('teacher_forced')}")
        print(f"mixed batch (half with apps {r.get('mixed_kinds', ['add_resid_post'])}) == solo {tag}: "
              f"{r.get('mixed_equals_solo')}/{len(base)}")
