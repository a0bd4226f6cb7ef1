"""Writes at every residual-stream hook point (TransformerLens names) of Llama and Qwen3 on real
vLLM (CPU, fp32, eager and compiled) against the HF-transformers oracle with plain hooks."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PROMPTS, close_llm, make_llm, unit_rms

N = 8
HOOKS = {  # app name -> (hook, layers, seed)
    "pre": ("hook_resid_pre", [0, 2], 11),  # layer 0: the embeddings (vLLM's residual is None there)
    "attn": ("hook_attn_out", [1, 2], 12),
    "mid": ("hook_resid_mid", [1, 3], 13),
    "mlp": ("hook_mlp_out", [0, 2], 14),
    "post": ("hook_resid_post", [1, 2], 15),
}
SCALE = 3.0


def deployment():
    from vllm_xmix import MIApp, deploy

    apps = []
    for name, (hook, layers, seed) in HOOKS.items():
        a = MIApp(name)
        a.write("add", vector=unit_rms(seed), scale=SCALE).layers(layers).submodule(f"blocks.{{L}}.{hook}")
        apps.append(a)
    return deploy(*apps)


def deltas(names, scale=SCALE):
    out = {}
    for n in names:
        hook, layers, seed = HOOKS[n]
        for L in layers:
            out[(L, hook)] = out.get((L, hook), 0) + np.float32(scale) * unit_rms(seed)
    return out


@pytest.fixture(scope="module", params=[("llama", "eager"), ("llama", "compiled"), ("qwen3", "eager"),
                                        ("qwen3", "compiled")], ids=lambda p: f"{p[0]}-{p[1]}")
def arch_engine(request, tmp_path_factory):
    from conftest import HFOracle

    from vllm_xmix.tiny import build_tiny_model

    arch, mode = request.param
    model = build_tiny_model(arch, root=tmp_path_factory.mktemp(arch) / f"tiny-{arch}")
    llm = make_llm(model, mode, additional_config=deployment())
    yield llm, HFOracle(model)
    close_llm(llm)


def gen(llm, apps, n=N):
    from vllm_xmix import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, mi_apps=apps)
    outs = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], p, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_each_hook_point_equals_hf(arch_engine):
    llm, hf = arch_engine
    plain = [hf.greedy(p, N) for p in PROMPTS]
    assert gen(llm, None) == plain
    for name in HOOKS:
        want = [hf.greedy(p, N, deltas([name])) for p in PROMPTS]
        assert gen(llm, [name]) == want, name
        assert want != plain, f"{name}: steering must change this tiny model's output"


def test_all_hook_points_at_once_and_mixed_batch(arch_engine):
    from vllm_xmix import SamplingParams

    llm, hf = arch_engine
    names = list(HOOKS)
    assert gen(llm, names) == [hf.greedy(p, N, deltas(names)) for p in PROMPTS]
    # one batch: a different hook point per request, one request without apps
    sels = [["pre"], ["mid", "mlp"], None, [{"name": "attn", "scale": -2.0}]]
    params = [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, mi_apps=s) for s in sels]
    outs = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    want = [hf.greedy(PROMPTS[0], N, deltas(["pre"])), hf.greedy(PROMPTS[1], N, deltas(["mid", "mlp"])),
            hf.greedy(PROMPTS[2], N), hf.greedy(PROMPTS[3], N, deltas(["attn"], -2.0))]
    assert got == want
