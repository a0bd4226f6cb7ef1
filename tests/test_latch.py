"""Latched writes (``write(...).cond(latch=<read>)`` on a read with ``.on(op, threshold, ...)``):
from the first position ``q`` where the read's value crosses the threshold, the write applies at
every position ``>= q`` for the rest of the request, at its layers (all after the read's).

The oracle is HF with plain hooks, decoding greedily token by token: each forward computes the
probe at layer ``LAYER`` over the whole sequence, finds its first crossing ``q`` and adds the
vector at the later layers to positions ``>= q``. vLLM (real engine, CPU, fp32 tiny Llama, eager
and compiled) must give the same tokens, probe values and trigger records, with 16-token chunked
prefill beside a request without apps, a few KV blocks (preemption and recompute), once with a
crossing inside the prompt and once in the generated part."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import close_llm, make_llm, unit_rms

pytestmark = pytest.mark.one_version  # runs on the primary vLLM only (CONTRIBUTING.md, Running the tests)

LAYER = 1  # the trigger read: blocks.1.hook_resid_post
WRITE_LAYERS = [2, 3]  # the latched add: blocks.{2,3}.hook_resid_post
V = unit_rms(31)
SCALE = 4.0
N = 20
PROMPT_A = [int(x) for x in np.random.default_rng(21).integers(3, 1000, size=37)]
PROMPT_B = [int(x) for x in np.random.default_rng(22).integers(3, 1000, size=29)]
PROMPT_C = [int(x) for x in np.random.default_rng(23).integers(3, 1000, size=33)]


@torch.no_grad()
def hf_latch(hf, prompt, w, thr, n=N, stale=None, read_layers=(LAYER,)):
    """Greedy decoding with the latch by full recompute: per forward, the probe ``x @ w`` at
    ``blocks.LAYER.hook_resid_post`` over the sequence, its first position ``q`` above ``thr``,
    and ``SCALE * V`` added at ``blocks.{WRITE_LAYERS}.hook_resid_post`` to positions ``>= q``
    (``stale``: a position the latch holds from the start, what a latch left over from an
    earlier request would do; ``read_layers``: the probe's layers, the latch is the first
    crossing at any of them). Returns (generated tokens, probe values float64 ``[P + n - 1]``
    of the final forward over prompt + generated[:-1] (a dict by layer for several layers), the
    latch position or None)."""
    state = {}
    wt = torch.from_numpy(np.asarray(w, dtype=np.float32))
    dt = torch.from_numpy((np.float32(SCALE) * V).astype(np.float32))

    def probe(x, L):
        vals = (x[0].float() @ wt)
        state.setdefault("vals", {})[L] = vals.numpy().astype(np.float64)
        hit = np.flatnonzero(vals.numpy() > np.float32(thr))
        cands = [q for q in (state.get("q"), int(hit[0]) if hit.size else None, stale) if q is not None]
        state["q"] = min(cands) if cands else None
        return torch.zeros_like(x)

    def latched(x):
        mask = torch.zeros(x.shape[-2], 1)
        if state["q"] is not None:
            mask[state["q"]:] = 1.0
        return mask * dt

    handles = []
    for L in read_layers:
        handles += hf._register(L, "hook_resid_post", lambda x, L=L: probe(x, L))
    for L in WRITE_LAYERS:
        handles += hf._register(L, "hook_resid_post", latched)
    try:
        ids = list(prompt)
        for _ in range(n):
            state.pop("q", None)
            ids.append(int(hf.model(torch.tensor([ids])).logits[0, -1].argmax()))
        gen = ids[len(prompt):]
        state.pop("q", None)
        hf.model(torch.tensor([list(prompt) + gen[:-1]]))
        vals = state["vals"] if len(read_layers) > 1 else state["vals"][read_layers[0]]
        return gen, vals, state["q"]
    finally:
        for h in handles:
            h.remove()


def new_maximum(vals, lo, hi, avoid=()):
    """The first position ``p`` in ``[lo, hi)`` (not in ``avoid``) whose value exceeds every
    earlier one by a margin, and a threshold between them: ``(p, threshold)``."""
    for p in range(lo, hi):
        top = vals[:p].max()
        if p not in avoid and vals[p] - top > 2e-2:
            return p, (vals[p] + top) / 2
    raise AssertionError("no clear new maximum in the range: change the prompt")


def peaking_direction(hf, prompt: list[int], n: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """A unit probe direction ``w`` (float32 ``[d_model]``) whose values on HF's greedy decoding
    of ``prompt`` (``n`` tokens) at ``blocks.LAYER.hook_resid_post`` reach a clear new maximum
    at a generated position: ``(w, values float64 [len(prompt) + n - 1], plain tokens)``."""
    P = len(prompt)
    plain = hf.greedy(prompt, n)
    H = hf.record(prompt + plain[:-1], [(LAYER, "hook_resid_post")])[(LAYER, "hook_resid_post")]
    H = H.astype(np.float64)
    for p in range(P + 2, len(H)):
        w = H[p] - H[:p].mean(axis=0)
        w = (w / np.linalg.norm(w)).astype(np.float32)
        vals = H @ w.astype(np.float64)
        if vals[p] - vals[:p].max() > 2e-2:
            return w, vals, plain
    raise AssertionError("no generated position is a clear new maximum: change the prompt")


@pytest.fixture(scope="module")
def oracle(hf):
    """The probe direction, the thresholds of the two cases and HF's latched decodings."""
    P = len(PROMPT_A)
    w, vals, plain = peaking_direction(hf, PROMPT_A, N)
    q_gen, thr_gen = new_maximum(vals, P + 2, len(vals))
    q_prompt, thr_prompt = new_maximum(vals, 3, P - 1, avoid=(16, 32))  # not at a chunk's first token
    out = dict(w=w, P=P, plain=plain, plain_b=hf.greedy(PROMPT_B, N), plain_c=hf.greedy(PROMPT_C, N))
    for case, thr, q in (("gen", thr_gen, q_gen), ("prompt", thr_prompt, q_prompt)):
        gen, vals_l, q_l = hf_latch(hf, PROMPT_A, w, thr)
        assert q_l == q, (case, q_l, q)  # values up to q do not depend on the latch
        out[case] = dict(thr=float(thr), q=q, gen=gen, vals=vals_l)
    # a prompt whose own latch (if any) fires after latch_prompt's position in PROMPT_A, and
    # whose tokens a latch left over from PROMPT_A would change
    for seed in range(30, 60):
        d = [int(x) for x in np.random.default_rng(seed).integers(3, 1000, size=24)]
        gen_d, _, q_d = hf_latch(hf, d, w, thr_prompt)
        if (q_d is None or q_d > q_prompt) and hf_latch(hf, d, w, thr_prompt, stale=q_prompt)[0] != gen_d:
            out["prompt_d"], out["gen_d"], out["q_d"] = d, gen_d, q_d
            break
    else:
        raise AssertionError("no prompt latches after PROMPT_A's prompt crossing")
    # a probe at two layers (0 and 1) whose layer-0 values cross first: the latch is the first
    # crossing at either layer
    rec = hf.record(PROMPT_C + out["plain_c"][:-1], [(0, "hook_resid_post"), (LAYER, "hook_resid_post")])
    H0, H1 = (rec[(L, "hook_resid_post")].astype(np.float64) for L in (0, LAYER))
    for p in range(2, len(PROMPT_C) - 1):  # a direction along layer 0's state at a prompt position
        w2 = H0[p] - H0[:p].mean(axis=0)
        w2 = (w2 / np.linalg.norm(w2)).astype(np.float32)
        v0, v1 = H0 @ w2.astype(np.float64), H1 @ w2.astype(np.float64)
        thr2 = (v0[p] + v0[:p].max()) / 2
        if v0[p] - v0[:p].max() > 2e-2 and v1[:p + 1].max() < thr2 - 1e-2:
            break
    else:
        raise AssertionError("no direction that layer 0 crosses before layer 1: change the prompt")
    gen2, vals2, q2 = hf_latch(hf, PROMPT_C, w2, thr2, read_layers=(0, LAYER))
    assert q2 == p and gen2 != out["plain_c"]
    out["two"] = dict(w=w2, gen=gen2, vals=vals2, q=q2, thr=float(thr2))
    # the latch changes the output, from the token the crossing position predicts on
    assert out["prompt"]["gen"][0] != plain[0]
    k = q_gen - P + 1  # the generated token sampled by the forward of position q_gen
    assert out["gen"]["gen"][:k] == plain[:k] and out["gen"]["gen"][k:] != plain[k:]
    return out


