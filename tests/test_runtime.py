"""The worker-side request registry (vllm_xmix.runtime.XmixState) under preemption, driven with
scheduler outputs shaped like vLLM's (the engine-level behaviour is in test_conditions/test_reads)."""

from __future__ import annotations

import re
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from conftest import unit_rms


def state(max_slots=3):
    from vllm_xmix import MIApp, deploy
    from vllm_xmix.runtime import XmixState
    from vllm_xmix.spec import parse_deployment

    a = MIApp("steer")
    a.write("add", vector=unit_rms(0)).layers([1])
    return XmixState.build(parse_deployment(deploy(a)["xmix"]), 4, 64, torch.device("cpu"), 64, max_slots,
                           max_model_len=64)


def new(rid):
    sp = NS(extra_args={"xmix": {"apps": [{"name": "steer"}]}})
    return NS(req_id=rid, sampling_params=sp, prompt_token_ids=[1, 2, 3], num_computed_tokens=0)


def step(st, new_reqs=(), cached=(), preempted=(), finished=()):
    so = NS(finished_req_ids=set(finished), preempted_req_ids=set(preempted), scheduled_new_reqs=list(new_reqs),
            scheduled_cached_reqs=NS(req_ids=list(cached), num_computed_tokens=[3] * len(cached)))
    st.update_requests(so)
    ids = [r.req_id for r in new_reqs] + list(cached)
    st.fill(ids, np.ones(len(ids), dtype=np.int64))


def test_preempted_request_keeps_its_slot_and_is_no_victim_once_resumed():
    st = state(max_slots=3)  # slots 1 and 2
    step(st, new_reqs=[new("a")])
    slot_a = st.req_slot["a"]
    step(st, preempted=["a"])
    assert st.req_slot["a"] == slot_a and "a" in st.preempted  # kept while preempted
    step(st, cached=["a"])  # resumed
    assert "a" not in st.preempted and st.req_slot["a"] == slot_a
    step(st, new_reqs=[new("b")], cached=["a"])
    # a third running request: no preempted victim left, so this is a loud error, never a slot
    # taken from a running request
    with pytest.raises(RuntimeError, match="out of request slots"):
        step(st, new_reqs=[new("c")], cached=["a", "b"])
    assert st.req_slot["a"] == slot_a


def test_a_preempted_request_gives_its_slot_when_none_is_free():
    st = state(max_slots=3)
    step(st, new_reqs=[new("a"), new("b")])
    step(st, preempted=["a"], cached=["b"])
    step(st, new_reqs=[new("c")], cached=["b"])  # takes a's slot (a warning is logged)
    assert "a" not in st.req_slot and {"b", "c"} <= set(st.req_slot)
    step(st, finished=["a", "b", "c"])
    assert not st.req_slot and len(st.free_slots) == 2


def test_graph_variant_follows_the_step_and_dummy_forwards_clear_the_slot_table():
    """``active`` (which graph variant a step replays) is True exactly when a token of the step
    belongs to a request with an app on; a forward that bypasses fill() (vLLM's dummy runs) must
    not see the last step's slot table (dummy tokens would write into a live request's slot)."""
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    load_general_plugins()  # what every vLLM process does: applies vllm_xmix's patches
    assert getattr(GPUModelRunner._dummy_run, "__xmix_patched__", False)
    st = state()
    off = NS(req_id="off", sampling_params=NS(extra_args=None), prompt_token_ids=[1, 2, 3], num_computed_tokens=0)
    step(st, new_reqs=[off])
    assert st.active is False
    step(st, new_reqs=[new("a")], cached=["off"])
    assert st.active is True and st.high_water == 2 and int(st.tok_slot[:2].ne(0).sum()) == 1
    st.dummy_forward()
    assert st.active is False and st.high_water == 0 and int(st.tok_slot.ne(0).sum()) == 0
    with st.capture_variant(st.all_mask):  # during a variant capture the variant is the one captured
        st.dummy_forward()
        assert st.active is True
    step(st, cached=["a", "off"])
    assert st.active is True


def _fake_config(st):
    from vllm_xmix.runtime import STATE_KEY

    return NS(compilation_config=NS(static_forward_context={STATE_KEY: st}, cudagraph_num_of_warmups=1))


def test_v1_capture_runs_every_variant():
    """vLLM's V1 ``_warmup_and_capture`` (graph capture and graph-memory profiling) runs once per
    variant, app-free first, with the state saying which variant is being captured (one app
    here: app-free and every site)."""
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    load_general_plugins()
    st = state()
    seen = []
    vc = _fake_config(st)
    runner = NS(vllm_config=vc, compilation_config=vc.compilation_config,
                _dummy_run=lambda *a, **k: seen.append((st.active, st.capturing_variants, k.get("is_graph_capturing"))))
    desc = NS(num_tokens=8, uniform=False, num_active_loras=0)
    GPUModelRunner._warmup_and_capture(runner, desc, cudagraph_runtime_mode=NS(name="PIECEWISE"))
    assert seen == [(False, True, None), (False, True, True), (True, True, None), (True, True, True)]
    assert st.active is True and st.capturing_variants is False


