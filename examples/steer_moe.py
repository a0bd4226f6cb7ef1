"""SteerMoE, expert (de)activation through the router logits (Fayyaz et al. 2026), on a tiny
random-weight Mixtral (the shipped model is dense; random weights make the routing, not the
text, the thing to look at): mask expert 0 and boost expert 3 at every layer, and read the
router logits with a capture to see where tokens go.

    python examples/steer_moe.py
"""

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import json  # noqa: E402

import numpy as np  # noqa: E402
from vllm import LLM  # noqa: E402

from vllm_xmix import MIApp, SamplingParams, deploy  # noqa: E402
from vllm_xmix.apps import steer_moe  # noqa: E402
from vllm_xmix.tiny import build_tiny_model  # noqa: E402

if __name__ == "__main__":
    model = build_tiny_model("mixtral")
    cfg = json.load(open(os.path.join(model, "config.json")))
    E, K = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    routes = MIApp("routes")
    routes.read("capture", positions="all", name="logits").layers([0]).submodule("mlp.hook_router_logits")
    app = steer_moe(E, layers="all", deactivate=[0], activate=[3], name="steer_moe")
    llm = LLM(model=model, dtype="float32", max_model_len=256, seed=0, additional_config=deploy(app, routes))
    prompt = {"prompt_token_ids": list(range(10, 42))}
    for sel in (["routes"], ["steer_moe", "routes"]):
        o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, mi_apps=sel),
                         use_tqdm=False)[0]
        logits = o.mi_results["routes"]["logits"]  # [positions, n_experts], after the router writes
        top = np.argsort(-logits, axis=1)[:, :K]
        counts = np.bincount(top.ravel(), minlength=E)
        print(f"{'+'.join(sel):<16} layer-0 top-{K} expert counts over {len(top)} positions: {counts.tolist()}; "
              f"tokens {list(o.outputs[0].token_ids)}")
