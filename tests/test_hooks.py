"""Writes at every residual-stream hook point (TransformerLens names) of Llama, Qwen3 and Mixtral on real
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
# projection writes: app name -> (kind, hook, layers, seed, scale, value)
PROJ = {
    "abl_pre": ("ablate", "hook_resid_pre", [1, 3], 21, 3.0, None),  # scale 3: reflect past the plane
    "abl_attn": ("ablate", "hook_attn_out", [0, 1, 2, 3], 22, 1.0, None),  # Arditi-style, every layer
    "abl_mid": ("ablate", "hook_resid_mid", [1, 2], 23, 3.0, None),
    "clamp_mlp": ("clamp", "hook_mlp_out", [1], 24, 1.0, 6.0),
    "clamp_post": ("clamp", "hook_resid_post", [0, 2], 25, 1.0, -8.0),
}


def deployment():
    from vllm_xmix import MIApp, deploy

    apps = []
    for name, (hook, layers, seed) in HOOKS.items():
        a = MIApp(name)
        a.write("add", vector=unit_rms(seed), scale=SCALE).layers(layers).submodule(f"blocks.{{L}}.{hook}")
        apps.append(a)
    for name, (kind, hook, layers, seed, scale, value) in PROJ.items():
        a = MIApp(name)
        a.write(kind, vector=unit_rms(seed) * 3.0, scale=scale, value=value).layers(layers).submodule(hook)
        apps.append(a)
    return deploy(*apps)


def proj_fns(names, scales=None):
    """HF-side functions for projection apps: x -> scale * (value - x.r) r."""
    import torch

    out = {}
    for n in names:
        kind, hook, layers, seed, scale, value = PROJ[n]
        s = (scales or {}).get(n, scale)
        r = torch.from_numpy(unit_rms(seed) / np.linalg.norm(unit_rms(seed)))
        val = value or 0.0
        for L in layers:
            out.setdefault((L, hook), []).append(lambda x, r=r, s=s, val=val: s * (val - (x @ r)).unsqueeze(-1) * r)
    return out


def deltas(names, scale=SCALE):
    out = {}
    for n in names:
        hook, layers, seed = HOOKS[n]
        for L in layers:
            out[(L, hook)] = out.get((L, hook), 0) + np.float32(scale) * unit_rms(seed)
    return out


@pytest.fixture(scope="module", params=[("llama", "eager"), ("llama", "compiled"), ("qwen3", "eager"),
                                        ("qwen3", "compiled"), ("mixtral", "eager"), ("mixtral", "compiled")],
                ids=lambda p: f"{p[0]}-{p[1]}")
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


def test_ablate_and_clamp_each_hook_equal_hf(arch_engine):
    llm, hf = arch_engine
    plain = [hf.greedy(p, N) for p in PROMPTS]
    for name in PROJ:
        want = [hf.greedy(p, N, fns=proj_fns([name])) for p in PROMPTS]
        assert gen(llm, [name]) == want, name
        assert want != plain, f"{name}: the write must change this tiny model's output"


def test_projection_and_add_compose_in_order(arch_engine):
    """Apps at one site apply in deployment order: an add then an ablation of its own direction
    at another site, and per-request scales, in one request; mixed with app-free requests."""
    from vllm_xmix import SamplingParams

    llm, hf = arch_engine
    sel = [{"name": "post"}, {"name": "clamp_post", "scale": 0.5}, {"name": "abl_attn"}]
    fns = proj_fns(["clamp_post", "abl_attn"], scales={"clamp_post": 0.5})
    d = deltas(["post"])
    # at (L, resid_post) the add (deployed first) precedes the clamp
    merged = {}
    for key, v in d.items():
        merged.setdefault(key, []).append(lambda x, v=v: __import__("torch").from_numpy(v))
    for key, fl in fns.items():
        merged.setdefault(key, []).extend(fl)
    params = [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, mi_apps=sel if i % 2 == 0 else None)
              for i in range(len(PROMPTS))]
    outs = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    want = [hf.greedy(p, N, fns=merged) if i % 2 == 0 else hf.greedy(p, N) for i, p in enumerate(PROMPTS)]
    assert got == want