def test_graph_wrapper_keeps_one_table_per_variant():
    """The patched ``CUDAGraphWrapper.__call__`` looks graphs up in the table of the step's
    variant; a wrapper first called during a variant capture gets two tables; a table that vLLM
    replaced (elastic EP re-capture) drops the variant tables."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.plugins import load_general_plugins

    from vllm.config import CUDAGraphMode

    load_general_plugins()
    st = state()
    w = NS(vllm_config=_fake_config(st), runnable=lambda: "ran", concrete_cudagraph_entries={},
           runtime_mode=CUDAGraphMode.PIECEWISE)
    first = w.concrete_cudagraph_entries
    assert CUDAGraphWrapper.__call__(w) == "ran"  # no forward context: runs the runnable
    assert "_xmix_tables" not in w.__dict__  # called outside a variant capture: one table
    with st.capture_variant(0):
        CUDAGraphWrapper.__call__(w)
    tables = w._xmix_tables
    assert tables[st.all_mask] is first and w.concrete_cudagraph_entries is tables[0] is not first
    st.run_mask = st.all_mask
    CUDAGraphWrapper.__call__(w)
    assert w.concrete_cudagraph_entries is first
    st.run_mask = 0
    CUDAGraphWrapper.__call__(w)
    assert w.concrete_cudagraph_entries is tables[0]
    st.run_mask = 0b10  # a variant that was never captured: loud, never another variant's graphs
    with pytest.raises(RuntimeError, match="no CUDA graphs were captured for hook variant"):
        CUDAGraphWrapper.__call__(w)
    # VLLM_XMIX_PIECEWISE_VARIANTS=onoff: a piecewise wrapper replays the every-site pieces for
    # any step with an app on; a FULL wrapper still needs its variant's own graphs
    st.variants.piecewise_onoff = True
    CUDAGraphWrapper.__call__(w)
    assert w.concrete_cudagraph_entries is first
    full = NS(vllm_config=w.vllm_config, runnable=lambda: "ran", concrete_cudagraph_entries={},
              runtime_mode=CUDAGraphMode.FULL)
    with st.capture_variant(0):
        CUDAGraphWrapper.__call__(full)
    with pytest.raises(RuntimeError, match="no CUDA graphs were captured for hook variant 0x2"):
        CUDAGraphWrapper.__call__(full)
    st.variants.piecewise_onoff = False
    st.run_mask = 0
    w.concrete_cudagraph_entries = {}  # vLLM releases the graphs
    CUDAGraphWrapper.__call__(w)
    assert w._xmix_tables is None


def multi_state(fused_mode=None, fused_writes="all"):
    """Five apps on a 4-layer model: a steering add at resid_post of every layer and a
    directional ablation at resid_pre of layer 2 (both unconditional: fusible into the compiled
    graph), a probe at resid_post of layer 1 (shares that site with the add), a SEAL-style add on
    token ids at mlp_out of layer 3 (embedding bookkeeping) and a clamp at that same site (a
    projection beside a conditional write: stays in the op)."""
    from vllm_xmix import MIApp, deploy
    from vllm_xmix.runtime import XmixState
    from vllm_xmix.spec import parse_deployment

    apps = [MIApp("steer_all"), MIApp("ablate"), MIApp("probe"), MIApp("seal"), MIApp("clamp")]
    apps[0].write("add", vector=unit_rms(0)).layers("all").submodule("hook_resid_post")
    apps[1].write("ablate", vector=unit_rms(1)).layers([2]).submodule("hook_resid_pre")
    apps[2].read("linear_probe", weight=unit_rms(2)).layers([1]).submodule("hook_resid_post")
    apps[3].write("add", vector=unit_rms(3)).layers([3]).submodule("hook_mlp_out").cond(tokens=[5, 6])
    apps[4].write("clamp", vector=unit_rms(4), value=1.0).layers([3]).submodule("hook_mlp_out")
    st = XmixState.build(parse_deployment(deploy(*apps, fused_writes=fused_writes)["xmix"]), 4, 64,
                         torch.device("cpu"), 64, 8, vocab_size=32, max_model_len=64)
    st.fused_mode = fused_mode
    return st


def test_fused_writes_setting_chooses_what_the_graph_applies():
    """``fused_writes``: "adds" fuses the unconditional adds only, so the ablation and
    the clamp run through the op in their own variants (and the app-free graph holds no
    projection); "all" also fuses the ablation (its site has only unconditional writes; the
    clamp shares a site with a conditional write); "none" (the default) fuses nothing and
    steer_all gets a variant of its own. A bad value names the field."""
    from vllm_xmix import MIApp, XmixSpecError, deploy

    names = {}
    for mode in ("adds", "all", "none"):
        st = multi_state(fused_mode=True, fused_writes=mode)
        names[mode] = sorted(st.site_names[s] for s in range(len(st.sites)) if st.site_fused[s])
        step(st, new_reqs=[req("a", "ablate")])
        ablate_runs = sites_of(st, st.run_mask)
        step(st, finished=["a"], new_reqs=[req("b", "steer_all")])
        steer_runs = sites_of(st, st.run_mask)
        names[mode] = (names[mode], ablate_runs, steer_runs)
    posts = [f"blocks.{L}.hook_resid_post" for L in range(4)]
    assert names["adds"] == (posts, ["blocks.2.hook_resid_pre"], [])
    assert names["all"] == (sorted(posts + ["blocks.2.hook_resid_pre"]), [], [])
    assert names["none"] == ([], ["blocks.2.hook_resid_pre"], posts)
    with pytest.raises(XmixSpecError, match=r"xmix\.fused_writes: Input should be 'adds', 'all', 'auto', 'none' or 'norm' \(got 'ALL'\)"):
        deploy(MIApp("steer").write("add", vector=unit_rms(0)).layers([1]), fused_writes="ALL")


def test_per_token_fused_coefficients_follow_the_step():
    """``tok_fc`` (what fused writes read in compiled graphs): for every token of the step its
    request's coefficient of each fused entry, zero for app-free tokens and past the step's
    tokens (padding, rows a longer earlier step wrote), zero after a dummy forward."""
    st = multi_state(fused_mode=True, fused_writes="all")
    assert st.fused_entries.size == 5  # steer_all's 4 adds and the ablation at layer 2
    step(st, new_reqs=[req("a", "steer_all"), req("b", "probe"), req("c", "ablate", "steer_all")])
    st.fill(["a", "b", "c"], np.array([3, 2, 4]))  # a chunked step: 3 + 2 + 4 tokens
    fc = st.tok_fc[:9].numpy()
    want = np.concatenate([np.repeat(st.req_rows[r][st.fused_entries][None], k, 0) if r in st.req_rows
                           else np.zeros((k, 5), np.float32) for r, k in (("a", 3), ("b", 2), ("c", 4))])
    np.testing.assert_array_equal(fc, want)
    assert fc[:3].any() and not fc[3:5].any() and fc[5:].all()  # b's probe is not a fused write
    st.fill(["b"], np.array([1]))  # only an app-free token now: every row the last step wrote is zero
    assert not st.tok_fc.numpy().any()
    st.fill(["a"], np.array([2]))
    st.dummy_forward()  # (a dummy run's tokens belong to no request)
    assert not st.tok_fc.numpy().any()
    step(st, finished=["a", "b", "c"])
    assert not st.req_fc
    # an eager forward first (fused_mode False), a compiled graph later: the table is still current
    st = multi_state(fused_mode=None, fused_writes="all")
    site = st.sites[(0, "hook_resid_post")]
    step(st, new_reqs=[req("a", "steer_all")])
    st.runs(site, fused=0)
    assert st.fused_mode is False
    step(st, finished=["a"], new_reqs=[req("b", "ablate")])
    st.runs(site, fused=st.site_fused_id[site])  # a compiled call after it (accepted, no stale-cache error)
    np.testing.assert_array_equal(st.tok_fc[:1].numpy()[0], st.req_rows["b"][st.fused_entries])


def test_a_selection_as_json_text_registers_like_the_same_selection_as_objects():
    """The front end writes a request's selection as JSON text, ``LLM`` users as objects: both
    register the same coefficient row, fused coefficients, reads and variant; the registration
    data is built once per distinct selection (the row cache holds one entry per form), and a
    selection naming an unknown app is refused in either form, never cached."""
    import json

    from vllm_xmix import XmixSpecError

    st = multi_state(fused_mode=True)
    sel = {"apps": [{"name": "probe"}, {"name": "steer_all", "scale": 2.0}]}
    text = NS(req_id="t", sampling_params=NS(extra_args={"xmix": json.dumps(sel)}), prompt_token_ids=[1, 2, 3],
              num_computed_tokens=0)
    obj = NS(req_id="o", sampling_params=NS(extra_args={"xmix": sel}), prompt_token_ids=[1, 2, 3],
             num_computed_tokens=0)
    step(st, new_reqs=[text, obj])
    np.testing.assert_array_equal(st.req_rows["t"], st.req_rows["o"])
    np.testing.assert_array_equal(st.req_fc["t"], st.req_fc["o"])
    assert st.req_rows["t"][st.fused_entries].max() == 2.0  # the scale reached the fused adds
    assert st.slots.req_reads["t"] == st.slots.req_reads["o"] and st.slots.req_reads["t"][0]
    assert st.slots.variants._row_masks["t"] == st.slots.variants._row_masks["o"]
    for i, r in enumerate(("t2", "o2", "t3")):  # the same selections again: no new cache entries
        x = {"xmix": json.dumps(sel) if r != "o2" else dict(sel)}
        step(st, new_reqs=[NS(req_id=r, sampling_params=NS(extra_args=x), prompt_token_ids=[1], num_computed_tokens=0)],
             cached=["t", "o"])
    assert len(st.slots._rows) == 2
    np.testing.assert_array_equal(st.tok_fc[:1].numpy()[0], st.req_fc["t3"])  # t3's token comes first
    for raw in (json.dumps({"apps": [{"name": "nope"}]}), {"apps": [{"name": "nope"}]}):
        with pytest.raises(XmixSpecError, match="unknown app 'nope'"):
            st.slots.request_row({"xmix": raw})
    assert len(st.slots._rows) == 2


def test_staging_ring_is_checked_by_one_event_a_lap(monkeypatch):
    """The step fill's pinned staging buffers are reused a lap (RING steps) later: one event a lap,
    recorded after the uploads of the lap's last stage and queried when the next lap starts; a
    lap whose event has not completed waits for it once (counted in ``stage_waits``). A CPU
    state with the CUDA path switched on and a stand-in event (the policy, not the driver)."""
    from vllm_xmix.runtime import step as step_mod

    events = []

    class Event:
        def __init__(self):
            self.done, self.records, self.queries, self.syncs = True, 0, 0, 0
            events.append(self)

        def record(self):
            self.records += 1

        def query(self):
            self.queries += 1
            return self.done

        def synchronize(self):
            self.syncs += 1
            self.done = True

    monkeypatch.setattr(step_mod, "_new_event", Event)
    st = multi_state(fused_mode=True)
    st.step._cuda = True
    step(st, new_reqs=[req("a", "steer_all")])  # the first stage
    ring = len(st.step._ring)
    assert ring == step_mod.RING  # (a small deployment: the full ring)
    for _ in range(2 * ring - 1):  # two laps in all
        st.fill(["a"], np.array([1]))
    assert len(events) == 1 and events[0].records == 2 and events[0].queries == 1 and st.stage_waits == 0
    events[0].done = False  # the host ran a lap ahead of the GPU
    st.fill(["a"], np.array([1]))  # the third lap starts: it waits once
    assert events[0].syncs == 1 and st.stage_waits == 1
    for _ in range(ring - 1):
        st.fill(["a"], np.array([1]))
    assert events[0].records == 3 and events[0].queries == 2 and events[0].syncs == 1
    st.fill(["b"], np.array([1]))  # an app-free step after apps: the slot table is cleared through a stage too
    assert not st.tok_slot.numpy().any()
    monkeypatch.setattr(step_mod, "RING_BYTES", 1)  # staging buffers too large for the full ring
    assert len(multi_state(fused_mode=True).step._ring) == step_mod.RING_MIN


def req(rid, *apps, layers=None):
    sel = [{"name": a} if layers is None else {"name": a, "layers": layers} for a in apps]
    sp = NS(extra_args={"xmix": {"apps": sel}})
    return NS(req_id=rid, sampling_params=sp, prompt_token_ids=[1, 2, 3], num_computed_tokens=0)


def sites_of(st, mask):
    names = {sid: n for sid, n in st.site_names.items() if (mask >> sid) & 1}
    return sorted(names.values()) + (["tokens"] if (mask >> st.tok_unit) & 1 else [])


def test_per_app_variants_run_only_the_sites_of_the_apps_on():
    """One CUDA-graph variant per deployed app (compiled semantics: the unconditional adds and
    the ablation are torch ops inside the graph and need no op, so steer_all and ablate share the
    app-free variant); a step replays the smallest variant covering every registered request's
    apps; two apps with different sites fall back to every site."""
    st = multi_state(fused_mode=True)
    assert st.site_fused[st.sites[(2, "hook_resid_pre")]] and not st.site_fused[st.sites[(3, "hook_mlp_out")]]
    variants = st.graph_variants()
    assert variants[0] == 0 and variants[-1] == st.all_mask
    assert [sites_of(st, m) for m in variants[1:-1]] == [
        ["blocks.1.hook_resid_post"], ["blocks.3.hook_mlp_out", "tokens"], ["blocks.3.hook_mlp_out"]]
    step(st, new_reqs=[req("a", "steer_all")])
    assert st.run_mask == 0  # the adds are inside the compiled graph: no op runs at all
    step(st, new_reqs=[req("b", "probe")], cached=["a"])
    assert sites_of(st, st.run_mask) == ["blocks.1.hook_resid_post"]
    assert not st.runs(st.sites[(3, "hook_mlp_out")], fused=0)  # the clamp's op does not run
    post1 = st.sites[(1, "hook_resid_post")]
    assert st.runs(post1, fused=st.site_fused_id[post1])
    step(st, new_reqs=[req("c", "seal")], cached=["a", "b"])  # probe + seal: no single-app variant covers it
    assert st.run_mask == st.all_mask
    step(st, cached=["c"])  # a and b registered but not in this step: only what c needs
    assert sites_of(st, st.run_mask) == ["blocks.3.hook_mlp_out", "tokens"]
    step(st, cached=["b", "a"])
    assert sites_of(st, st.run_mask) == ["blocks.1.hook_resid_post"]
    step(st, finished=["b", "c"], cached=["a"])
    assert st.run_mask == 0
    step(st, new_reqs=[req("d", "ablate", "clamp")], cached=["a"])
    assert sites_of(st, st.run_mask) == ["blocks.3.hook_mlp_out"]  # the clamp's variant; the ablation is fused
    step(st, finished=["d"], new_reqs=[req("e", "ablate")], cached=["a"])
    assert st.run_mask == 0
    step(st, finished=["a", "e"])
    assert st.run_mask == 0  # nothing registered


def test_a_variant_applies_only_the_entries_of_its_apps():
    """At a site shared by several apps the hook op applies the entries of the apps in the
    step's variant only (``site_plan``), with the site's kernel whatever the variant (so a
    request's values do not depend on the other apps in its batch). An app's variant also holds
    the apps whose sites lie within its own (the probe's site is one of steer_all's; the clamp's
    is SEAL's): a step mixing them replays it, not every site. Layer subsets are covered by
    their app's variant."""
    st = multi_state(fused_mode=True, fused_writes="none")
    assert len(st.graph_variants()) == 7  # app-free, steer_all+probe, ablate, probe, seal+clamp, clamp, all
    post1, mlp3 = st.sites[(1, "hook_resid_post")], st.sites[(3, "hook_mlp_out")]

    def plan(site):
        p = st.site_plan(site, fused=0)
        return None if p is None else ([st.entries[e].app for e in p.writes_host], p.row, p.has_cond,
                                       [st.entries[e].app for e in p.reads_host])

    step(st, new_reqs=[req("a", "probe")])
    assert plan(post1) == ([], False, False, ["probe"]) and plan(mlp3) is None  # steer_all's add left out
    step(st, finished=["a"], new_reqs=[req("b", "clamp")])
    assert plan(mlp3) == (["clamp"], True, False, [])  # SEAL's gate left out; still the row kernel
    step(st, cached=["b"], new_reqs=[req("c", "seal")])  # SEAL's variant holds the clamp
    assert st.run_mask != st.all_mask and plan(mlp3) == (["seal", "clamp"], True, True, [])
    step(st, finished=["b", "c"], new_reqs=[req("d", "steer_all"), req("e", "probe")])  # nested: steer_all's
    assert st.run_mask != st.all_mask and plan(post1) == (["steer_all"], False, False, ["probe"])
    assert plan(mlp3) is None
    step(st, finished=["d", "e"], new_reqs=[req("f", "steer_all", layers=[1])])
    assert plan(post1) == (["steer_all"], False, False, ["probe"])
    step(st, cached=["f"], new_reqs=[req("g", "seal")])  # not nested: every site, every entry
    assert st.run_mask == st.all_mask and plan(mlp3) == (["seal", "clamp"], True, True, [])
    step(st, finished=["f", "g"])
    assert plan(post1) is None


def test_variants_without_compiled_graph_and_when_turned_off(monkeypatch):
    """Eager forwards apply the steering adds in the op, so steer_all needs its sites; without
    captured graphs a step runs exactly the sites its requests need; an eager call on a fused
    site in a compiled engine still runs where a request needs it; VLLM_XMIX_GRAPH_VARIANTS
    'onoff' / '0' / a bad value."""
    st = multi_state(fused_mode=None)  # before any forward: eager semantics (a superset)
    step(st, new_reqs=[req("a", "steer_all"), req("b", "probe")])
    assert sites_of(st, st.run_mask) == [f"blocks.{L}.hook_resid_post" for L in range(4)]
    site = st.sites[(0, "hook_resid_post")]
    assert st.runs(site, fused=0) and st.fused_mode is False
    st = multi_state(fused_mode=True)
    step(st, new_reqs=[req("a", "steer_all")])
    assert st.run_mask == 0 and not st.runs(site, fused=st.site_fused_id[site])
    assert st.runs(site, fused=0)  # an eager forward: the adds are the op's to apply
    # a graph compiled for other fused writes (a stale compile cache) is refused, never guessed at
    with pytest.raises(RuntimeError, match="stale torch.compile cache"):
        st.runs(site, fused=st.site_fused_id[site] + 1)
    monkeypatch.setenv("VLLM_XMIX_GRAPH_VARIANTS", "onoff")
    assert multi_state(fused_mode=True).graph_variants() == [0, multi_state().all_mask]
    monkeypatch.setenv("VLLM_XMIX_GRAPH_VARIANTS", "0")
    st = multi_state(fused_mode=True)
    step(st, new_reqs=[])
    assert st.run_mask == st.all_mask  # off: every step runs every site
    monkeypatch.setenv("VLLM_XMIX_GRAPH_VARIANTS", "some")
    with pytest.raises(ValueError, match="VLLM_XMIX_GRAPH_VARIANTS"):
        multi_state()
    monkeypatch.setenv("VLLM_XMIX_GRAPH_VARIANTS", "apps")
    monkeypatch.setenv("VLLM_XMIX_MAX_GRAPH_VARIANTS", "3")  # app-free, the first app's, every site
    assert len(multi_state(fused_mode=True).graph_variants()) == 3
    monkeypatch.setenv("VLLM_XMIX_MAX_GRAPH_VARIANTS", "many")
    with pytest.raises(ValueError, match="VLLM_XMIX_MAX_GRAPH_VARIANTS='many': expected an integer >= 2"):
        multi_state()


def test_piecewise_variants_onoff(monkeypatch):
    """VLLM_XMIX_PIECEWISE_VARIANTS=onoff: every per-app variant is still captured (its FULL
    graphs), piecewise graphs only for the app-free and every-site variants; a step with one app
    on replays that app's FULL graphs and the every-site pieces, an app-free step the app-free
    ones; the default shares nothing; a bad value names the variable."""
    st = multi_state(fused_mode=True)
    per_app = st.graph_variants()
    assert len(per_app) > 2 and all(st.variants.captures_pieces(m) for m in per_app)
    step(st, new_reqs=[req("a", "probe")])
    assert st.run_mask not in (0, st.all_mask) and st.variants.piecewise_mask() == st.run_mask
    monkeypatch.setenv("VLLM_XMIX_PIECEWISE_VARIANTS", "onoff")
    st = multi_state(fused_mode=True)
    assert st.graph_variants() == per_app  # the FULL graphs keep one variant per app
    assert [m for m in per_app if st.variants.captures_pieces(m)] == [0, st.all_mask]
    step(st, new_reqs=[req("a", "probe")])
    assert st.run_mask not in (0, st.all_mask) and st.run_mask in per_app
    assert st.variants.piecewise_mask() == st.all_mask
    step(st, new_reqs=[], finished=["a"])
    step(st, new_reqs=[])
    assert st.run_mask == 0 and st.variants.piecewise_mask() == 0
    monkeypatch.setenv("VLLM_XMIX_PIECEWISE_VARIANTS", "some")
    with pytest.raises(ValueError, match="VLLM_XMIX_PIECEWISE_VARIANTS='some': expected 'apps' \\(the default\\) or 'onoff'"):
        multi_state()


def test_per_app_variants_capped_in_full_graph_size(monkeypatch):
    """VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE: a per-app variant's FULL graphs stop at that
    size; a step that replays a larger FULL graph with an app on is given the every-site variant
    (its tables filled for it: the SEAL-style app's token positions), one at or below the size, or
    a step without a FULL graph, keeps its app's variant; the app-free and every-site variants
    keep every size; a bad value names the variable."""
    st = multi_state(fused_mode=True, fused_writes="none")
    per_app = st.graph_variants()
    assert st.variants.app_capture_size is None and all(st.variants.captures_full(m, 512) for m in per_app)
    monkeypatch.setenv("VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE", "8")
    st = multi_state(fused_mode=True, fused_writes="none")
    assert st.graph_variants() == per_app  # the same variants, fewer graphs in each per-app one
    gv = st.variants
    assert [m for m in per_app if gv.captures_full(m, 9)] == [0, st.all_mask]
    assert all(gv.captures_full(m, 8) for m in per_app)
    pos = st.conditions.tok_pos

    def fill(ids, n, full):
        st.fill(ids, np.array(n), full_tokens=full)
        return st.run_mask

    so = NS(finished_req_ids=set(), preempted_req_ids=set(), scheduled_new_reqs=[req("a", "probe")],
            scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]))
    st.update_requests(so)
    probe_mask = fill(["a"], [3], None)  # a step without a FULL graph (piecewise or eager)
    assert probe_mask not in (0, st.all_mask)
    assert fill(["a"], [1], 8) == probe_mask  # its FULL graph of 8 tokens was captured
    pos.fill_(-7)
    assert fill(["a"], [1], 16) == st.all_mask  # 16: not captured for the probe's variant
    assert gv.needs_positions()  # the every-site variant's tables: positions written for its gates
    assert pos[0].item() == 0  # (written: -7 before)
    so = NS(finished_req_ids={"a"}, preempted_req_ids=set(), scheduled_new_reqs=[req("b", "steer_all")],
            scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]))
    st.update_requests(so)
    assert fill(["b"], [1], 16) == st.all_mask
    so = NS(finished_req_ids={"b"}, preempted_req_ids=set(), scheduled_new_reqs=[req("c")],
            scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]))
    st.update_requests(so)
    assert fill(["c"], [1], 512) == 0  # apps off: the app-free graphs, whatever the size
    for bad in ("0", "-4", "8.5", "many"):
        monkeypatch.setenv("VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE", bad)
        with pytest.raises(ValueError, match=f"VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE='{re.escape(bad)}': "
                                             "expected an integer >= 1"):
            multi_state()


