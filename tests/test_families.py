"""Every hook point x write / read kind on each further architecture family (``adapters/families.py``)
on real vLLM (CPU, fp32) against the HF-transformers oracle with plain hooks, router hooks on the
MoE families, and each family's documented meaning of the hook points.

Cost: ONE eager engine per family, deployed with every app of ``test_hooks`` at once (selected
per request), plus ``[compiled]`` engines only where the compiled path differs from eager: a
single-tensor stream with every write fused into the graph (Granite: resid_mid's in-place copy)
and a router taken out of ``FusedMoE`` into the graph (Qwen3-MoE). Llama, Qwen3 and Mixtral are
covered by ``test_hooks.py`` / ``test_router.py``. The whole file: 3.5 min on a quiet 2-core
machine (nine engines; ten with Gemma 3; DeepSeek-V2, GPT-OSS and OLMo 2 add one each).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import HF_PATHS, PROMPTS, HFOracle, close_llm, make_llm, unit_rms, unserved_here
from test_hooks import HOOKS, N, PROJ, READS, check_reads, close, deltas, gen, hook_apps, proj_fns

# family -> how to build and check it: ``paths`` (HF module names, conftest.HF_PATHS), ``attn`` (HF
# attention implementation where HF's default cannot express the model: soft-capping),
# ``k`` (the factor on attn_out / mlp_out in the stream: Granite's residual_multiplier),
# ``router`` (layers with a router). DeepSeek-V2 runs its MHA form (conftest: VLLM_MLA_DISABLE=1, no
# MLA backend on CPU) with one attention head (vllm_xmix.tiny: vLLM 0.26's CPU rotary kernel
# mis-rotates a multi-head 3-D query). ``sinks_bf16``: GPT-OSS's float32 engine gets its
# (bfloat16-exact) attention sinks in bfloat16, the only dtype vLLM 0.26's CPU kernel takes them in
FAMILIES = {
    "mistral": {},
    "qwen2": {},
    "phi3": {},
    "granite": {"k": 0.5},
    "qwen3_moe": {"router": [0, 1, 2, 3]},
    "gemma2": {"paths": "gemma2", "attn": "eager"},
    "gemma3": {"paths": "gemma2", "attn": "eager"},
    "olmo3": {"paths": "olmo3"},
    "deepseek_v2": {"router": [1, 2, 3]},  # layer 0 dense (first_k_dense_replace=1)
    "gpt_oss": {"paths": "gpt_oss", "attn": "eager", "router": [0, 1, 2, 3], "sinks_bf16": True},
    # an OLMo 2 checkpoint served by vLLM's OLMo 3 classes (its config.json rewritten as OLMo 3's:
    # olmo2_as_olmo3), against HF's OLMo 2 on the original checkpoint
    "olmo2": {"paths": "olmo3", "as_olmo3": True},
}
N_EXPERTS = 4
MASK = [0.0, 0.0, -math.inf, 0.0]  # expert 2 off
BOOST = [4.0, 0.0, 0.0, -1.0]
BOOST_LAYERS = [1, 2]
PROBE_W = [0.5, -1.0, 0.25, 2.0]
MEANING_LAYERS = [1, 2]
TOK_SET = [17, 300, 200, 12]  # token ids in PROMPTS: the token-conditioned write fires in every prompt but the last
TOK_V = unit_rms(7)
TOK_LAYERS = [1, 2]
TOK_SCALE = 4.0
_HOOK_NAMES = ["hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"]


def extra_apps(fam: str) -> list:
    """Beside ``test_hooks``' apps: captures of all five hooks at two layers (the meaning test)
    and, on MoE families, router writes and reads."""
    from vllm_xmix import MIApp

    out = []
    m = MIApp("meaning")
    for h in _HOOK_NAMES:
        m.read("capture", name=h).layers(MEANING_LAYERS).submodule(h)
    out.append(m)
    t = MIApp("tokcond")  # the family's token embedding hook (the step's token ids)
    t.write("add", vector=TOK_V, scale=TOK_SCALE).layers(TOK_LAYERS).submodule("hook_resid_post").cond(tokens=TOK_SET)
    out.append(t)
    rl = FAMILIES[fam].get("router")
    if rl:
        a = MIApp("mask2")
        a.write("router_bias", vector=MASK).layers(rl).submodule("mlp.hook_router_logits")
        b = MIApp("boost")
        b.write("router_bias", vector=BOOST, scale=1.0).layers(BOOST_LAYERS).submodule("mlp.hook_router_logits")
        r = MIApp("rlog")
        r.read("capture", name="logits").layers([1, 3]).submodule("mlp.hook_router_logits")
        r.read("linear_probe", weight=PROBE_W, bias=0.5).layers([1, 3]).submodule("mlp.hook_router_logits")
        out += [a, b, r]
    return out


def _eager(fam: str):
    """A family's eager engine, on every tested vLLM; skipped where the installed vLLM does not
    serve the architecture with the adapter's classes (OLMo 3, and so OLMo 2 checkpoints served as
    OLMo 3, on vLLM 0.32: refused, tests/test_plugin.py)."""
    from vllm_xmix.tiny import TINY_SPECS

    arch = "Olmo3ForCausalLM" if FAMILIES[fam].get("as_olmo3") else TINY_SPECS[fam]["arch"]
    why = unserved_here(arch)
    marks = [pytest.mark.skip(reason=why)] if why else []
    return pytest.param((fam, "eager", "auto"), id=f"{fam}-eager", marks=marks)


ENGINES = [_eager(f) for f in FAMILIES] + [
    # [compiled]: the heaviest parametrizations (measured on 2 cores: 17-26 s to start with
    # torch.compile, Inductor's cache as earlier runs left it; the eager engines 14-26 s)
    pytest.param(("granite", "compiled", "all"), id="granite-compiled-fused_all",
                 marks=[pytest.mark.slow, pytest.mark.one_version]),
    pytest.param(("qwen3_moe", "compiled", "auto"), id="qwen3_moe-compiled",
                 marks=[pytest.mark.slow, pytest.mark.one_version]),
]


def olmo2_as_olmo3(src, dst) -> str:
    """The OLMo 2 checkpoint ``src`` as an OLMo 3 one in ``dst`` (weights and tokenizer linked, the
    config rewritten; docs/hooks.md): ``model_type`` "olmo3", ``architectures``
    ["Olmo3ForCausalLM"], every layer "full_attention" (OLMo 3's default slides 3 of 4), and OLMo
    2's rope per layer type (OLMo 3's default rope_theta is 500000)."""
    import json
    from pathlib import Path

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    c = json.loads((src / "config.json").read_text())
    rope = c["rope_parameters"]
    c.update(model_type="olmo3", architectures=["Olmo3ForCausalLM"], layer_types=["full_attention"] * c["num_hidden_layers"],
             rope_parameters={"full_attention": dict(rope), "sliding_attention": dict(rope)})
    (dst / "config.json").write_text(json.dumps(c, indent=1))
    return str(dst)


def _sinks_to_bf16(model) -> None:
    """GPT-OSS: vLLM 0.26's CPU attention kernel reads attention sinks only as bfloat16 (float32
    sinks: "expected scalar type BFloat16 but found Float", with or without apps); the tiny
    checkpoint's sinks are bfloat16-exact (``tiny.py``), so the same values in bfloat16 leave the
    float32 engine computing exactly the checkpoint's model (the kernel widens them to float32)."""
    for layer in model.model.layers:
        layer.attn.sinks.data = layer.attn.sinks.data.to(torch.bfloat16)


