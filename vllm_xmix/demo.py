"""Main job on the embedded default: ``python -m vllm_xmix.demo``.

Builds (or reuses) the tiny random-weight Llama with its locally trained tokenizer, starts real
vLLM with a steering app and a probe app deployed, generates greedily for a few prompts with
steering off and on in one batch (the probe, which reads the projection of the residual stream
on the steering direction at the last steered layer, on every request), and checks the off run
against plain vLLM (the plugin not loaded, in a child process). Exit status 0 only if the
steering-off run (probe on: a read changes nothing) equals plain vLLM, steering changed the
output, every request got one probe score per processed token, and the probe sees the steering.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROMPTS = ["The model reads", "A steering vector adds", "My friend likes the", "Each layer computes"]


def _engine_kwargs(model: str, eager: bool) -> dict:
    return dict(model=model, dtype="float32", max_model_len=256, max_num_seqs=16, seed=0,
                enforce_eager=eager, kv_cache_memory_bytes=256 << 20)


def _plain_tokens(model: str, max_tokens: int, eager: bool) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(**_engine_kwargs(model, eager))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build the tiny Llama)")
    ap.add_argument("--scale", type=float, default=8.0, help="steering scale (vector has unit RMS)")
    ap.add_argument("--layers", default="1,2", help="comma-separated layers for hook_resid_post")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (default: torch.compile)")
    ap.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

    from .tiny import build_tiny_model

    model = args.model or build_tiny_model("llama")
    if args.plain_worker:  # child: plain vLLM, the plugin filtered out by VLLM_PLUGINS
        print("PLAIN_TOKENS " + json.dumps(_plain_tokens(model, args.max_tokens, args.eager)), flush=True)
        return 0

    import numpy as np
    from vllm import LLM

    from . import MIApp, SamplingParams, deploy

    d_model = json.load(open(os.path.join(model, "config.json")))["hidden_size"]
    v = np.random.default_rng(0).standard_normal(d_model).astype(np.float32)
    v /= np.sqrt((v**2).mean())
    layers = [int(x) for x in args.layers.split(",")]
    app = MIApp("demo_steer")
    app.write("add", vector=v, scale=args.scale).layers(layers).submodule("hook_resid_post")

    probe = MIApp("demo_probe")  # projection on the steering direction, after the steering
    probe.read("linear_probe", weight=v / np.linalg.norm(v)).layers([layers[-1]]).submodule("hook_resid_post")

    print(f"[demo] model {model}")
    print(f"[demo] deploying app 'demo_steer': add {args.scale} * v at blocks.{layers}.hook_resid_post "
          f"(content hash {app.content_hash()})")
    print(f"[demo] deploying app 'demo_probe': linear probe v/|v| . x at blocks.{layers[-1]}.hook_resid_post")
    llm = LLM(**_engine_kwargs(model, args.eager), additional_config=deploy(app, probe))
    off = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, mi_apps=["demo_probe"])
    on = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                        mi_apps=["demo_steer", "demo_probe"])
    # one batch: every prompt with steering off and on, side by side in the same forward passes
    outs = llm.generate(PROMPTS + PROMPTS, [off] * len(PROMPTS) + [on] * len(PROMPTS), use_tqdm=False)
    off_out, on_out = outs[: len(PROMPTS)], outs[len(PROMPTS):]
    del llm

    env = dict(os.environ, VLLM_PLUGINS="")
    cmd = [sys.executable, "-m", "vllm_xmix.demo", "--plain-worker", "--model", model,
           "--max-tokens", str(args.max_tokens)] + (["--eager"] if args.eager else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PLAIN_TOKENS ")), None)
    if line is None:
        print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
        print("[demo] plain vLLM run failed", file=sys.stderr)
        return 2
    plain = json.loads(line.removeprefix("PLAIN_TOKENS "))

    w = max(len(p) for p in PROMPTS)
    print(f"\n{'prompt':<{w}} | steering off -> steering on (scale {args.scale}); the tiny model has random "
          "weights, so its text is meaningless: what counts is that off equals plain vLLM, on differs, and "
          "the probe gives a score per token")
    changed, counts_ok, probe_up = 0, True, 0
    for p, a, b in zip(PROMPTS, off_out, on_out):
        ta, tb = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        changed += ta != tb
        print(f"{p:<{w}} | off: {ta}\n{'':<{w}} |  on: {tb}")
        print(f"{'':<{w}} | off text: {a.outputs[0].text!r}\n{'':<{w}} |  on text: {b.outputs[0].text!r}")
        pa, pb = a.mi_results["demo_probe"]["probe"], b.mi_results["demo_probe"]["probe"]
        n = len(a.prompt_token_ids) + len(ta) - 1  # processed positions: prompt + generated[:-1]
        counts_ok &= len(pa) == n and len(pb) == n and not (np.isnan(pa).any() or np.isnan(pb).any())
        probe_up += float(pb.mean()) > float(pa.mean())
        print(f"{'':<{w}} | probe (mean over {n} tokens): off {pa.mean():+.2f}  on {pb.mean():+.2f}")
    equal = [list(a.outputs[0].token_ids) for a in off_out] == plain
    print(f"\n[demo] steering off (probe on) == plain vLLM (plugin not loaded): {equal}")
    print(f"[demo] steering on changed {changed}/{len(PROMPTS)} prompts")
    print(f"[demo] one probe score per processed token: {counts_ok}; probe higher with steering on: "
          f"{probe_up}/{len(PROMPTS)}")
    return 0 if equal and changed > 0 and counts_ok and probe_up == len(PROMPTS) else 1


if __name__ == "__main__":
    sys.exit(main())