def test_token_history_of_new_slots_is_staged_whatever_the_prompt_lengths():
    """Prompt ids of requests that get a slot in one step reach their slots' token history (a
    chunk's first token after a prefix-cache hit reads its previous token there), also when the
    step's prompts together exceed the staging buffer (max_tokens 8 here), which then grows."""
    from vllm_xmix import MIApp, deploy
    from vllm_xmix.runtime import XmixState
    from vllm_xmix.spec import parse_deployment

    a = MIApp("seal")
    a.write("add", vector=unit_rms(0)).layers([1]).cond(tokens=[5])
    st = XmixState.build(parse_deployment(deploy(a)["xmix"]), 4, 64, torch.device("cpu"), 8, 5,
                         vocab_size=100, max_model_len=40)
    prompts = {"a": list(range(10, 30)), "b": list(range(50, 53)), "c": list(range(60, 99))}
    reqs = [NS(req_id=r, sampling_params=NS(extra_args={"xmix": {"apps": [{"name": "seal"}]}}),
               prompt_token_ids=p, num_computed_tokens=0) for r, p in prompts.items()]
    so = NS(finished_req_ids=set(), preempted_req_ids=set(), scheduled_new_reqs=reqs,
            scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]))
    st.update_requests(so)
    st.fill(list(prompts), np.array([3, 3, 2]))
    hist = st.conditions.hist
    for rid, p in prompts.items():
        assert hist[st.req_slot[rid], : len(p)].tolist() == p
    # a second step with a new request reuses the (grown) buffers of the ring
    for k in range(5):
        so.scheduled_new_reqs = []
        st.update_requests(so)
        st.fill(list(prompts), np.array([1, 1, 1]))
    assert hist[st.req_slot["c"], :39].tolist() == prompts["c"]


