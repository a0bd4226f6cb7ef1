"""Probe-triggered actions (``read(...).on(op, threshold, action=...)``): a ``stop`` ends the
request at exactly the first position where the HF oracle's probe crosses the threshold, keeping
the token sampled there; a ``flag`` records that position and lets the request run. Real vLLM on
CPU, fp32, tiny Llama, prompts prefilled in several chunks beside other requests."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import close_llm, make_llm, unit_rms

W = unit_rms(77) / 8  # for the spec errors
LAYER = 2
N = 20
PROMPT_A = [int(x) for x in np.random.default_rng(11).integers(3, 1000, size=37)]
PROMPT_B = [int(x) for x in np.random.default_rng(12).integers(3, 1000, size=29)]


def oracle_states(hf, prompt):
    """HF's ``resid_post[LAYER]`` at every position of prompt + N greedy tokens (the last one
    never fed back), float64 ``[P + N - 1, d_model]``, and the greedy tokens."""
    gen = hf.greedy(prompt, N)
    ids = list(prompt) + gen[:-1]
    return hf.record(ids, [(LAYER, "hook_resid_post")])[(LAYER, "hook_resid_post")].astype(np.float64), gen


def probe_for(H, lo: int):
    """A probe direction whose values ``H @ w`` first exceed a threshold at a generated position
    ``p >= lo`` (a new maximum with a margin): ``w`` along the state at ``p`` minus the mean of
    the earlier states. Returns ``(w, threshold, p)``."""
    for p in range(lo, len(H)):
        w = H[p] - H[:p].mean(axis=0)
        w = w / np.linalg.norm(w)
        vals = H @ w
        top = vals[:p].max()
        if vals[p] - top > 1e-2:
            return w.astype(np.float32), (vals[p] + top) / 2, p
    raise AssertionError("no generated position is a clear new maximum: change the prompt")


@pytest.fixture(scope="module")
def setup(tiny_llama, hf):
    from vllm_xmix import MIApp, deploy

    H, gen_a = oracle_states(hf, PROMPT_A)
    _, gen_b = oracle_states(hf, PROMPT_B)
    P = len(PROMPT_A)
    w, thr_gen, p_gen = probe_for(H, P + 2)  # crosses at a generated position
    va = H @ w.astype(np.float64)
    thr_prompt = (va[:P - 1].max() + va[:P - 1].min()) / 2  # crosses inside the prompt
    p_prompt = int(np.flatnonzero(va > thr_prompt)[0])
    assert p_prompt < P - 1
    apps = []
    for name, thr, action in (("guard", thr_gen, "stop"), ("guard_prompt", thr_prompt, "stop"),
                              ("watch", thr_gen, "flag"), ("never", 1e9, "stop")):
        a = MIApp(name)
        a.read("linear_probe", weight=w).layers([LAYER]).submodule("hook_resid_post").on(">", thr, action=action)
        apps.append(a)
    llm = make_llm(tiny_llama, "eager", additional_config=deploy(*apps), max_num_batched_tokens=16,
                   max_num_seqs=4, max_model_len=128)
    yield dict(llm=llm, va=va, gen_a=gen_a, gen_b=gen_b, p_gen=p_gen, p_prompt=p_prompt)
    close_llm(llm)


def sp(apps, **kw):
    from vllm_xmix import SamplingParams

    return SamplingParams(max_tokens=N, ignore_eos=True, temperature=0, mi_apps=apps, **kw)


def test_stop_ends_the_request_at_the_first_crossing(setup):
    s, llm = setup, setup["llm"]
    P, p = len(PROMPT_A), setup["p_gen"]
    outs = llm.generate([{"prompt_token_ids": PROMPT_A}, {"prompt_token_ids": PROMPT_B}, {"prompt_token_ids": PROMPT_A}],
                        [sp(["guard"]), sp([]), sp(["guard_prompt"], min_tokens=5)], use_tqdm=False)
    o = outs[0].outputs[0]
    # the value at position p is computed by the forward that samples generated token p - P + 1: kept
    assert list(o.token_ids) == s["gen_a"][:p - P + 2]
    assert o.finish_reason == "stop" and o.stop_reason == "xmix:guard.probe"
    res = outs[0].mi_results["guard"]
    assert res["triggers"] == [{"read": "probe", "layer": LAYER, "action": "stop", "position": p,
                                "value": pytest.approx(s["va"][p], abs=1e-4)}]
    np.testing.assert_allclose(res["probe"], s["va"][:p + 1], atol=1e-4)
    # the request beside it is untouched
    assert list(outs[1].outputs[0].token_ids) == s["gen_b"] and outs[1].outputs[0].finish_reason == "length"
    # a crossing inside the prompt stops the request at its first token (min_tokens does not delay it)
    o2 = outs[2].outputs[0]
    assert list(o2.token_ids) == s["gen_a"][:1] and o2.stop_reason == "xmix:guard_prompt.probe"
    assert outs[2].mi_results["guard_prompt"]["triggers"][0]["position"] == s["p_prompt"]


def test_flag_records_the_crossing_and_the_request_runs_on(setup):
    s, llm = setup, setup["llm"]
    outs = llm.generate([{"prompt_token_ids": PROMPT_A}, {"prompt_token_ids": PROMPT_A}],
                        [sp(["watch"]), sp(["never"])], use_tqdm=False)
    o = outs[0].outputs[0]
    assert list(o.token_ids) == s["gen_a"] and o.finish_reason == "length"
    assert [(t["action"], t["position"]) for t in outs[0].mi_results["watch"]["triggers"]] == [("flag", s["p_gen"])]
    # an armed trigger that never fires says so: an empty list, the request runs to its length
    assert outs[1].mi_results["never"]["triggers"] == []
    assert list(outs[1].outputs[0].token_ids) == s["gen_a"] and outs[1].outputs[0].stop_reason is None


def test_streamed_stop_ends_the_stream_with_the_record(setup):
    from vllm.sampling_params import RequestOutputKind

    s, llm = setup, setup["llm"]
    P, p = len(PROMPT_A), setup["p_gen"]
    engine = llm.llm_engine
    engine.add_request("st", {"prompt_token_ids": PROMPT_A}, sp(["guard"], output_kind=RequestOutputKind.CUMULATIVE))
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    assert last.finished and list(last.outputs[0].token_ids) == s["gen_a"][:p - P + 2]
    assert last.mi_results["guard"]["triggers"][0]["position"] == p


def test_stop_check_is_vllms_own_unless_a_stop_is_pending(setup):
    """vLLM checks every running request for a stop in every step: the plugin's check runs only
    between a stop trigger's crossing and the output that ends the request. Here the crossing is
    in the prompt's first chunks (16-token steps), so the stop waits for the first token; before
    it and after it the check is vLLM's function."""
    import vllm.v1.core.sched.scheduler as sched_mod
    from vllm.v1.core.sched.utils import check_stop as vllms

    s, llm = setup, setup["llm"]
    engine = llm.llm_engine
    assert sched_mod.check_stop is vllms
    engine.add_request("cut", {"prompt_token_ids": PROMPT_A}, sp(["guard_prompt"]))
    pending, last_out = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last_out = out
        pending.append(sched_mod.check_stop is not vllms)
    assert last_out.finished and list(last_out.outputs[0].token_ids) == s["gen_a"][:1]
    assert last_out.outputs[0].stop_reason == "xmix:guard_prompt.probe"
    # pending from the step whose chunk holds the crossing to the step that samples the first token
    first, last = 1 + s["p_prompt"] // 16, (len(PROMPT_A) + 15) // 16  # steps counted from 1
    assert first < last, "the crossing must be in an earlier chunk than the prompt's last"
    assert pending == [False] * (first - 1) + [True] * (last - first) + [False] * (len(pending) - last + 1), pending
    assert sched_mod.check_stop is vllms