@pytest.fixture(scope="module", params=ENGINES)
def family_engine(request, tmp_path_factory):
    from vllm_xmix import deploy
    from vllm_xmix.tiny import build_tiny_model

    fam, mode, fused = request.param
    info = FAMILIES[fam]
    model = build_tiny_model(fam, root=tmp_path_factory.mktemp(fam) / f"tiny-{fam}")
    served = olmo2_as_olmo3(model, tmp_path_factory.mktemp("olmo3") / "tiny") if info.get("as_olmo3") else model
    llm = make_llm(served, mode, additional_config=deploy(*hook_apps(), *extra_apps(fam), fused_writes=fused))
    if info.get("sinks_bf16"):
        llm.apply_model(_sinks_to_bf16)
    llm.mode, llm.fused_writes, llm.family = mode, fused, fam
    yield llm, HFOracle(model, HF_PATHS[info.get("paths", "llama")], info.get("attn"))
    close_llm(llm)


def test_every_write_at_every_hook_equals_hf(family_engine):
    """Activation addition at each of the five hook points, then directional ablation and clamp at
    several: tokens equal HF with the same write in a plain hook, and the write changed them."""
    llm, hf = family_engine
    plain = [hf.greedy(p, N) for p in PROMPTS]
    assert gen(llm, None) == plain
    for name in HOOKS:
        want = [hf.greedy(p, N, deltas([name])) for p in PROMPTS]
        assert gen(llm, [name]) == want, name
        assert want != plain, f"{name}: steering must change this tiny model's output"
    for name in PROJ:
        want = [hf.greedy(p, N, fns=proj_fns([name])) for p in PROMPTS]
        assert gen(llm, [name]) == want, name
        assert want != plain, f"{name}: the write must change this tiny model's output"


