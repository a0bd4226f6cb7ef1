"""GPU check for the hook surface (issue 3): every hook point and write kind, CUDA graphs vs eager.

One engine per process (``--eager`` or not); both print ``{app: tokens}`` to ``--out``; compare
with ``--compare A.json B.json``. The ``none`` entry (no app) is the control: plain vLLM's own
eager-vs-graphs agreement in bf16 bounds what the apps can show.

usage (H200, kit sourced):
  python3 benchmarks/hooks_check.py --model benchmarks/models/llama31_8b --out $OUT/g.json
  python3 benchmarks/hooks_check.py --model benchmarks/models/llama31_8b --eager --out $OUT/e.json
  python3 benchmarks/hooks_check.py --compare $OUT/g.json $OUT/e.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np


def apps_for(cfg: dict):
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
    return out


def run(args) -> None:
    from vllm import LLM, SamplingParams

    from vllm_xmix import deploy

    cfg = json.load(open(os.path.join(args.model, "config.json")))
    apps = apps_for(cfg)
    t0 = time.time()
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=1024, enforce_eager=args.eager, seed=0, additional_config=deploy(*apps),
              gpu_memory_utilization=args.gpu_mem)
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(10, cfg["vocab_size"] - 10, int(k)).tolist()}
               for k in rng.integers(16, 200, args.prompts)]
    res = {"startup_s": round(time.time() - t0, 1), "eager": args.eager, "tokens": {}}
    for name in ["none"] + [a.name for a in apps]:
        extra = None if name == "none" else {"xmix": {"apps": [{"name": name}]}}
        sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, extra_args=extra)
        res["tokens"][name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    json.dump(res, open(args.out, "w"))
    print("DONE", args.out, res["startup_s"], flush=True)


def compare(a_path: str, b_path: str) -> None:
    a, b = json.load(open(a_path)), json.load(open(b_path))
    base = a["tokens"]["none"]
    for name, ta in a["tokens"].items():
        tb = b["tokens"][name]
        same = sum(x == y for x, y in zip(ta, tb))
        changed = sum(x != y for x, y in zip(ta, base)) if name != "none" else 0
        print(f"{name:20s} graphs==eager {same}/{len(ta)}   changed vs no-app {changed}/{len(ta)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--gpu-mem", type=float, default=0.9)
    ap.add_argument("--compare", nargs=2)
    a = ap.parse_args()
    compare(*a.compare) if a.compare else run(a)