def _two_app_state(max_slots=6, max_tokens=16):
    from vllm_xmix import MIApp, deploy
    from vllm_xmix.runtime import XmixState
    from vllm_xmix.spec import parse_deployment

    a = MIApp("steer")
    a.write("add", vector=unit_rms(0), scale=0.5).layers([1, 2])
    b = MIApp("seal")
    b.write("add", vector=unit_rms(1)).layers([1]).cond(tokens=[5])
    return XmixState.build(parse_deployment(deploy(a, b)["xmix"]), 4, 64, torch.device("cpu"), max_tokens,
                           max_slots, vocab_size=100, max_model_len=40)


def _req(rid, apps, prompt=(1, 2, 3)):
    return NS(req_id=rid, sampling_params=NS(extra_args={"xmix": {"apps": apps}}), prompt_token_ids=list(prompt),
              num_computed_tokens=0)


def test_a_selection_row_is_built_once_and_cannot_be_changed():
    from vllm_xmix.spec import XmixSpecError

    st = _two_app_state()
    reg = st.slots
    r1 = reg.request_row({"xmix": {"apps": [{"name": "steer"}]}})
    r2 = reg.request_row({"xmix": {"apps": [{"name": "steer"}]}})
    assert r1 is r2 and not r1.flags.writeable
    with pytest.raises(ValueError):
        r1[0] = 3.0
    half = reg.request_row({"xmix": {"apps": [{"name": "steer", "scale": 0.25}]}})
    steer = [i for i, e in enumerate(st.layout.entries) if e.app == "steer"]
    assert r1[steer].tolist() == [0.5, 0.5] and half[steer].tolist() == [0.25, 0.25]
    assert reg.request_row({"xmix": {"apps": [{"name": "steer", "scale": 0.0}]}}) is None
    for _ in range(2):  # a refused selection is refused every time, never remembered as a row
        with pytest.raises(XmixSpecError, match="nope"):
            reg.request_row({"xmix": {"apps": [{"name": "nope"}]}})