@pytest.mark.one_version  # (every family's classes are built and written through on each version)
def test_every_read_at_every_hook_equals_hf_in_a_mixed_batch(family_engine):
    """Probes and captures at every hook point (read-only: tokens unchanged), and one batch of
    requests with different reads and writes (one without apps), each equal to HF."""
    from vllm_xmix import SamplingParams

    llm, hf = family_engine
    names = list(READS)
    p = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, mi_apps=names)
    outs = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], p, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf.greedy(q, N) for q in PROMPTS]
    for o, q in zip(outs, PROMPTS):
        check_reads(o, q, hf, names)
    sels = [["post", "rd_post", "abl_mid", "rd_mid"], ["rd_pre", "clamp_mlp"], None,
            [{"name": "rd_attn"}, {"name": "attn", "scale": -2.0}, "rd_mlp"]]
    writes = [(deltas(["post"]), proj_fns(["abl_mid"])), (None, proj_fns(["clamp_mlp"])), (None, None),
              (deltas(["attn"], -2.0), None)]
    params = [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, mi_apps=s) for s in sels]
    batch = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], params, use_tqdm=False)
    for o, q, s, (d, f) in zip(batch, PROMPTS, sels, writes):
        assert list(o.outputs[0].token_ids) == hf.greedy(q, N, d, f)
        if s is None:
            assert o.mi_results is None
            continue
        names = [x if isinstance(x, str) else x["name"] for x in s]
        check_reads(o, q, hf, [n for n in names if n in READS], d, f)


@pytest.mark.one_version  # (every family's classes are built and written through on each version)
def test_hook_points_mean_what_the_table_says(family_engine):
    """``docs/hooks.md``'s meaning of the five hooks on this family, from vLLM's own captures:
    ``resid_mid = resid_pre + k attn_out``, ``resid_post = resid_mid + k mlp_out`` (k: Granite's
    residual_multiplier, else 1; on Gemma 2 / OLMo 3 attn_out / mlp_out are the outputs of the
    norms after attention / MLP, which is what makes the identities hold there) and
    ``resid_pre[L+1] = resid_post[L]``; and the values equal HF's at the family's HF modules."""
    from vllm_xmix import SamplingParams

    llm, hf = family_engine
    k = FAMILIES[llm.family].get("k", 1.0)
    p = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, mi_apps=["meaning"])
    outs = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], p, use_tqdm=False)
    for o, q in zip(outs, PROMPTS):
        got = {h: o.mi_results["meaning"][h] for h in _HOOK_NAMES}
        for L in MEANING_LAYERS:
            v = {h: got[h][L].astype(np.float64) for h in _HOOK_NAMES}
            close(v["hook_resid_mid"], v["hook_resid_pre"] + k * v["hook_attn_out"], f"resid_mid@{L}")
            close(v["hook_resid_post"], v["hook_resid_mid"] + k * v["hook_mlp_out"], f"resid_post@{L}")
            assert np.abs(v["hook_attn_out"]).max() > 1e-3 and np.abs(v["hook_mlp_out"]).max() > 1e-3
        close(got["hook_resid_pre"][2], got["hook_resid_post"][1], "resid_pre[2] == resid_post[1]")
        ids = list(q) + list(o.outputs[0].token_ids)[:-1]
        rec = hf.record(ids, [(L, h) for L in MEANING_LAYERS for h in _HOOK_NAMES])
        for (L, h), want in rec.items():
            close(got[h][L], want, f"{h}@{L} vs HF")