def deployment(o):
    from vllm_xmix import MIApp, deploy

    apps = []
    for case in ("gen", "prompt"):
        a = MIApp(f"latch_{case}")
        a.read("linear_probe", weight=o["w"], name="probe").layers([LAYER]).on(">", o[case]["thr"], action="latch")
        a.write("add", vector=V, scale=SCALE).layers(WRITE_LAYERS).cond(latch="probe")
        apps.append(a)
    a = MIApp("latch_two")
    a.read("linear_probe", weight=o["two"]["w"], name="probe").layers([0, LAYER]).on(">", o["two"]["thr"],
                                                                                   action="latch")
    a.write("add", vector=V, scale=SCALE).layers(WRITE_LAYERS).cond(latch="probe")
    apps.append(a)
    return deploy(*apps)


@pytest.fixture(scope="module", params=["eager", "compiled"])
def engine(request, tiny_llama, oracle):
    """16-token prefill chunks, 32-token KV blocks and 6 of them: prompts are split over steps and
    running requests are preempted and recomputed."""
    llm = make_llm(tiny_llama, request.param, additional_config=deployment(oracle), max_num_batched_tokens=16,
                   max_num_seqs=4, block_size=32, num_gpu_blocks_override=6, enable_prefix_caching=True,
                   max_model_len=128)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    llm.preempted = []
    orig = sched._preempt_request

    def count(req, *a, **k):
        llm.preempted.append(req.request_id)
        return orig(req, *a, **k)

    sched._preempt_request = count
    yield llm
    close_llm(llm)


