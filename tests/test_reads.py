"""Read results under vLLM's scheduling features (real vLLM, CPU, fp32, tiny Llama): chunked
prefill, preemption with recompute and prefix caching must not drop, duplicate or misalign
values (cases C02/C14/C15 in ../shared/research/cases_log.md); bad read specs and requests fail
loudly. Values are checked against the HF oracle, position by position."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import close_llm, make_llm, unit_rms
from test_hooks import close

W = unit_rms(41) / 8
LONG = [int(x) for x in np.random.default_rng(5).integers(3, 1000, size=45)]  # 45-token prompts
PROMPTS = [LONG, LONG[::-1], LONG[5:30], [7, 8, 9]]
N = 24


def deployment():
    from vllm_xmix import MIApp, deploy

    a = MIApp("pr")
    a.read("linear_probe", weight=W, bias=0.1).layers([2]).submodule("hook_resid_post")
    a.read("capture", name="cap").layers([1]).submodule("hook_resid_mid")
    g = MIApp("gen")  # only generated positions: needs no prompt values, keeps the prefix cache
    g.read("capture", positions="generated").layers([3]).submodule("hook_resid_pre")
    c = MIApp("cos")  # cosine similarity with a direction, one float per position
    c.read("cosine", weight=W).layers([2]).submodule("hook_resid_post")
    return deploy(a, g, c)


def sp(apps, max_tokens=N, **kw):
    from vllm_xmix import SamplingParams

    kw.setdefault("temperature", 0)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, mi_apps=apps, **kw)


def check_pr(o, prompt, hf):
    """The 'pr' app's values equal HF at every processed position, none missing."""
    ids = list(prompt) + list(o.outputs[0].token_ids)[:-1]
    rec = hf.record(ids, [(2, "hook_resid_post"), (1, "hook_resid_mid")])
    probe, cap = o.mi_results["pr"]["probe"], o.mi_results["pr"]["cap"]
    assert probe.shape == (len(ids),) and cap.shape == (len(ids), 64)
    assert not np.isnan(probe).any() and not np.isnan(cap).any()
    close(probe, rec[(2, "hook_resid_post")].astype(np.float64) @ W.astype(np.float64) + 0.1, "probe")
    close(cap, rec[(1, "hook_resid_mid")], "cap")


@pytest.fixture(scope="module")
def chunked(tiny_llama):
    """16-token prefill chunks, 16-token KV blocks, only 8 blocks: long prompts are split over
    several steps and running requests get preempted (and recomputed)."""
    llm = make_llm(tiny_llama, "eager", additional_config=deployment(), max_num_batched_tokens=16,
                   max_num_seqs=4, block_size=32, num_gpu_blocks_override=6, enable_prefix_caching=True,
                   max_model_len=128)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    preempted = []
    orig = sched._preempt_request

    def count(request, *a, **k):
        preempted.append(request.request_id)
        return orig(request, *a, **k)

    sched._preempt_request = count
    llm.preempted = preempted
    yield llm
    close_llm(llm)


def test_chunked_prefill_and_preemption_keep_alignment(chunked, hf):
    outs = chunked.generate([{"prompt_token_ids": p} for p in PROMPTS], sp(["pr"]), use_tqdm=False)
    assert chunked.preempted, "the test setup must force at least one preemption"
    for o, p in zip(outs, PROMPTS):
        assert list(o.outputs[0].token_ids) == hf.greedy(p, N)
        check_pr(o, p, hf)


