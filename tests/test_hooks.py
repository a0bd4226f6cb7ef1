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

# read apps: app name -> (hook, layers, seed); each has a probe "probe" (sigmoid on odd seeds) and
# a capture "cap" of every position
READS = {
    "rd_pre": ("hook_resid_pre", [0, 2], 31),
    "rd_attn": ("hook_attn_out", [1], 32),
    "rd_mid": ("hook_resid_mid", [1, 3], 33),
    "rd_mlp": ("hook_mlp_out", [2], 34),
    "rd_post": ("hook_resid_post", [0, 3], 35),
}
BIAS = 0.25


def deployment(fused_writes="none", extra=()):
    from vllm_xmix import deploy

    return deploy(*hook_apps(), *extra, fused_writes=fused_writes)


def hook_apps() -> list:
    """The apps of :func:`deployment`: reads, writes and projections at every hook point."""
    from vllm_xmix import MIApp

    apps = []
    for name, (hook, layers, seed) in READS.items():
        a = MIApp(name)
        a.read("linear_probe", weight=unit_rms(seed) / 8, bias=BIAS, sigmoid=bool(seed % 2)).layers(layers).submodule(hook)
        a.read("capture", name="cap").layers(layers).submodule(hook)
        apps.append(a)
    pos = MIApp("rd_pos")  # captures of generated positions and of the last prompt token
    pos.read("capture", positions="generated", name="gen").layers([2]).submodule("hook_resid_post")
    pos.read("capture", positions="last", name="last").layers([2]).submodule("hook_resid_post")
    apps.append(pos)
    for name, (hook, layers, seed) in HOOKS.items():
        a = MIApp(name)
        a.write("add", vector=unit_rms(seed), scale=SCALE).layers(layers).submodule(f"blocks.{{L}}.{hook}")
        apps.append(a)
    for name, (kind, hook, layers, seed, scale, value) in PROJ.items():
        a = MIApp(name)
        a.write(kind, vector=unit_rms(seed) * 3.0, scale=scale, value=value).layers(layers).submodule(hook)
        apps.append(a)
    return apps


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


# each fused_writes setting on one architecture: Llama the default "none" (every write through
# the op), Qwen3 "adds" (steering adds in the graph), Mixtral "all" (projections too); "norm"
# (the ops of resid_pre/mid/post replace vLLM's next add + RMSNorm) eager on Qwen3, and compiled on
# Llama as the default "auto" resolves it here
# On vLLM versions other than the primary one (marker one_version) two of them run: Llama eager
# (every write through the op) and Llama compiled with the default "auto" (the norm-hosted writes
# inside the graph); Mixtral's classes and router are built there by test_router.py
_ONE = pytest.mark.one_version
ARCH_ENGINES = [(("llama", "eager", "none"), ()), (("llama", "compiled", "none"), _ONE),
                (("qwen3", "eager", "adds"), _ONE), (("qwen3", "compiled", "adds"), _ONE),
                (("mixtral", "eager", "all"), _ONE), (("mixtral", "compiled", "all"), _ONE),
                (("llama", "compiled", "auto"), ()), (("qwen3", "eager", "norm"), _ONE)]


@pytest.fixture(scope="module", params=[pytest.param(p, marks=m, id=f"{p[0]}-{p[1]}" + ("" if p[2] == "none" else f"-fused_{p[2]}"))
                                        for p, m in ARCH_ENGINES])
def arch_engine(request, tmp_path_factory):
    from conftest import HFOracle

    from vllm_xmix.tiny import build_tiny_model

    arch, mode, fused = request.param
    model = build_tiny_model(arch, root=tmp_path_factory.mktemp(arch) / f"tiny-{arch}")
    llm = make_llm(model, mode, additional_config=deployment(fused))
    llm.mode, llm.fused_writes = mode, fused
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