def sp(apps, **kw):
    from vllm_xmix import SamplingParams

    return SamplingParams(max_tokens=N, ignore_eos=True, temperature=0, mi_apps=apps, **kw)


def test_latched_write_equals_hf_from_the_crossing_on(engine, oracle):
    o = oracle
    prompts = [PROMPT_A, PROMPT_B, PROMPT_A, PROMPT_C, PROMPT_C]
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts],
                           [sp(["latch_gen"]), sp([]), sp(["latch_prompt"]), sp([]), sp(["latch_two"])],
                           use_tqdm=False)
    assert engine.preempted, "the test setup must force at least one preemption"
    for out, case in ((outs[0], "gen"), (outs[2], "prompt")):
        want = o[case]
        assert list(out.outputs[0].token_ids) == want["gen"], case
        res = out.mi_results[f"latch_{case}"]
        np.testing.assert_allclose(res["probe"], want["vals"], rtol=1e-4, atol=1e-4, err_msg=case)
        assert res["triggers"] == [{"read": "probe", "layer": LAYER, "action": "latch", "position": want["q"],
                                    "value": pytest.approx(want["vals"][want["q"]], abs=1e-4)}], case
        assert out.outputs[0].finish_reason == "length"
    # the requests without apps beside them are untouched
    assert list(outs[1].outputs[0].token_ids) == o["plain_b"]
    assert list(outs[3].outputs[0].token_ids) == o["plain_c"]
    # a read at two layers: each layer's first crossing is recorded, the latch is the earlier one
    two, res = o["two"], outs[4].mi_results["latch_two"]
    assert list(outs[4].outputs[0].token_ids) == two["gen"]
    firsts = {}
    for L in (0, LAYER):
        np.testing.assert_allclose(res["probe"][L], two["vals"][L], rtol=1e-4, atol=1e-4)
        hit = np.flatnonzero(two["vals"][L].astype(np.float32) > np.float32(two["thr"]))
        if hit.size:
            firsts[L] = int(hit[0])
    assert firsts[0] == two["q"] and firsts.get(LAYER, 10**9) > two["q"]
    assert sorted((t["layer"], t["position"]) for t in res["triggers"]) == sorted(firsts.items())