def test_token_condition_equals_hf(family_engine):
    """A write conditioned on the token at each position (``cond(tokens=...)``, SEAL) needs the
    step's token ids, recorded at the family's token embedding: tokens equal HF adding the vector
    at exactly the positions holding one of the tokens, and the write changed them."""
    llm, hf = family_engine
    S = set(TOK_SET)
    delta = torch.from_numpy(TOK_SCALE * TOK_V)

    def want(prompt):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(N):
                m = torch.tensor([t in S for t in ids], dtype=torch.float32)[None, :, None]
                handles = [h for L in TOK_LAYERS for h in hf._register(L, "hook_resid_post", lambda x, m=m: m * delta)]
                try:
                    ids.append(int(hf.model(torch.tensor([ids])).logits[0, -1].argmax()))
                finally:
                    for h in handles:
                        h.remove()
        return ids[len(prompt):]

    ref = [want(p) for p in PROMPTS]
    assert ref != [hf.greedy(p, N) for p in PROMPTS], "the token-conditioned write must change this tiny model's output"
    assert gen(llm, ["tokcond"]) == ref


def test_router_hooks_equal_hf_and_fire(family_engine):
    """MoE families: a ``-inf`` router mask and a boost equal HF with the bias added inside its
    router before softmax / top-k (a hook that silently did not fire would leave the tokens
    plain: the oracle's tokens differ from plain ones, and the masked expert is never selected in
    HF); masked and unmasked requests share a batch; router-logit reads equal HF's logits."""
    llm, hf = family_engine
    rl = FAMILIES[llm.family].get("router")
    if not rl:
        pytest.skip("a dense family: no router")
    from vllm_xmix import SamplingParams

    def sp(apps):
        return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, mi_apps=apps)

    plain = [hf.greedy(p, N) for p in PROMPTS]
    seen = []
    with hf.router_bias({L: torch.tensor(MASK) for L in rl}, seen):
        want_mask = [hf.greedy(p, N) for p in PROMPTS]
    logits = [s[0] if isinstance(s, tuple) else s for s in seen]
    assert seen and all(not (x.reshape(-1, N_EXPERTS).argmax(-1) == 2).any() for x in logits)
    assert all(torch.isneginf(x.reshape(-1, N_EXPERTS)[:, 2]).all() for x in logits), "oracle: the mask did not apply"
    boost = {L: torch.tensor(BOOST) for L in BOOST_LAYERS}
    with hf.router_bias(boost):
        want_boost = [hf.greedy(p, N) for p in PROMPTS]
    assert want_mask != plain and want_boost != plain
    from vllm_xmix.adapters import SUPPORTED_ARCHITECTURES
    from vllm_xmix.adapters.base import submodule

    ad = SUPPORTED_ARCHITECTURES[llm.llm_engine.vllm_config.model_config.architectures[0]]
    if ad.gate_in_experts:  # the router layers compute their logits in the block, where the hook is
        # (the runner routes internally while it holds a gate: vLLM 0.26's `is_internal_router`;
        # dense layers have no experts)
        internal = llm.apply_model(lambda m: [e.gate is not None for e in (submodule(layer, ad.gate_in_experts)
                                                                          for layer in m.model.layers) if e is not None])
        assert internal == [[False] * len(rl)], internal
    assert gen(llm, ["mask2"]) == want_mask
    assert gen(llm, ["boost"]) == want_boost
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [sp(["mask2"] if i % 2 else None)
                                                                   for i in range(len(PROMPTS))], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [want_mask[i] if i % 2 else plain[i]
                                                            for i in range(len(PROMPTS))]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp(["boost", "rlog"]), use_tqdm=False)
    for o, p in zip(outs, PROMPTS):
        ids = list(p) + list(o.outputs[0].token_ids)[:-1]
        with hf.router_bias(boost):
            assert list(o.outputs[0].token_ids) == hf.greedy(p, N)
            rec = hf.record(ids, [(1, "mlp.hook_router_logits"), (3, "mlp.hook_router_logits")])
        for L in (1, 3):
            x = rec[(L, "mlp.hook_router_logits")]
            assert x.shape == (len(ids), N_EXPERTS)
            close(o.mi_results["rlog"]["logits"][L], x, f"logits@{L}")
            close(o.mi_results["rlog"]["probe"][L], x.astype(np.float64) @ np.array(PROBE_W) + 0.5, f"probe@{L}")