@pytest.mark.parametrize("n_new", [1, 2, 3, 5])
def test_rows_of_new_slots_reach_the_coefficient_table(n_new):
    """One or two new slots in a step are uploaded row by row, more through one index_copy_:
    either way each slot's row and prompt length land in its own slot, and other slots keep
    theirs."""
    st = _two_app_state()
    scales = [0.1 * (i + 1) for i in range(n_new)]
    reqs = [_req(f"r{i}", [{"name": "steer", "scale": s}], prompt=range(2 + i)) for i, s in enumerate(scales)]
    so = NS(finished_req_ids=set(), preempted_req_ids=set(), scheduled_new_reqs=reqs,
            scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]))
    st.update_requests(so)
    st.fill([r.req_id for r in reqs], np.array([1] * n_new))
    steer = [i for i, e in enumerate(st.layout.entries) if e.app == "steer"]
    for r, s in zip(reqs, scales):
        slot = st.req_slot[r.req_id]
        assert st.layout.coef[slot, steer].tolist() == pytest.approx([s, s])
        assert int(st.conditions.slot_plen[slot]) == len(r.prompt_token_ids)
    held = {st.req_slot[r.req_id] for r in reqs}
    free = [s for s in range(1, st.layout.max_slots) if s not in held]
    assert st.layout.coef[free].abs().sum() == 0