def test_compiled_projections_run_inside_the_graph(arch_engine, monkeypatch):
    """With ``fused_writes="all"``, unconditional ablations and clamps at residual-stream sites
    are torch ops inside the compiled graph (``DeviceLayout.site_fused``): no row-write kernel of
    ours runs for them; with ``"adds"``, the default ``"none"`` and in eager runs the op runs them. All equal
    HF. Counted at the kernel entry point."""
    import vllm_xmix.ops as ops

    llm, hf = arch_engine
    calls = []
    real = ops.row_write_reference
    monkeypatch.setattr(ops, "row_write_reference", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    for name in ("abl_attn", "clamp_post"):
        assert gen(llm, [name]) == [hf.greedy(p, N, fns=proj_fns([name])) for p in PROMPTS], name
    if llm.mode == "eager" or llm.fused_writes != "all":
        assert calls, f"{llm.mode}, fused_writes={llm.fused_writes}: the projections ran no row-write kernel"
    else:
        assert not calls, "compiled, fused_writes='all': the projections were not fused into the graph"


def test_an_app_runs_only_its_own_entries_at_a_shared_site(arch_engine, monkeypatch):
    """blocks.2.hook_resid_post carries "post" (an add), "clamp_post" (a projection) and the
    captures of "rd_pos": a request with "post" alone applies its own add there (with the row
    kernel, the site's kernel in every variant) but not the clamp's entry nor the captures
    (``GraphVariants.site_plan``: entries of apps that are off for every token of the step are left
    out), and equals HF; with "rd_pos" on too, the captures run. Counted at the kernels' entry
    points (the CPU's reference kernels; no CUDA graphs here, so no variant nesting)."""
    import vllm_xmix.ops as ops

    llm, hf = arch_engine
    rows, reads = [], []
    real_row, real_read = ops.row_write_reference, ops.read_rows_reference
    monkeypatch.setattr(ops, "row_write_reference", lambda *a, **k: (rows.append(list(a[4])), real_row(*a, **k))[1])
    monkeypatch.setattr(ops, "read_rows_reference", lambda *a, **k: (reads.append(1), real_read(*a, **k))[1])
    assert gen(llm, ["post"]) == [hf.greedy(p, N, deltas(["post"])) for p in PROMPTS]
    assert not reads and all(len(e) == 1 for e in rows), (llm.mode, llm.fused_writes, rows[:3])
    if llm.mode == "eager" or llm.fused_writes != "all":
        assert rows, "the add at the projection's site ran no row kernel"
    assert gen(llm, ["post", "rd_pos"]) == [hf.greedy(p, N, deltas(["post"])) for p in PROMPTS]
    assert reads


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


# ------------------------------------------------------------------------------------------ reads


def close(got, want, what):
    """Within 1e-4 relative per token (relative to the token's largest magnitude)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = np.maximum(np.abs(want).reshape(len(want), -1).max(axis=1), 1.0)
    err = np.abs(got - want).reshape(len(want), -1).max(axis=1) / scale
    assert err.max() <= 1e-4, f"{what}: relative error {err.max():.2e} at position {int(err.argmax())}"


def expected_reads(hf, ids, names, deltas_=None, fns=None):
    """{(app, read, layer): expected array} from the HF oracle (writes first, then reads)."""
    import torch

    sites = sorted({(L, READS[n][0]) for n in names for L in READS[n][1]})
    rec = hf.record(ids, sites, deltas_, fns)
    out = {}
    for n in names:
        hook, layers, seed = READS[n]
        w = unit_rms(seed).astype(np.float64) / 8
        for L in layers:
            x = rec[(L, hook)].astype(np.float64)
            s = x @ w + BIAS
            out[(n, "probe", L)] = torch.sigmoid(torch.from_numpy(s)).numpy() if seed % 2 else s
            out[(n, "cap", L)] = x
    return out


def result(res, app, read, layer):
    r = res[app][read]
    return r[layer] if isinstance(r, dict) else r


def check_reads(o, prompt, hf, names, deltas_=None, fns=None):
    toks = list(o.outputs[0].token_ids)
    ids = list(prompt) + toks[:-1]  # the positions vLLM processed
    for (app, read, L), want in expected_reads(hf, ids, names, deltas_, fns).items():
        got = result(o.mi_results, app, read, L)
        assert got.dtype == np.float32
        assert len(got) == len(ids), f"{app}.{read}@{L}: {len(got)} values for {len(ids)} processed tokens"
        assert not np.isnan(got).any(), f"{app}.{read}@{L}: missing values"
        close(got, want, f"{app}.{read}@{L}")


def test_reads_each_hook_equal_hf_and_change_nothing(arch_engine):
    from vllm_xmix import SamplingParams

    llm, hf = arch_engine
    plain = gen(llm, None)
    names = list(READS)
    p = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, mi_apps=names)
    outs = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], p, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == plain, "a read-only app changed the tokens"
    for o, q in zip(outs, PROMPTS):
        check_reads(o, q, hf, names)
    none = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert none[0].mi_results is None


def test_reads_see_writes_and_mixed_batch_equals_solo(arch_engine):
    """At one hook point the writes apply first, then the reads; requests with different read and
    write apps in one batch get what they get alone."""
    from vllm_xmix import SamplingParams

    llm, hf = arch_engine
    sels = [["post", "rd_post", "abl_mid", "rd_mid"], ["rd_pre"], None, [{"name": "rd_attn"}, {"name": "attn", "scale": -2.0}]]
    writes = [(deltas(["post"]), proj_fns(["abl_mid"])), (None, None), (None, None), (deltas(["attn"], -2.0), None)]
    params = [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, mi_apps=s) for s in sels]
    batch = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], params, use_tqdm=False)
    for i, (o, q, s) in enumerate(zip(batch, PROMPTS, sels)):
        d, f = writes[i]
        assert list(o.outputs[0].token_ids) == hf.greedy(q, N, d, f)
        if s is None:
            assert o.mi_results is None
            continue
        names = [x if isinstance(x, str) else x["name"] for x in s]
        check_reads(o, q, hf, [n for n in names if n in READS], d, f)
        solo = llm.generate([{"prompt_token_ids": q}], params[i], use_tqdm=False)[0]
        for app, reads in o.mi_results.items():
            for read, v in reads.items():
                for L, arr in (v.items() if isinstance(v, dict) else [(None, v)]):
                    s_arr = result(solo.mi_results, app, read, L) if L is not None else solo.mi_results[app][read]
                    # batch vs solo differ only by fp32 summation order (other GEMM shapes): the
                    # absolute bound scales with the activations (|x| ~ 20 after a few layers)
                    atol = 1e-5 * max(1.0, float(np.abs(s_arr).max()))
                    np.testing.assert_allclose(arr, s_arr, rtol=1e-5, atol=atol, err_msg=f"{app}.{read}@{L}")


def test_capture_positions_generated_and_last(arch_engine):
    from vllm_xmix import SamplingParams

    llm, hf = arch_engine
    p = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, mi_apps=["rd_pos"])
    outs = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], p, use_tqdm=False)
    for o, q in zip(outs, PROMPTS):
        toks = list(o.outputs[0].token_ids)
        x = hf.record(list(q) + toks[:-1], [(2, "hook_resid_post")])[(2, "hook_resid_post")]
        P = len(q)
        got = o.mi_results["rd_pos"]
        assert got["gen"].shape == (N, x.shape[1])  # one row per generated token
        close(got["gen"], x[P - 1:], "gen")
        assert got["last"].shape == (x.shape[1],)
        close(got["last"][None], x[P - 1][None], "last")


def test_norm_hosts_the_residual_sites(arch_engine, monkeypatch):
    """With ``fused_writes="norm"`` the ops of resid_pre (layers >= 1), resid_mid and resid_post
    (all but the last layer) replace vLLM's next residual add + RMSNorm (``ops.hook_norm_``):
    vLLM's add + norm then runs from the op, with apps on and off, and the values equal HF. Other
    settings leave vLLM's norms alone. Counted at the op's norm call."""
    import vllm_xmix.ops as ops

    llm, hf = arch_engine
    calls = []
    real = ops.plain_add_rms_norm
    monkeypatch.setattr(ops, "plain_add_rms_norm", lambda *a: (calls.append(1), real(*a))[1])
    assert gen(llm, ["post", "mid"]) == [hf.greedy(p, N, deltas(["post", "mid"])) for p in PROMPTS]
    steered = len(calls)
    assert gen(llm, None) == [hf.greedy(p, N) for p in PROMPTS]
    resolved = llm.llm_engine.vllm_config.additional_config["xmix"]["fused_writes"]
    if llm.fused_writes in ("norm", "auto"):
        assert resolved == "norm", "auto: an unquantized one-rank engine hosts the writes in the norms"
        assert steered and len(calls) > steered, "the norms hosting the sites did not run the op"
    else:
        assert resolved == llm.fused_writes and not calls


def test_a_norm_none_of_whose_sites_is_on_runs_as_vllms(arch_engine):
    """With the norms hosting the residual sites, a step whose apps write at some layers only
    takes the per-site path at the norms that host those apps' sites: every other norm calls
    vLLM's add + RMSNorm directly, as with no app on (host time per norm in every step that runs
    without CUDA graphs). Counted per site at the op (``XmixState.calls``, which the per-site
    path counts), tokens against HF."""
    llm, hf = arch_engine
    if llm.fused_writes not in ("norm", "auto"):
        pytest.skip("the norms host sites only with fused_writes 'norm' or 'auto'")
    st = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner \
        .compilation_config.static_forward_context["vllm_xmix"]
    assert gen(llm, ["post"]) == [hf.greedy(p, N, deltas(["post"])) for p in PROMPTS]  # (the self-check passes)
    assert st.verified
    # the sites the norms host (keyed by their float weights; the other hooked modules' keys are
    # one-element int8 buffers, whose op counts every call)
    hosted = {s for module, attr, sites in st.site_keys if getattr(module, attr).is_floating_point()
              for s in sites if s >= 0}
    mid = {st.sites[(L, "hook_resid_mid")] for L in HOOKS["mid"][1]}
    assert mid <= hosted and len(hosted - mid) >= 4, (sorted(hosted), sorted(mid))
    before = list(st.calls)
    assert gen(llm, ["mid"]) == [hf.greedy(p, N, deltas(["mid"])) for p in PROMPTS]
    grew = {s for s in hosted if st.calls[s] > before[s]}
    assert grew == mid, f"norms outside the app's sites took the per-site path: {sorted(grew - mid)}"