def test_reads_of_repeated_prompts_are_not_taken_from_the_prefix_cache(chunked, hf):
    """A probe needs a value at every prompt position: a request with it never reuses cached
    prompt blocks (same prompt, same app, twice); a capture of generated positions only keeps
    the prefix cache, and its values are still complete."""
    for _ in range(2):
        o = chunked.generate([{"prompt_token_ids": LONG}], sp(["pr"], max_tokens=4), use_tqdm=False)[0]
        assert o.num_cached_tokens == 0
        check_pr(o, LONG, hf)
    first = chunked.generate([{"prompt_token_ids": LONG}], sp(["gen"], max_tokens=4), use_tqdm=False)[0]
    again = chunked.generate([{"prompt_token_ids": LONG}], sp(["gen"], max_tokens=4), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    for o in (first, again):
        x = hf.record(LONG + list(o.outputs[0].token_ids)[:-1], [(3, "hook_resid_pre")])[(3, "hook_resid_pre")]
        close(o.mi_results["gen"]["capture"], x[len(LONG) - 1:], "gen")


def test_a_stop_string_ends_the_request_with_all_its_values(chunked, hf):
    """A stop string is matched in the front end, which ends the request there (the engine core
    sends no final output): the values of a non-streamed request still come back, one per
    processed position and equal to HF's, offline as over HTTP (same path)."""
    free = chunked.generate([{"prompt_token_ids": LONG}], sp(["pr"], max_tokens=16), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = chunked.get_tokenizer().decode(list(free.outputs[0].token_ids)[6:8])  # text of tokens 6-7
    assert stop and stop in text
    o = chunked.generate([{"prompt_token_ids": LONG}], sp(["pr"], max_tokens=16, stop=[stop]), use_tqdm=False)[0]
    assert o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason == stop
    assert len(o.outputs[0].token_ids) < 16
    assert o.mi_results is not None, "a stop string must not drop the request's read values"
    check_pr(o, LONG, hf)


def test_streaming_outputs_grow_and_end_complete(chunked, hf):
    """With DELTA outputs (as the server streams) every RequestOutput carries the values so far;
    the final one has them all."""
    from vllm.sampling_params import RequestOutputKind

    p = sp(["pr"], max_tokens=6)
    p.output_kind = RequestOutputKind.DELTA
    engine = chunked.llm_engine
    engine.add_request("s0", {"prompt_token_ids": PROMPTS[2]}, p)
    seen, toks = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks += o.outputs[0].token_ids
            seen.append(len(o.mi_results["pr"]["probe"]))
            last = o
    assert seen == sorted(seen) and seen[-1] == len(PROMPTS[2]) + 6 - 1
    assert toks == hf.greedy(PROMPTS[2], 6)
    probe = last.mi_results["pr"]["probe"]
    ids = PROMPTS[2] + toks[:-1]
    want = hf.record(ids, [(2, "hook_resid_post")])[(2, "hook_resid_post")].astype(np.float64) @ W + 0.1
    close(probe, want, "probe")


def test_only_requests_with_apps_get_the_plugins_per_output_code(chunked, hf):
    """The front end's per-output code (read values assembled into ``mi_results``) belongs to
    the ``RequestState`` of a request that selects apps only (a subclass it is switched to): a
    request without apps keeps vLLM's class and ``make_request_output`` (nothing of the plugin per
    output) and still gets HF's tokens, while one with a probe beside it gets its values. Both
    states are freed by reference counting once finished (no cycle left for the garbage
    collector: a state holds the request's values)."""
    import gc
    import weakref

    from vllm.v1.engine.output_processor import RequestState

    engine = chunked.llm_engine
    engine.add_request("with-apps", {"prompt_token_ids": PROMPTS[2]}, sp(["pr"], max_tokens=4))
    engine.add_request("no-apps", {"prompt_token_ids": PROMPTS[3]}, sp(None, max_tokens=4))
    states = {tuple(st.prompt_token_ids): st for st in engine.output_processor.request_states.values()}
    assert set(states) == {tuple(PROMPTS[2]), tuple(PROMPTS[3])}
    with_apps, no_apps = states[tuple(PROMPTS[2])], states[tuple(PROMPTS[3])]
    assert type(no_apps) is RequestState and "make_request_output" not in no_apps.__dict__
    assert isinstance(with_apps, RequestState) and type(with_apps) is not RequestState
    assert type(with_apps).make_request_output is not RequestState.make_request_output
    refs = [weakref.ref(with_apps), weakref.ref(no_apps)]
    del states, with_apps, no_apps
    done = {}
    gc.disable()
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[tuple(o.prompt_token_ids)] = o
        assert [r() is None for r in refs] == [True, True], "a finished request's state outlives it"
    finally:
        gc.enable()
    free, probed = done[tuple(PROMPTS[3])], done[tuple(PROMPTS[2])]
    assert free.mi_results is None and list(free.outputs[0].token_ids) == hf.greedy(PROMPTS[3], 4)
    assert probed.mi_results["pr"]["probe"].shape == (len(PROMPTS[2]) + 4 - 1,)


def test_an_engine_core_request_added_directly_is_checked_and_salted(chunked, hf):
    """An ``EngineCoreRequest`` passed to ``add_request`` (vLLM's deprecated path, which skips
    ``process_inputs``) gets the same selection check, canonical form and cache salt: a
    malformed selection is a ValueError naming the request before anything reaches the engine
    core (which keeps serving), and a probe in the caller's own form (a name list) still
    computes every prompt position, so its values equal HF's even when that prompt's blocks are
    in the prefix cache from a request without apps."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    engine = chunked.llm_engine
    raw = InputProcessor.process_inputs.__wrapped__  # vLLM's own: no check, no salt

    def request(rid, sel, max_tokens=4):
        params = VllmSamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                    extra_args=None if sel is None else {"xmix": sel})
        return raw(engine.input_processor, rid, {"prompt_token_ids": LONG}, params,
                   supported_tasks=engine.get_supported_tasks())

    def run(req):
        engine.add_request(req.request_id, req, req.sampling_params)
        done = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                done = o if o.finished else done
        return done

    first = run(request("ecr-plain", None))  # LONG's blocks now in the prefix cache, unsalted
    assert first.mi_results is None and list(first.outputs[0].token_ids) == hf.greedy(LONG, 4)
    for bad, field in ((["nope"], "unknown app"), ([{"name": "pr", "scale": "high"}], "scale")):
        with pytest.raises(ValueError, match=f"request ecr-bad: extra_args.xmix.*{field}"):
            engine.add_request("ecr-bad", request("ecr-bad", bad), None)
        assert not engine.has_unfinished_requests() and "ecr-bad" not in engine.output_processor.request_states
    req = request("ecr-probe", ["pr"])
    callers = req.sampling_params
    o = run(req)
    assert callers.extra_args == {"xmix": ["pr"]}, "the caller's SamplingParams must keep its own spelling"
    assert o.num_cached_tokens == 0, "a probe's prompt must be computed, not read from the prefix cache"
    assert list(o.outputs[0].token_ids) == hf.greedy(LONG, 4)
    check_pr(o, LONG, hf)
    # one that came out of the (patched) process_inputs is canonical already: checked again, unchanged
    req = engine.input_processor.process_inputs("ecr-processed", {"prompt_token_ids": LONG},
                                                sp(["pr"], max_tokens=4), supported_tasks=engine.get_supported_tasks())
    wire, salt = req.sampling_params.extra_args["xmix"], req.cache_salt
    o = run(req)
    assert req.sampling_params.extra_args["xmix"] == wire and req.cache_salt == salt
    assert o.num_cached_tokens == 0
    check_pr(o, LONG, hf)
    # AsyncLLM.add_request checks an EngineCoreRequest the same way, before anything is added
    import asyncio
    from types import SimpleNamespace

    from vllm.v1.engine.async_llm import AsyncLLM

    with pytest.raises(ValueError, match="request ecr-async: extra_args.xmix.*unknown app"):
        asyncio.run(AsyncLLM.add_request(SimpleNamespace(vllm_config=engine.vllm_config), "ecr-async",
                                         request("ecr-async", ["nope"]), None))
    again = run(request("ecr-plain-2", None))  # the engine still serves, the cache as before
    assert list(again.outputs[0].token_ids) == hf.greedy(LONG, 4) and again.num_cached_tokens > 0


def test_a_stream_without_apps_is_vllms_own_generator():
    """A streamed completion or chat request that selects no app gets vLLM's stream generator
    itself (nothing of the plugin per chunk on the server's event loop); one that selects apps
    gets the generator that adds read values to its chunks."""
    import inspect
    from types import SimpleNamespace

    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from vllm_xmix._vllm_compat import apply_patches

    apply_patches()  # (idempotent; the plugin has applied them in this process if an engine ran)
    for cls, name in ((OpenAIServingCompletion, "completion_stream_generator"),
                      (OpenAIServingChat, "chat_completion_stream_generator")):
        patched = getattr(cls, name)
        vllm_code = patched.__wrapped__.__code__
        params = inspect.signature(patched.__wrapped__).parameters.values()
        rest = [None] * (sum(p.default is inspect.Parameter.empty for p in params) - 2)  # after self, request

        def gen(xargs):  # the generator the server would stream (created, never started)
            return patched(None, SimpleNamespace(vllm_xargs=xargs), *rest)

        assert gen(None).ag_code is vllm_code and gen({"other": "1"}).ag_code is vllm_code, name
        with_apps = gen({"xmix": '["pr"]'})
        assert with_apps.ag_code is not vllm_code and with_apps.ag_code.co_name == "stream_with_reads", name


def test_streamed_outputs_merged_by_a_slow_consumer_carry_the_latest_values(chunked, hf):
    """A streaming consumer that lags (a busy server) gets vLLM's DELTA outputs merged into one
    (``RequestOutputCollector.put`` -> ``RequestOutput.add``): the merged output's values are those
    of the newest output merged in, not of the first (found by the soak test: a stream's final
    chunk missed the values of the steps merged into it)."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import RequestOutputCollector

    p = sp(["pr"], max_tokens=6)
    p.output_kind = RequestOutputKind.DELTA
    engine = chunked.llm_engine
    engine.add_request("m0", {"prompt_token_ids": PROMPTS[3]}, p)
    collector = RequestOutputCollector(RequestOutputKind.DELTA, "m0")
    n_outputs = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            collector.put(o)  # nobody takes them: every later output is merged into the first
            n_outputs += 1
    merged = collector.get_nowait()
    assert n_outputs > 2 and merged.finished
    toks = list(merged.outputs[0].token_ids)
    assert toks == hf.greedy(PROMPTS[3], 6)
    probe = merged.mi_results["pr"]["probe"]
    assert probe.shape == (len(PROMPTS[3]) + 6 - 1,)
    ids = PROMPTS[3] + toks[:-1]
    want = hf.record(ids, [(2, "hook_resid_post")])[(2, "hook_resid_post")].astype(np.float64) @ W + 0.1
    close(probe, want, "probe")


def test_final_only_requests_get_their_values_once_at_the_end(chunked, hf, monkeypatch):
    """Offline ``generate`` (FINAL_ONLY outputs) uses a request's values only at the end: the
    engine core keeps them until the final output, so the front end receives them once per
    request rather than with every token (counted at the front end's accumulator), across
    chunked prefill and preemption, and they equal HF."""
    from vllm_xmix import results

    calls = []
    real = results.ReadResults.add
    monkeypatch.setattr(results.ReadResults, "add", lambda self, chunks: (calls.append(len(chunks)),
                                                                         real(self, chunks))[1])
    outs = chunked.generate([{"prompt_token_ids": p} for p in PROMPTS], sp(["pr"]), use_tqdm=False)
    assert len(calls) == len(PROMPTS), calls
    assert all(c > 1 for c in calls)  # every step's chunks, in one output
    for o, p in zip(outs, PROMPTS):
        check_pr(o, p, hf)


def test_read_request_errors(chunked):
    with pytest.raises(ValueError, match=r"mi_apps\[0\]: app 'pr' has reads; reads with n > 1"):
        chunked.generate([{"prompt_token_ids": [1, 2, 3]}], sp(["pr"], max_tokens=2, n=2, temperature=1.0), use_tqdm=False)
    # scale 0 switches the app (and its reads) off; the engine still serves
    o = chunked.generate([{"prompt_token_ids": [1, 2, 3]}], sp([{"name": "pr", "scale": 0.0}], max_tokens=2), use_tqdm=False)[0]
    assert o.mi_results is None


def test_read_deployment_errors(tiny_llama):
    from vllm_xmix import MIApp, XmixSpecError, deploy

    with pytest.raises(XmixSpecError, match=r"weight: a 'linear_probe' read needs a weight vector"):
        deploy(MIApp("p").read("linear_probe"))
    with pytest.raises(XmixSpecError, match=r"positions: unknown positions 'first'"):
        deploy(MIApp("p").read("capture", positions="first"))
    with pytest.raises(XmixSpecError, match=r"only captures take positions"):
        deploy(MIApp("p").read("linear_probe", weight=W, positions="last"))
    with pytest.raises(XmixSpecError, match=r"unknown read kind 'mean'"):
        MIApp("p").read("mean")
    a = MIApp("p")
    a.read("capture")
    a.read("capture", positions="last")
    with pytest.raises(XmixSpecError, match=r"read names \['capture'\] used twice"):
        deploy(a)
    with pytest.raises(XmixSpecError, match=r"conditional reads are not yet supported"):
        deploy(MIApp("p").read("linear_probe", weight=W).cond(tokens=[1]))
    with pytest.raises(XmixSpecError, match=r"sigmoid: Input should be a valid boolean"):
        deploy(MIApp("p").read("linear_probe", weight=W, sigmoid="yes"))
    b = MIApp("p").write("add", vector=W).layers([1])  # a chained builder passed as a request app
    from vllm_xmix import SamplingParams

    assert SamplingParams(mi_apps=[b]).extra_args["xmix"]["apps"][0]["hash"] == b.content_hash()
    # checked against the model when the engine is configured
    with pytest.raises(ValueError, match=r"ops\.0\.weight: length 63 != d_model 64"):
        make_llm(tiny_llama, "eager", additional_config=deploy(MIApp("p").read("linear_probe", weight=W[:63])))
    with pytest.raises(ValueError, match=r"'mlp.hook_router_logits' is not available on LlamaForCausalLM"):
        make_llm(tiny_llama, "eager",
                 additional_config=deploy(MIApp("p").read("capture").submodule("mlp.hook_router_logits")))


def test_cosine_read_is_one_float_per_position(chunked, hf):
    o = chunked.generate([{"prompt_token_ids": PROMPTS[2]}], sp(["cos"], max_tokens=5), use_tqdm=False)[0]
    ids = PROMPTS[2] + list(o.outputs[0].token_ids)[:-1]
    x = hf.record(ids, [(2, "hook_resid_post")])[(2, "hook_resid_post")].astype(np.float64)
    want = x @ (W / np.linalg.norm(W)) / np.linalg.norm(x, axis=1)
    got = o.mi_results["cos"]["cosine"]
    assert got.shape == (len(ids),)
    close(got, want, "cosine")
    # the same values as JSON for the OpenAI server (kv_transfer_params of the final output)
    np.testing.assert_allclose(o.kv_transfer_params["xmix_results"]["cos"]["cosine"], got, rtol=1e-6)


def test_read_only_app_refuses_a_scale(chunked):
    with pytest.raises(ValueError, match=r"mi_apps\[0\]\.scale: app 'pr' has no writes"):
        chunked.generate([{"prompt_token_ids": [1, 2, 3]}], sp([{"name": "pr", "scale": 5.0}], max_tokens=2),
                         use_tqdm=False)


def test_buffer_limits_and_prompt_embeds_are_checked_before_workers_start(tiny_llama):
    from vllm_xmix import MIApp, deploy

    a = MIApp("big")
    a.read("capture").layers("all").submodule("hook_resid_mid")
    with pytest.raises(ValueError, match=r"GiB of device buffers \(read buffer"):
        make_llm(tiny_llama, "eager", additional_config=deploy(a), max_num_batched_tokens=5_000_000)
    s = MIApp("seal")
    s.write("add", vector=W).layers([1]).cond(tokens=[5])
    with pytest.raises(ValueError, match=r"token conditions .* enable_prompt_embeds"):
        make_llm(tiny_llama, "eager", additional_config=deploy(s), enable_prompt_embeds=True)


def test_read_snapshots_reuse_their_host_buffers_and_keep_each_steps_values():
    """The transport's snapshots of successive steps (as with async scheduling: a later step's
    snapshot taken before an earlier one is split) each keep their own values; buffers come
    back once split and are reused, a larger step gets a larger one. On CPU the snapshot is a
    clone; on CUDA a pooled pinned buffer."""
    import torch

    from vllm_xmix.runtime.reads import ReadTransport

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.zeros(300, 2, device=dev)
    rt = ReadTransport(out)
    info = (("all", 0, 1, "probe", "app", "p", 3),)

    def step(T, v):
        out[:T, 0] = torch.arange(T, device=dev, dtype=torch.float32) + v
        rt.step_reads = [("r", 0, T, 10, info, 5)]
        rt.snapshot()

    def values(snap):
        (chunk,) = rt.reads_of(snap)["r"]
        return np.frombuffer(chunk[-1], dtype=np.float32).tolist()

    step(8, 100.0)
    step(8, 200.0)  # before the first is split
    assert values(rt.pop_snapshot()) == [100.0 + i for i in range(8)]
    assert values(rt.pop_snapshot()) == [200.0 + i for i in range(8)]
    if dev == "cuda":
        assert len(rt._free) == 2
        bufs = {b.data_ptr() for b, _ in rt._free}
        step(8, 300.0)
        assert rt._snapshots[-1][0].data_ptr() in bufs  # reused
        assert values(rt.pop_snapshot()) == [300.0 + i for i in range(8)]
        step(200, 400.0)  # larger than the pooled buffers (64 rows): a new one
        snap = rt.pop_snapshot()
        assert snap[0].shape[0] >= 200 and values(snap) == [400.0 + i for i in range(200)]


def test_assembled_values_of_a_stream_end_to_end_and_with_gaps():
    """A request's values put together from its chunks (the prompt's, then one position per
    decode step): end to end they are the values sent, position for position; a generated-only
    capture starts at the last prompt position; missing positions are NaN (a short stream), a
    value beyond the request's end is dropped, and a recomputed position keeps its first value (the
    one a stream has already sent: a recomputation in a differently sized batch can round it
    differently)."""
    from vllm_xmix.results import ReadResults

    P, G = 5, 4
    vals = np.arange(P + G - 1, dtype=np.float32) * 0.5 - 1  # position i -> vals[i]
    cap = np.arange((P + G - 1) * 2, dtype=np.float32).reshape(-1, 2)

    def ch(name, tag, p0, n, src):
        return ("a", name, 3, tag, p0, n, src.shape[1] if src.ndim > 1 else 1, src[p0:p0 + n].tobytes())

    acc = ReadResults(P)
    acc.add([ch("p", "probe", 0, P, vals), ch("g", "generated", P - 1, 1, cap)])
    for p in range(P, P + G - 1):
        acc.add([ch("p", "probe", p, 1, vals), ch("g", "generated", p, 1, cap)])
    out = acc.assemble(G)
    np.testing.assert_array_equal(out["a"]["p"], vals)
    np.testing.assert_array_equal(out["a"]["g"], cap[P - 1:])
    assert out["a"]["p"].flags.writeable  # (a copy: the caller may change it)
    longer = acc.assemble(G + 2)["a"]["p"]  # two positions never sent: NaN
    np.testing.assert_array_equal(longer[:P + G - 1], vals)
    assert np.isnan(longer[P + G - 1:]).all() and len(longer) == P + G + 1
    np.testing.assert_array_equal(acc.assemble(G - 1)["a"]["p"], vals[:-1])  # beyond the end: dropped
    redo = np.full_like(vals, 9.0)
    acc.add([ch("p", "probe", P + 1, 1, redo)])  # position P+1 computed again (after a preemption)
    np.testing.assert_array_equal(acc.assemble(G)["a"]["p"], vals)


def test_streamed_values_end_to_end_whatever_the_chunks():
    """A stream's values (:class:`StreamDelta`, its text path and its parsed path alike) put
    together over its chunks are each read's values, position for position: a prompt chunk, one
    chunk per decode step, outputs merged by a lagging stream (several chunks at once, the later
    ones not yet part of the output being streamed), a position computed again after a
    preemption (the value already sent stays), a capture of width 2 beside a probe, and a
    non-finite value (null)."""
    import json

    from vllm_xmix.results import ReadResults, StreamDelta

    P, G = 6, 9
    vals = np.arange(P + G - 1, dtype=np.float32) * 0.25 - 1  # position i -> vals[i]
    vals[P + 3] = np.inf
    cap = np.arange((P + G - 1) * 2, dtype=np.float32).reshape(-1, 2)

    def ch(name, tag, p0, n, src):
        return ("a", name, 3, tag, p0, n, src.shape[1] if src.ndim > 1 else 1, src[p0:p0 + n].tobytes())

    for with_capture in (False, True):
        acc, d = ReadResults(P), StreamDelta()
        got = {"p": {}, "g": {}}

        def stream(upto=None):
            text = d.take_text(acc, upto)
            out = json.loads(text) if text is not None else json.loads(json.dumps(d.take(acc, upto)))
            for name, entry in out.get("a", {}).items():
                for k, v in enumerate(entry["values"]):
                    got[name].setdefault(entry["pos0"] + k, v)  # (a position sent twice would keep its first)

        def step(p, n=1, src=None):
            acc.add([ch("p", "probe", p, n, vals if src is None else src)]
                    + ([ch("g", "generated", max(p, P - 1), p + n - max(p, P - 1), cap)] if with_capture else []))

        step(0, P)  # the prompt: positions 0 .. P-1
        stream()
        step(P)
        step(P + 1)
        stream()  # two decode steps merged into one output
        step(P + 2)
        step(P + 3)
        stream(acc.n_chunks - (2 if with_capture else 1))  # the output of step P+2; step P+3's chunk waits
        stream()
        redo = vals.copy()
        redo[P + 3] = 7.0
        step(P + 3, 2, redo)  # after a preemption P+3 computed again (already sent: stays) with P+4
        stream()
        for p in range(P + 5, P + G - 1):
            step(p)
            stream()
        want = [None if not np.isfinite(v) else float(v) for v in vals]
        assert [got["p"][i] for i in range(P + G - 1)] == want
        if with_capture:
            assert [got["g"][i] for i in range(P - 1, P + G - 1)] == cap[P - 1:].tolist()
        else:
            assert not got["g"]
        final = acc.assemble(G)["a"]
        np.testing.assert_array_equal(final["p"], vals)
        assert final["p"].flags.writeable


def test_streamed_values_of_several_probes_a_step():
    """A probe at two layers beside a second app's probe: each decode step brings three values
    (one chunk each), taken without a parse (``StreamDelta.take_text``'s several-reads path) as
    long as the steps come whole and in order; a stream's values put together are each read's
    values at each layer, position for position, under chunks of one step, merged steps, a
    lagging stream and a recomputed position, and the chunk's JSON nests a read at several
    layers under its layers as the parsed path does."""
    import json

    from vllm_xmix.results import ReadResults, StreamDelta

    P, G = 4, 10
    reads = [("a", "p", 3), ("a", "p", 7), ("b", "q", 5)]
    src = {r: np.arange(P + G - 1, dtype=np.float32) * (1 + i) + 0.125 for i, r in enumerate(reads)}
    src[("a", "p", 7)][P + 2] = np.nan

    acc, d = ReadResults(P), StreamDelta()
    got: dict = {r: {} for r in reads}
    fast = [0]

    def stream(upto=None):
        text = d.take_text(acc, upto)
        fast[0] += text is not None
        out = json.loads(text) if text is not None else json.loads(json.dumps(d.take(acc, upto)))
        for app, by_name in out.items():
            for name, v in by_name.items():
                for layer, e in ([(None, v)] if "pos0" in v else v.items()):
                    key = next(r for r in reads if r[:2] == (app, name) and (layer is None or str(r[2]) == layer))
                    for k, x in enumerate(e["values"]):
                        got[key].setdefault(e["pos0"] + k, x)

    def step(p, n=1, redo=None):
        """The values of positions p .. p+n-1 of each read; ``redo``: a position computed again
        to another value (already sent: the first one stays)."""
        chunks = []
        for r in reads:
            v = src[r][p:p + n].copy()
            if redo is not None:
                v[redo - p] = 9.0
            chunks.append((*r, "probe", p, n, 1, v.tobytes()))
        acc.add(chunks)

    step(0, P)
    stream()
    step(P)
    stream()  # one step: three values
    step(P + 1)
    step(P + 2)
    stream()  # two steps merged
    step(P + 3)
    step(P + 4)
    stream(acc.n_chunks - len(reads))  # a lagging stream: the output of step P+3 only
    stream()
    step(P + 4, 2, redo=P + 4)  # P+4 again (sent: stays) with P+5
    stream()
    for p in range(P + 6, P + G - 1):
        step(p)
        stream()
    for r in reads:
        assert [got[r][i] for i in range(P + G - 1)] == [None if not np.isfinite(v) else float(v) for v in src[r]], r
    assert fast[0] >= 6  # (most chunks took the path without a parse)
    final = acc.assemble(G)
    np.testing.assert_array_equal(final["a"]["p"][3], src[("a", "p", 3)])
    np.testing.assert_array_equal(final["b"]["q"], src[("b", "q", 5)])