def test_only_requests_with_token_conditions_stage_their_prompt():
    st = _two_app_state()
    so = NS(finished_req_ids=set(), preempted_req_ids=set(),
            scheduled_new_reqs=[_req("s", [{"name": "steer"}], prompt=range(10, 20)),
                                _req("t", [{"name": "seal"}], prompt=range(30, 40))],
            scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]))
    st.update_requests(so)
    assert "s" not in st.slots.req_prompt and st.slots.req_prompt["t"].tolist() == list(range(30, 40))
    st.fill(["s", "t"], np.array([1, 1]))
    hist = st.conditions.hist
    assert hist[st.req_slot["t"], :10].tolist() == list(range(30, 40))
    assert hist[st.req_slot["s"]].abs().sum() == 0


def test_auto_fused_writes_keeps_vllm_norm_fusions():
    """``fused_writes="auto"`` hosts the writes in the norms only where vLLM would not fuse those
    norms with anything else for requests with apps off: an fp8 model (Inductor fuses norm and
    quantization), tensor parallelism (all-reduce + RMSNorm), a compile pass matching RMSNorm.
    (The rule on engine settings; an unquantized one-rank CPU engine resolving to "norm" is in
    tests/test_hooks.py.)"""
    from types import SimpleNamespace as NS

    from vllm_xmix.validation.engine import resolve_fused_writes

    def cfg(quant=None, tp=1, **passes):
        return NS(model_config=NS(quantization=quant), parallel_config=NS(tensor_parallel_size=tp),
                  compilation_config=NS(pass_config=NS(**{"fuse_norm_quant": False, "fuse_allreduce_rms": False, **passes})))

    assert resolve_fused_writes(cfg())[0] == "norm"
    mode, why = resolve_fused_writes(cfg(quant="fp8"))
    assert mode == "none" and "fp8" in why
    assert resolve_fused_writes(cfg(tp=2))[0] == "none"
    mode, why = resolve_fused_writes(cfg(fuse_norm_quant=True))
    assert mode == "none" and "fuse_norm_quant" in why
    assert resolve_fused_writes(cfg(fuse_allreduce_rms=True))[0] == "none"


def cast_state():
    """A CAST app (request-scope cosine at layer 1, conditional add at 2-3) with one spare version,
    and a reserved probe per hooked site."""
    from vllm_xmix import MIApp, deploy
    from vllm_xmix.runtime import XmixState
    from vllm_xmix.spec import parse_deployment

    c = MIApp("cast")
    c.read("cosine", weight=unit_rms(3), buffer="harm", scope="request").layers([1])
    c.write("add", vector=unit_rms(4), scale=2.0).layers([2, 3]).cond(buffer="harm", op=">", threshold=0.2)
    dep = deploy(c)["xmix"]
    dep["reserve"] = {"versions": 1, "linear_probe": 1}
    return c, XmixState.build(parse_deployment(dep), 4, 64, torch.device("cpu"), 64, 5, max_model_len=64)


