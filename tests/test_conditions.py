"""Conditional writes on real vLLM (CPU, fp32, tiny Llama) against HF-transformers
references with plain PyTorch hooks: SEAL-style token-triggered steering (current / previous
token in a set, all or generated positions) and CAST-style activation-triggered steering (a
cosine-similarity read at layer 0 decides writes at layers 2-3, per token or per request from the
mean over the prompt). Plus the correctness contracts: chunk sizes, prefix caching, mixed
batches, slots freed on abort."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import close_llm, make_llm, unit_rms

N = 10
V = unit_rms(51)
C = unit_rms(52)
SEAL_SET = [300, 42, 540, 858, 651, 17, 337]
SEAL_LAYERS, CAST_LAYERS, READ_LAYER = [1, 2], [2, 3], 0
SCALE = 6.0
LONG = [int(x) for x in np.random.default_rng(7).integers(3, 1000, size=70)]
PROMPTS = [[5, 17, 300, 42, 9], [100, 200, 300], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           [900, 3, 450], LONG[:40], LONG[20:70]]


def cos_at(hf, ids):
    """cos(x, C) at blocks.0.hook_resid_post for every position of ids (HF, no writes below)."""
    x = hf.record(ids, [(READ_LAYER, "hook_resid_post")])[(READ_LAYER, "hook_resid_post")].astype(np.float64)
    c = C.astype(np.float64) / np.linalg.norm(C)
    return (x @ c) / np.linalg.norm(x, axis=1)


@pytest.fixture(scope="module")
def thresholds(hf):
    """CAST threshold: the median of the prompts' mean similarity, so prompts fall on both sides;
    per-token threshold: the median over all prompt positions."""
    means = [cos_at(hf, p).mean() for p in PROMPTS]
    allv = np.concatenate([cos_at(hf, p) for p in PROMPTS])
    t_req = float(np.median(means))
    assert min(abs(m - t_req) for m in means) > 1e-4  # no knife edge
    return t_req, float(np.median(allv))


def deployment(t_req: float, t_tok: float):
    from vllm_xmix import MIApp, deploy

    apps = []
    for name, kw in (("seal", dict(tokens=SEAL_SET)), ("seal_prev", dict(tokens_prev=SEAL_SET)),
                     ("seal_gen", dict(tokens=SEAL_SET, positions="generated"))):
        a = MIApp(name)
        a.write("add", vector=V, scale=SCALE).layers(SEAL_LAYERS).submodule("hook_resid_post").cond(**kw)
        apps.append(a)
    cast = MIApp("cast")
    cast.read("cosine", weight=C, buffer="sim", scope="request").layers([READ_LAYER]).submodule("hook_resid_post")
    cast.write("add", vector=V, scale=SCALE).layers(CAST_LAYERS).cond(buffer="sim", op=">", threshold=t_req)
    apps.append(cast)
    tok = MIApp("cast_tok")
    tok.read("cosine", weight=C, buffer="sim").layers([READ_LAYER]).submodule("hook_resid_post")
    tok.write("add", vector=V, scale=SCALE).layers(CAST_LAYERS).cond(buffer="sim", op="<=", threshold=t_tok)
    apps.append(tok)
    always = MIApp("always")
    always.write("add", vector=V, scale=SCALE).layers(SEAL_LAYERS)
    apps.append(always)
    return deploy(*apps)


# ----------------------------------------------------------------------------------- references


def hf_greedy_masked(hf, prompt, n, layers, maskfn):
    """Greedy decoding (full recompute) adding SCALE * V at blocks.{L}.hook_resid_post for L in
    ``layers`` at the positions where ``maskfn(ids, P)`` ([len(ids)] bool) holds."""
    ids, P = list(prompt), len(prompt)
    delta = torch.from_numpy(SCALE * V)
    with torch.no_grad():
        for _ in range(n):
            m = torch.tensor(maskfn(ids, P), dtype=torch.float32)[None, :, None]
            handles = []
            for L in layers:
                handles += hf._register(L, "hook_resid_post", lambda x, m=m: m * delta)
            try:
                logits = hf.model(torch.tensor([ids])).logits[0, -1]
            finally:
                for h in handles:
                    h.remove()
            ids.append(int(logits.argmax()))
    return ids[P:]


def ref(hf, name, prompt, thresholds, n=N):
    t_req, t_tok = thresholds
    S = set(SEAL_SET)
    if name is None:
        return hf.greedy(prompt, n)
    if name == "seal":
        return hf_greedy_masked(hf, prompt, n, SEAL_LAYERS, lambda ids, P: [t in S for t in ids])
    if name == "seal_prev":
        return hf_greedy_masked(hf, prompt, n, SEAL_LAYERS, lambda ids, P: [i > 0 and ids[i - 1] in S for i in range(len(ids))])
    if name == "seal_gen":
        return hf_greedy_masked(hf, prompt, n, SEAL_LAYERS, lambda ids, P: [i >= P and t in S for i, t in enumerate(ids)])
    if name == "always":
        return hf_greedy_masked(hf, prompt, n, SEAL_LAYERS, lambda ids, P: [True] * len(ids))
    if name == "cast":
        on = cos_at(hf, prompt).mean() > t_req  # decided on the prompt, then every generated token
        return hf_greedy_masked(hf, prompt, n, CAST_LAYERS, lambda ids, P: [on and i >= P - 1 for i in range(len(ids))])
    if name == "cast_tok":  # per position, same forward (the read is below the writes)
        return hf_greedy_masked(hf, prompt, n, CAST_LAYERS, lambda ids, P: list(cos_at(hf, ids) <= t_tok))
    raise KeyError(name)


def gen(llm, prompts, apps, n=N):
    from vllm_xmix import SamplingParams

    ps = apps if isinstance(apps, list) and apps and isinstance(apps[0], SamplingParams) else \
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, mi_apps=apps)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], ps, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module", params=["eager", pytest.param("compiled", marks=pytest.mark.one_version)])
def cond_llm(request, tiny_llama, thresholds):
    llm = make_llm(tiny_llama, request.param, additional_config=deployment(*thresholds))
    yield llm
    close_llm(llm)


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", ["seal", "seal_prev", "seal_gen", "cast", "cast_tok"])
def test_conditional_writes_equal_hf(cond_llm, hf, thresholds, name):
    plain = [ref(hf, None, p, thresholds) for p in PROMPTS]
    always = [ref(hf, "always", p, thresholds) for p in PROMPTS]
    want = [ref(hf, name, p, thresholds) for p in PROMPTS]
    assert gen(cond_llm, PROMPTS, [name]) == want
    # the condition matters: neither never nor always on
    assert want != plain, f"{name}: the condition never fired on these prompts"
    if name.startswith("seal"):
        assert want != always, f"{name}: the condition always fired on these prompts"


def test_cast_decision_per_request_on_both_sides(cond_llm, hf, thresholds):
    """Prompts above the threshold are steered from their last prompt token on, prompts below
    never; the decision equals the reference's for each prompt."""
    t_req, _ = thresholds
    got = gen(cond_llm, PROMPTS, ["cast"])
    above = [cos_at(hf, p).mean() > t_req for p in PROMPTS]
    assert any(above) and not all(above)
    for p, g, a in zip(PROMPTS, got, above):
        plain = hf.greedy(p, N)
        if a:
            assert g == ref(hf, "cast", p, thresholds) and g != plain
        else:
            assert g == plain