def _moe_with_a_dense_first_layer(arch: str, path) -> None:
    """A 3-layer random MoE checkpoint of ``arch`` whose layer 0 is dense (Qwen3-MoE's
    ``mlp_only_layers``, DeepSeek-V2's ``first_k_dense_replace``)."""
    import transformers

    common = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_experts_per_tok=2,
                  moe_intermediate_size=64)
    if arch == "Qwen3MoeForCausalLM":
        cfg = transformers.Qwen3MoeConfig(**common, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                          num_experts=4, mlp_only_layers=[0])
    else:
        cfg = transformers.DeepseekV2Config(**common, num_attention_heads=1, num_key_value_heads=1, q_lora_rank=None,
                                            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
                                            n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                                            n_group=1, topk_group=1)
    getattr(transformers, arch)(cfg).save_pretrained(path)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM",
                                  "DeepseekV2ForCausalLM"])
def test_router_hook_on_a_dense_layer_is_refused(tmp_path, arch):
    """A MoE model's dense layers (Qwen3-MoE's ``mlp_only_layers``, DeepSeek-V2's first
    ``first_k_dense_replace`` layers) have no router: a router hook there, or on ``"all"`` layers,
    is refused at engine start naming the layers that have one."""
    from vllm_xmix import MIApp, deploy

    _moe_with_a_dense_first_layer(arch, tmp_path)
    for layers in ([0, 1], "all"):
        a = MIApp("r")
        a.write("router_bias", vector=MASK).layers(layers).submodule("mlp.hook_router_logits")
        with pytest.raises(ValueError, match=rf"apps\.0\(r\)\.ops\.0\.layers: layer 0 of {arch} has a "
                                             r"dense MLP, no router \(layers with a router: \[1, 2\]\)"):
            make_llm(str(tmp_path), "eager", additional_config=deploy(a), skip_tokenizer_init=True)


def test_deepseek_v2_in_float16_with_a_routed_scaling_factor_is_refused(tmp_path):
    """vLLM's DeepSeek-V2 layer in float16 carries the stream divided by ``routed_scaling_factor``
    (its overflow guard): apps on it are refused at engine start, naming the dtype and the factor."""
    import transformers

    from vllm_xmix import MIApp, deploy

    transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.0)).save_pretrained(tmp_path)
    a = MIApp("a")
    a.write("add", vector=unit_rms(1)).layers([0])
    with pytest.raises(ValueError, match=r"additional_config\.xmix: dtype float16 of DeepseekV2ForCausalLM: in "
                                         r"float16 vLLM carries this model's residual stream divided by "
                                         r"routed_scaling_factor 2\.0"):
        make_llm(str(tmp_path), "eager", dtype="float16", additional_config=deploy(a), skip_tokenizer_init=True)


def test_a_family_served_by_the_transformers_backend_is_refused(tmp_path):
    """OLMo 2 has no vLLM decoder layer of its own in vLLM 0.26 (its registry maps
    ``Olmo2ForCausalLM`` to the Transformers backend): apps on it are refused at engine start,
    naming the architecture (the checkpoint with an OLMo 3 config runs: ``olmo2_as_olmo3``)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    from vllm_xmix import MIApp, deploy

    Olmo2ForCausalLM(Olmo2Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path)
    a = MIApp("a")
    a.write("add", vector=unit_rms(1)).layers([0])
    with pytest.raises(ValueError, match=r"architecture \['Olmo2ForCausalLM'\] is not supported by vllm-xmix"):
        make_llm(str(tmp_path), "eager", additional_config=deploy(a), skip_tokenizer_init=True)


def test_every_declared_family_is_tested_and_documented():
    """Each declaration in ``adapters/families.py`` has a tiny model, runs here or in
    ``test_hooks.py``, and has its row in ``docs/hooks.md``'s family table and its name in the
    README's architecture list."""
    from pathlib import Path

    from vllm_xmix.adapters import SUPPORTED_ARCHITECTURES
    from vllm_xmix.tiny import TINY_SPECS

    root = Path(__file__).resolve().parents[1]
    table = (root / "docs" / "hooks.md").read_text()
    readme = (root / "README.md").read_text()
    tiny = {spec["arch"]: name for name, spec in TINY_SPECS.items()}
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in tiny, f"{arch}: no tiny model in vllm_xmix.tiny.TINY_SPECS"
        assert tiny[arch] in FAMILIES or tiny[arch] in ("llama", "qwen3", "mixtral"), f"{arch}: not tested"
        assert f"`{arch}`" in table, f"{arch}: no row in docs/hooks.md"
        assert f"`{arch}`" in readme, f"{arch}: not in README's architecture list"