def test_latch_alone_and_after_a_slot_is_reused(engine, oracle):
    """One request at a time (no chunk shares a step): the same tokens; the slot that held a
    latched request is given to the next request of the same app with its latch reset (the
    oracle checked that a latch left over would change that request's tokens)."""
    o = oracle
    first = engine.generate([{"prompt_token_ids": PROMPT_A}], sp(["latch_prompt"]), use_tqdm=False)[0]
    assert list(first.outputs[0].token_ids) == o["prompt"]["gen"]
    second = engine.generate([{"prompt_token_ids": o["prompt_d"]}], sp(["latch_prompt"]), use_tqdm=False)[0]
    assert list(second.outputs[0].token_ids) == o["gen_d"]
    assert [t["position"] for t in second.mi_results["latch_prompt"]["triggers"]] == \
        ([] if o["q_d"] is None else [o["q_d"]])


def test_latch_request_errors(engine):
    from vllm_xmix import XmixSpecError

    with pytest.raises(XmixSpecError, match=r"layers.*latched on read 'probe'.*could never fire"):
        engine.generate([{"prompt_token_ids": PROMPT_B}], sp([{"name": "latch_gen", "layers": [2, 3]}]),
                        use_tqdm=False)


def test_latch_layers_must_follow_the_read(tiny_llama):
    from vllm_xmix import MIApp, deploy

    a = MIApp("early")
    a.read("linear_probe", weight=V, name="probe").layers([1, 2]).on(">", 0.0, action="latch")
    a.write("add", vector=V).layers([2, 3]).cond(latch="probe")
    with pytest.raises(ValueError, match=r"apps\.0\(early\)\.ops\.1\.layers: a write latched on read 'probe' "
                                         r"\(layers \[1, 2\]\) must be at later layers"):
        make_llm(tiny_llama, "eager", additional_config=deploy(a))


def test_latch_spec_errors():
    from vllm_xmix import MIApp, XmixSpecError, deploy

    def app(on=True, action="latch", latch="probe", kind="linear_probe", **cond):
        a = MIApp("t")
        r = a.read(kind, weight=V if kind != "capture" else None, name="probe").layers([1])
        if on:
            r.on(">", 0.5, action=action)
        if latch is not None or cond:
            a.write("add", vector=V).layers([2]).cond(**({"latch": latch} if latch is not None else {}), **cond)
        return a

    deploy(app())  # the well-formed one
    deploy(app(action="stop"))  # writes may latch on a stop or flag trigger too
    deploy(app(action="flag"))
    with pytest.raises(XmixSpecError, match=r"1\.cond\.latch: no read of this app is named 'other'"):
        deploy(app(latch="other"))
    with pytest.raises(XmixSpecError, match=r"1\.cond\.latch: read 'probe' has no trigger"):
        deploy(app(on=False))
    with pytest.raises(XmixSpecError, match=r"only a 'linear_probe' or 'cosine' read"):
        deploy(app(kind="capture"))
    with pytest.raises(XmixSpecError, match=r"0\.on\.action: 'latch' switches on .* no write of this app names"):
        deploy(app(latch=None))
    with pytest.raises(XmixSpecError, match=r"give exactly one of tokens, tokens_prev, buffer, latch"):
        deploy(app(tokens=[1]))
    with pytest.raises(XmixSpecError, match=r"threshold/op: only a buffer condition"):
        deploy(app(threshold=0.3))
    with pytest.raises(XmixSpecError, match=r"latch: .* must be a read name"):
        deploy(app(latch="no spaces"))