def test_trigger_spec_errors():
    from vllm_xmix import MIApp, XmixSpecError, deploy

    with pytest.raises(XmixSpecError, match="only a 'linear_probe' or 'cosine' read"):
        deploy(MIApp("c").read("capture").layers([1]).on(">", 1.0))
    with pytest.raises(XmixSpecError, match="give a threshold"):
        MIApp("t").read("linear_probe", weight=W).on(">")
    with pytest.raises(XmixSpecError, match="action"):
        deploy(MIApp("t").read("linear_probe", weight=W).layers([1]).on(">", 1.0, action="abort"))
    with pytest.raises(XmixSpecError, match="op"):
        deploy(MIApp("t").read("linear_probe", weight=W).layers([1]).on("=>", 1.0))
    with pytest.raises(XmixSpecError, match="threshold"):
        deploy(MIApp("t").read("linear_probe", weight=W).layers([1]).on(">", float("nan")))
    with pytest.raises(XmixSpecError, match="reserved"):
        deploy(MIApp("t").read("linear_probe", weight=W, name="triggers").layers([1]))
    with pytest.raises(XmixSpecError, match="only a read"):
        MIApp("w").write("add", vector=W).layers([1]).on(">", 1.0)
    with pytest.raises(XmixSpecError, match="already given"):
        MIApp("t").read("linear_probe", weight=W).on(">", 1.0).on("<", 0.0)