def test_mixed_batch_equals_solo(cond_llm, hf, thresholds):
    from vllm_xmix import SamplingParams

    sels = [["seal"], None, ["cast"], ["always"], ["cast_tok", "seal_prev"], ["seal_gen"]]
    params = [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, mi_apps=s) for s in sels]
    batch = gen(cond_llm, PROMPTS, params)
    solo = [gen(cond_llm, [p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    assert batch == solo
    for p, s, g in zip(PROMPTS, sels, batch):
        if s is None or len(s) == 1:
            assert g == ref(hf, s[0] if s else None, p, thresholds)


@pytest.fixture(scope="module")
def chunk_engines(tiny_llama, thresholds):
    """The same deployment with 16- and 64-token prefill chunks and unchunked (256 tokens a step),
    eager; and 16-token chunks compiled."""
    out = {}
    for mbt in (16, 64, 256):
        out[mbt] = make_llm(tiny_llama, "eager", additional_config=deployment(*thresholds),
                            max_num_batched_tokens=mbt, max_num_seqs=8)
    out["16-compiled"] = make_llm(tiny_llama, "compiled", additional_config=deployment(*thresholds),
                                  max_num_batched_tokens=16, max_num_seqs=8)
    yield out
    for llm in out.values():
        close_llm(llm)


@pytest.mark.one_version
def test_chunk_sizes_give_identical_results(chunk_engines, hf, thresholds):
    prompts = [LONG, LONG[::-1], LONG[:40], [7, 8, 9]]
    for name in ("seal", "seal_prev", "cast", "cast_tok"):
        res = {mbt: gen(llm, prompts, [name]) for mbt, llm in chunk_engines.items()}
        assert res[16] == res[64] == res[256] == res["16-compiled"], name
        assert res[16] == [ref(hf, name, p, thresholds) for p in prompts], name


@pytest.mark.one_version
def test_prefix_cache_on_off_identical_and_salting(tiny_llama, hf, thresholds):
    """Same outputs with prefix caching on (second round hits the cache) and off. A request whose
    apps can write at prompt positions never reuses an app-free request's prompt blocks; a
    decode-only app (positions="generated") does."""
    prompts = [LONG[:64], LONG[2:66]]
    on = make_llm(tiny_llama, "eager", additional_config=deployment(*thresholds), enable_prefix_caching=True,
                  block_size=32)
    try:
        from vllm_xmix import SamplingParams

        for name in ("seal", "seal_gen", "cast"):
            first = gen(on, prompts, [name])
            again = gen(on, prompts, [name])
            assert first == again == [ref(hf, name, p, thresholds) for p in prompts], name
        sp = lambda apps: SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, mi_apps=apps)  # noqa: E731
        fresh = LONG[5:69]
        on.generate([{"prompt_token_ids": fresh}], sp(None), use_tqdm=False)  # app-free: fills the cache
        o_gen = on.generate([{"prompt_token_ids": fresh}], sp(["seal_gen"]), use_tqdm=False)[0]
        o_all = on.generate([{"prompt_token_ids": fresh}], sp(["seal"]), use_tqdm=False)[0]
        assert o_gen.num_cached_tokens > 0, "a decode-only app must keep sharing the prompt's blocks"
        assert o_all.num_cached_tokens == 0, "a prompt-writing app must not reuse app-free blocks"
    finally:
        close_llm(on)
    off = make_llm(tiny_llama, "eager", additional_config=deployment(*thresholds), enable_prefix_caching=False)
    try:
        for name in ("seal", "seal_gen", "cast"):
            assert gen(off, prompts, [name]) == [ref(hf, name, p, thresholds) for p in prompts]
    finally:
        close_llm(off)


@pytest.mark.one_version
def test_aborted_requests_free_their_slots(tiny_llama, thresholds, hf):
    """max_num_seqs=2 gives 4 slots; 12 requests with apps aborted mid-generation must not
    exhaust them, and the next requests are still right."""
    from vllm_xmix import SamplingParams

    llm = make_llm(tiny_llama, "eager", additional_config=deployment(*thresholds), max_num_seqs=2)
    try:
        eng = llm.llm_engine
        sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, mi_apps=["cast", "seal"])
        for i in range(6):
            ids = [f"a{i}-{k}" for k in range(2)]
            for rid, p in zip(ids, PROMPTS[:2]):
                eng.add_request(rid, {"prompt_token_ids": p}, sp)
            for _ in range(3):
                eng.step()
            eng.abort_request(ids)
        st = eng.engine_core.engine_core.model_executor.driver_worker.worker.model_runner \
            .compilation_config.static_forward_context["vllm_xmix"]
        assert gen(llm, PROMPTS[:2], ["cast"]) == [ref(hf, "cast", p, thresholds) for p in PROMPTS[:2]]
        # aborted requests hold no slot; the two just finished are released with the next step's
        # finished_req_ids (vLLM tells the worker then)
        assert not [r for r in st.req_slot if r.startswith("a")], st.req_slot
        assert len(st.req_slot) <= 2 and len(st.free_slots) + len(st.req_slot) == st.max_slots - 1
    finally:
        close_llm(llm)


def test_condition_errors(tiny_llama):
    from vllm_xmix import MIApp, XmixSpecError, deploy

    def app(**cond):
        a = MIApp("c")
        a.read("cosine", weight=C, buffer="b").layers([1])
        a.write("add", vector=V).layers([2]).cond(**cond)
        return a

    with pytest.raises(XmixSpecError, match=r"give exactly one of tokens, tokens_prev, buffer"):
        deploy(app(tokens=[1], buffer="b", threshold=0.0))
    with pytest.raises(XmixSpecError, match=r"threshold: a buffer condition needs a threshold"):
        deploy(app(buffer="b"))
    with pytest.raises(XmixSpecError, match=r"app 'c'\.ops\.1\.cond\.buffer: no read of this app writes buffer 'zz'"):
        deploy(app(buffer="zz", threshold=0.0))
    # a threshold outside the read's range: the condition would be constant
    with pytest.raises(XmixSpecError, match=r"ops\.1\.cond\.threshold: 2\.0 is outside \[-1, 1\], the range of a cosine "
                                            r"similarity \(buffer 'b'\): the condition would never or always hold"):
        deploy(app(buffer="b", op=">", threshold=2.0))
    deploy(app(buffer="b", op=">", threshold=1.0))
    sig = MIApp("s")
    sig.read("linear_probe", weight=C, sigmoid=True, buffer="p").layers([1])
    sig.write("add", vector=V).layers([2]).cond(buffer="p", op="<", threshold=-0.5)
    with pytest.raises(XmixSpecError, match=r"cond\.threshold: -0\.5 is outside \[0, 1\], the range of a probe's sigmoid"):
        deploy(sig)
    raw = MIApp("s")  # a probe without sigmoid: any threshold
    raw.read("linear_probe", weight=C, buffer="p").layers([1])
    raw.write("add", vector=V).layers([2]).cond(buffer="p", op="<", threshold=-40.0)
    deploy(raw)
    with pytest.raises(XmixSpecError, match=r"op"):
        deploy(app(buffer="b", op="!=", threshold=0.0))
    with pytest.raises(XmixSpecError, match=r"token ids must be non-negative integers"):
        deploy(app(tokens=[-3]))
    with pytest.raises(XmixSpecError, match=r"threshold/op: only a buffer condition takes them"):
        deploy(app(tokens=[3], op="<"))
    with pytest.raises(XmixSpecError, match=r"conditional reads are not yet supported"):
        deploy(MIApp("r").read("cosine", weight=C).cond(tokens=[1]))
    with pytest.raises(XmixSpecError, match=r"a condition read .* reads exactly one layer"):
        deploy(MIApp("r").read("cosine", weight=C, buffer="b").layers([1, 2]))
    # against the model, when the engine is configured
    late = MIApp("c")
    late.read("cosine", weight=C, buffer="b").layers([2])
    late.write("add", vector=V).layers([1, 3]).cond(buffer="b", threshold=0.0)
    with pytest.raises(ValueError, match=r"must be at later layers \(got 1\)"):
        make_llm(tiny_llama, "eager", additional_config=deploy(late))
    with pytest.raises(ValueError, match=r"cond: token id 5000 >= vocab size 1024"):
        make_llm(tiny_llama, "eager", additional_config=deploy(app(tokens=[1, 5000])))


def test_selecting_only_a_condition_read_layer_is_refused(cond_llm):
    """The condition read alone changes nothing and returns nothing: refused, not a silent no-op."""
    with pytest.raises(ValueError, match=r"selects only condition reads of app 'cast'"):
        gen(cond_llm, PROMPTS[:1], [{"name": "cast", "layers": [READ_LAYER]}])
    assert gen(cond_llm, PROMPTS[:1], [{"name": "cast", "layers": [READ_LAYER, 3]}])  # with a write layer: fine


def test_unconditional_add_beside_conditional_writes(cond_llm, hf, thresholds, monkeypatch):
    """blocks.1/2.hook_resid_post carry "always" (an add) beside SEAL's conditional adds: a
    request with "always" alone runs only the add kernel there (the row kernel, one program per
    token, is for the conditional writes); with "always" and "seal" together the add goes first
    and SEAL's entries through the row kernel. Both equal HF."""
    import vllm_xmix.ops as ops

    rows, adds = [], []
    real_row, real_add = ops.row_write_reference, ops.steer_add
    monkeypatch.setattr(ops, "row_write_reference", lambda *a, **k: (rows.append(list(a[4])), real_row(*a, **k))[1])
    monkeypatch.setattr(ops, "steer_add", lambda *a, **k: (adds.append(a[3].tolist()), real_add(*a, **k))[1])
    assert gen(cond_llm, PROMPTS, ["always"]) == [ref(hf, "always", p, thresholds) for p in PROMPTS]
    assert adds and not rows, rows[:3]
    adds.clear()
    S = set(SEAL_SET)
    want = [hf_greedy_masked(hf, p, N, SEAL_LAYERS, lambda ids, P: [1.0 + (t in S) for t in ids]) for p in PROMPTS]
    assert gen(cond_llm, PROMPTS, ["always", "seal"]) == want
    assert adds and rows and all(len(e) == 1 for e in rows + adds), (rows[:3], adds[:3])