def test_replace_without_reserved_versions_says_the_deployment_reserved_none():
    """A deployed app whose deployment reserved no spare copy cannot take new parameters while
    serving: the refusal says that (reserve.versions = 0) and how to reserve one, not that copies
    are in use by requests in flight (none is)."""
    from vllm_xmix import MIApp, deploy
    from vllm_xmix.runtime import XmixState
    from vllm_xmix.spec import parse_deployment

    a = MIApp("nudge")
    a.write("add", vector=unit_rms(1), scale=2.0).layers([1])
    st = XmixState.build(parse_deployment(deploy(a)["xmix"]), 4, 64, torch.device("cpu"), 64, 5, max_model_len=64)
    app = a.to_spec().model_dump(mode="json")
    app["ops"][0]["vector"] = [float(x) for x in unit_rms(2)]
    r = st.updates.apply({"action": "replace", "name": "nudge", "version": 1, "app": app, "live": []})
    assert not r["ok"] and "app 'nudge' has no spare copy" in r["error"] and "reserve.versions = 0" in r["error"], r
    assert "in flight" not in r["error"], r


def test_replacing_an_added_app_with_one_reserved_entry_says_the_new_version_needs_another():
    """With one reserved entry at a site, an added app holds it, and its replace (which puts the
    new version into free entries while the current one keeps its own) finds none free: the
    refusal names who holds the entries and that more must be reserved, nothing in flight."""
    from vllm_xmix import MIApp, deploy
    from vllm_xmix.runtime import XmixState
    from vllm_xmix.spec import parse_deployment

    a = MIApp("nudge")
    a.write("add", vector=unit_rms(1), scale=2.0).layers([1])
    dep = deploy(a)["xmix"]
    dep["reserve"] = {"add": {"hook_resid_post": [2]}}
    st = XmixState.build(parse_deployment(dep), 4, 64, torch.device("cpu"), 64, 5, max_model_len=64)
    new = {"name": "extra", "ops": [{"primitive": "write", "kind": "add", "layers": [2],
                                     "vector": [float(x) for x in unit_rms(2)]}]}
    assert st.updates.apply({"action": "add", "name": "extra", "version": 1, "app": new, "live": []})["ok"]
    new["ops"][0]["vector"] = [float(x) for x in unit_rms(3)]
    r = st.updates.apply({"action": "replace", "name": "extra", "version": 2, "app": new, "live": []})
    assert not r["ok"] and r["status"] == 507, r
    assert "held by 'extra' version 1" in r["error"] and "reserve more entries at this site" in r["error"], r


def test_replaced_cast_threshold_goes_into_the_spare_copy_with_its_own_condition_read():
    c, st = cast_state()
    lay = st.layout
    orig, spare = lay.copies["cast"]
    n_pool = len([e for es in lay.pool.values() for e in es])
    counts = lambda: {k: v for k, v in st.counts().items() if k.startswith(("versions", "entries", "spare",  # noqa
                                                                           "reserved"))}
    assert counts() == dict(versions_held=1, versions_superseded=0, entries_held=3, spare_total=3, spare_free=3,
                            reserved_total=n_pool, reserved_free=n_pool) and n_pool > 0
    app = c.to_spec().model_dump(mode="json")
    app["ops"][1]["cond"]["threshold"] = 0.5
    app["ops"][1]["scale"] = 3.0
    app["ops"][1]["vector"] = [float(x) for x in unit_rms(5)]
    assert st.updates.apply({"action": "replace", "name": "cast", "version": 1, "app": app, "live": []})["ok"]
    assert lay.version_entries[("cast", 1)] == spare and lay.version_entries[("cast", 0)] == orig
    # version 0 is kept (released at a later change once no request runs it)
    assert counts() == dict(versions_held=2, versions_superseded=1, entries_held=6, spare_total=3, spare_free=0,
                            reserved_total=n_pool, reserved_free=n_pool)
    thr = lay.conditions.cond_args["cond_thr"]
    read0, read1 = orig[0], spare[0]
    for e0, e1 in zip(orig[1:], spare[1:]):  # the conditional writes
        assert lay.entries[e0].cthr == pytest.approx(0.2) and float(thr[e0]) == pytest.approx(0.2)
        assert lay.entries[e1].cthr == pytest.approx(0.5) and float(thr[e1]) == pytest.approx(0.5)
        assert lay.conditions.cond_host[e1][4] == pytest.approx(0.5)
        # each copy's writes read their own copy's request-scope condition value
        assert lay.entries[e0].cidx == lay.entries[read0].req_k != lay.entries[e1].cidx == lay.entries[read1].req_k
        np.testing.assert_array_equal(lay.vectors[e1].numpy(), unit_rms(5))
        np.testing.assert_array_equal(lay.vectors[e0].numpy(), unit_rms(4))
    row1 = st.slots.request_row({"xmix": {"apps": [{"name": "cast", "version": 1}]}})
    row0 = st.slots.request_row({"xmix": {"apps": [{"name": "cast"}]}})
    assert set(np.flatnonzero(row1)) == set(spare) and set(np.flatnonzero(row0)) == set(orig)
    assert row1[spare[1]] == 3.0 and row0[orig[1]] == 2.0
    # version 0 still used by a request in flight: no free copy for version 2 (the structure has
    # a condition, so no reserved entries either): 507; once it is done, its copy is reused
    r = st.updates.apply({"action": "replace", "name": "cast", "version": 2, "app": app, "live": [["cast", 0]]})
    assert not r["ok"] and r["status"] == 507 and "copies of app 'cast'" in r["error"], r
    r = st.updates.apply({"action": "replace", "name": "cast", "version": 2, "app": app, "live": []})
    assert r["ok"] and lay.version_entries[("cast", 2)] == orig and ("cast", 0) not in lay.version_entries
    assert counts()["versions_superseded"] == 1 and counts()["entries_held"] == 6  # version 1 until the next change
    # a replace that changes the structure is refused; an add of a probe takes a reserved entry
    bad = {**app, "ops": [app["ops"][0], {**app["ops"][1], "layers": [3]}]}
    r = st.updates.apply({"action": "replace", "name": "cast", "version": 3, "app": bad, "live": []})
    assert not r["ok"] and r["status"] == 400 and "must keep its ops" in r["error"]
    probe = {"name": "p", "ops": [{"primitive": "read", "kind": "linear_probe", "layers": [1],
                                   "weight": [1.0] * 64}]}
    r = st.updates.apply({"action": "add", "name": "p", "version": 1, "app": probe, "live": []})
    assert r["ok"] and lay.version_entries[("p", 1)] == lay.pool[(1, "hook_resid_post", "linear_probe")]
    assert counts() == dict(versions_held=2, versions_superseded=0, entries_held=4, spare_total=3, spare_free=3,
                            reserved_total=n_pool, reserved_free=n_pool - 1)  # version 1 of cast released
    assert lay.read_info[lay.version_entries[("p", 1)][0]][4:] == ("p", "probe", 1)


def test_site_keys_find_the_sites_of_a_hook_op_call():
    """The hook ops find their sites from a tensor of the hooked module (a hosting norm's weight,
    a key buffer), not from integer arguments (no per-layer constant in the compiled graph); a
    tensor replaced after install is found again, and memory that another module's tensor had
    is not taken for that module's; a tensor no hooked module has, or two modules sharing one
    key tensor, raise."""
    from vllm_xmix.runtime.site_keys import SiteKeys, key_buffer

    norms = [torch.nn.Module() for _ in range(3)]
    for m in norms:
        m.weight = torch.nn.Parameter(torch.ones(8))
    keys = SiteKeys()
    for i, m in enumerate(norms):
        keys.add(m, "weight", (2 * i, 2 * i + 1 if i else -1))
    mlp = torch.nn.Linear(2, 2)
    attr = key_buffer(mlp, "hook_mlp_out")
    assert key_buffer(mlp, "hook_mlp_out") == attr and getattr(mlp, attr).numel() == 1
    assert attr not in mlp.state_dict()  # not a checkpoint tensor
    keys.add(mlp, attr, (7,))
    assert [keys.sites_of(m.weight.data) for m in norms] == [(0, -1), (2, 3), (4, 5)]
    assert keys.sites_of(getattr(mlp, attr)) == (7,)
    norms[1].weight = torch.nn.Parameter(torch.zeros(8))  # replaced: looked up again
    assert keys.sites_of(norms[1].weight.data) == (2, 3)
    # a tensor at the address another module's key had: a hit only while that module still owns it
    a, b = torch.nn.Module(), torch.nn.Module()
    a.k, b.k = torch.zeros(4), torch.zeros(4)
    keys2 = SiteKeys()
    keys2.add(a, "k", (1,))
    keys2.add(b, "k", (2,))
    assert keys2.sites_of(a.k) == (1,) and keys2.sites_of(b.k) == (2,)
    old_a = a.k
    a.k = torch.zeros(4)  # a's key moves; b takes over the storage a had
    b.k = old_a
    assert keys2.sites_of(b.k) == (2,) and keys2.sites_of(a.k) == (1,)
    with pytest.raises(RuntimeError, match="no hooked module has"):
        keys.sites_of(torch.ones(8))
    norms[2].weight = norms[0].weight
    with pytest.raises(RuntimeError, match="share one key tensor"):
        keys.sites_of(torch.ones(8))


def test_token_positions_are_uploaded_only_for_variants_whose_ops_read_them():
    """The step fill writes ``tok_pos`` (each token's absolute position, read by conditional
    writes, request-scope and latch reads, and the token bookkeeping) only in steps whose
    variant has such an op: a step with the probe alone leaves it as it was, a step with the
    token-conditioned (SEAL-style) app writes the positions of all of its tokens."""
    st = multi_state(fused_mode=True, fused_writes="none")
    st.graph_variants()
    pos = st.conditions.tok_pos
    pos.fill_(-7)  # a value no fill writes
    so = NS(finished_req_ids=set(), preempted_req_ids=set(),
            scheduled_new_reqs=[req("a", "probe")], scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]))
    st.update_requests(so)
    st.fill(["a"], np.array([3]))
    assert not st.variants.needs_positions() and (pos == -7).all()
    so = NS(finished_req_ids={"a"}, preempted_req_ids=set(), scheduled_new_reqs=[req("b", "seal")],
            scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]))
    st.update_requests(so)
    st.fill(["b"], np.array([3]))
    assert st.variants.needs_positions()
    assert pos[:3].tolist() == [0, 1, 2]  # the prompt's positions (a first chunk: computed tokens 0)


def test_a_conditional_app_inside_another_apps_sites_keeps_its_own_variant():
    """An unconditional app nested in another's sites runs in that app's variant (a probe in
    steer_all's); a conditional one (CAST: a request-scope condition read and a gated add, all
    at steer_all's hook points) does not: steer_all's steps launch neither its gates nor its
    condition read and upload no token positions, and a step mixing the two replays every site."""
    from vllm_xmix import MIApp, deploy
    from vllm_xmix.runtime import XmixState
    from vllm_xmix.spec import parse_deployment

    steer, probe, cast = MIApp("steer_all"), MIApp("probe"), MIApp("cast")
    steer.write("add", vector=unit_rms(0)).layers("all").submodule("hook_resid_post")
    probe.read("linear_probe", weight=unit_rms(2)).layers([1]).submodule("hook_resid_post")
    cast.read("cosine", weight=unit_rms(3), buffer="sim", scope="request").layers([1]).submodule("hook_resid_post")
    cast.write("add", vector=unit_rms(4)).layers([2]).submodule("hook_resid_post").cond(buffer="sim", op=">",
                                                                                         threshold=0.0)
    st = XmixState.build(parse_deployment(deploy(steer, probe, cast, fused_writes="none")["xmix"]), 4, 64,
                         torch.device("cpu"), 64, 8, vocab_size=32, max_model_len=64)
    st.fused_mode = True
    st.graph_variants()
    post1, post2 = st.sites[(1, "hook_resid_post")], st.sites[(2, "hook_resid_post")]

    def apps_at(site):
        p = st.site_plan(site, fused=0)
        pre = p.pre.tolist() if p is not None and p.pre is not None else []  # adds beside conditional writes
        return None if p is None else sorted({st.entries[e].app for e in p.writes_host + p.reads_host + pre})

    step(st, new_reqs=[req("a", "steer_all"), req("b", "probe")])  # the probe is nested: steer_all's variant
    assert st.run_mask != st.all_mask and apps_at(post1) == ["probe", "steer_all"]
    assert apps_at(post2) == ["steer_all"] and not st.variants.needs_positions()
    step(st, finished=["b"], cached=["a"], new_reqs=[req("c", "cast")])  # not nested: every site
    assert st.run_mask == st.all_mask and apps_at(post2) == ["cast", "steer_all"] and st.variants.needs_positions()
    step(st, finished=["a"], cached=["c"])  # CAST's own variant, which holds the probe (unconditional, at its site)
    assert st.run_mask != st.all_mask and apps_at(post1) == ["cast", "probe"] and apps_at(post2) == ["cast"]
