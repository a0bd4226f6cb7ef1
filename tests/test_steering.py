"""Steering at blocks.{L}.hook_resid_post on real vLLM (CPU, fp32) against the HF oracle,
in enforce_eager and in vLLM's default compiled mode (Inductor on CPU)."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, app_deltas

N = 10


def sp(apps=None, n=N, **kw):
    from vllm_xmix import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, mi_apps=apps, **kw)


def gen(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_unsteered_equals_hf(steer_llm, hf):
    got = gen(steer_llm, PROMPTS, sp())
    assert got == [hf.greedy(p, N) for p in PROMPTS]


@pytest.mark.parametrize("apps", [
    [{"name": "happy"}],
    [{"name": "happy", "scale": -6.0}],
    [{"name": "sad", "scale": 3.0, "layers": [0, 3]}],
    [{"name": "happy", "scale": 2.5}, {"name": "sad"}],
], ids=["happy-default", "happy-neg", "sad-layer-subset", "both"])
def test_steered_equals_hf_hooked(steer_llm, hf, apps):
    got = gen(steer_llm, PROMPTS, sp(apps))
    want = [hf.greedy(p, N, app_deltas(apps)) for p in PROMPTS]
    plain = [hf.greedy(p, N) for p in PROMPTS]
    assert got == want
    assert got != plain, "steering must change the output of this tiny model"


def test_a_write_only_request_runs_vllms_per_output_code(steer_llm, hf):
    """A request whose apps only write keeps vLLM's ``RequestState`` class (the front end's
    per-output code of the plugin is for requests whose apps may return values), gets HF's
    steered tokens and has no ``mi_results``; its app versions are still tracked (an app
    replaced on a running server must not reuse its entries while it runs)."""
    from vllm.v1.engine.output_processor import RequestState

    from vllm_xmix._vllm_compat.output_processor import live_versions

    engine, apps = steer_llm.llm_engine, [{"name": "happy"}]
    engine.add_request("write-only", {"prompt_token_ids": PROMPTS[0]}, sp(apps))
    (st,) = engine.output_processor.request_states.values()
    assert type(st) is RequestState, type(st)
    assert live_versions(engine.output_processor) == [["happy", 0]]
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (o,) = outs
    assert list(o.outputs[0].token_ids) == hf.greedy(PROMPTS[0], N, app_deltas(apps))
    assert o.mi_results is None


def test_mixed_batch_equals_solo(steer_llm):
    """8 requests with different apps/scales, some off, different lengths and finishing at
    different steps (rows move in the batch), in one generate: each equals its solo run."""
    cfgs = [None, [{"name": "happy"}], [{"name": "happy", "scale": -3.0}], None,
            [{"name": "sad", "scale": 1.5}], [{"name": "happy", "scale": 0.0}],
            [{"name": "happy", "scale": 5.0}, {"name": "sad", "scale": -1.0}], [{"name": "sad", "layers": [2]}]]
    prompts = [PROMPTS[i % len(PROMPTS)] + [i + 30] * (i % 3) for i in range(8)]
    lens = [N + (i % 4) * 3 for i in range(8)]
    params = [sp(c, n) for c, n in zip(cfgs, lens)]
    batched = gen(steer_llm, prompts, params)
    solo = [gen(steer_llm, [p], q)[0] for p, q in zip(prompts, params)]
    assert batched == solo
    # scale 0 is "off": identical to the unsteered request on the same prompt
    assert solo[5] == gen(steer_llm, [prompts[5]], sp(None, lens[5]))[0]


def test_on_then_off_same_prompt(steer_llm, hf):
    """Same prompt steered then unsteered, no restart: no stale graph, buffer or prefix-cache KV
    leaks into the unsteered run (steered prefill KV is salted away from unsteered requests)."""
    p = PROMPTS[2]
    on = gen(steer_llm, [p], sp([{"name": "sad", "scale": 4.0}]))[0]
    off = gen(steer_llm, [p], sp())[0]
    assert off == hf.greedy(p, N)
    assert on == hf.greedy(p, N, app_deltas([{"name": "sad", "scale": 4.0}]))
    assert on != off
    # and the reverse order
    off2 = gen(steer_llm, [PROMPTS[3]], sp())[0]
    on2 = gen(steer_llm, [PROMPTS[3]], sp([{"name": "happy"}]))[0]
    assert on2 == hf.greedy(PROMPTS[3], N, app_deltas([{"name": "happy"}]))
    assert off2 == hf.greedy(PROMPTS[3], N)


def test_plain_vllm_sampling_params_extra_args(steer_llm, hf):
    """The spec travels in extra_args: a plain vllm.SamplingParams works the same."""
    import vllm

    params = vllm.SamplingParams(temperature=0, max_tokens=N, ignore_eos=True,
                                 extra_args={"xmix": {"apps": [{"name": "happy", "scale": 3.0}]}})
    got = gen(steer_llm, PROMPTS[:2], params)
    assert got == [hf.greedy(p, N, app_deltas([{"name": "happy", "scale": 3.0}])) for p in PROMPTS[:2]]


def test_text_prompt_and_seeded_sampling(steer_llm):
    """Text prompts through the local tokenizer; seeded sampling in a batch equals solo."""
    p_on = sp([{"name": "happy"}], 8, seed=7)
    p_on.temperature = 0.8
    p_off = sp(None, 8, seed=7)
    p_off.temperature = 0.8
    outs = steer_llm.generate(["The cat likes", "The cat likes"], [p_on, p_off], use_tqdm=False)
    solo_on = steer_llm.generate(["The cat likes"], p_on, use_tqdm=False)[0]
    assert list(outs[0].outputs[0].token_ids) == list(solo_on.outputs[0].token_ids)
    assert outs[0].outputs[0].text != outs[1].outputs[0].text


def test_app_free_steps_launch_nothing(steer_llm, hf, monkeypatch):
    """Graph variants: a step where no request has an app on runs the app-free variant (the hook
    ops return before launching a kernel; on CUDA the graphs captured that way replay), a step
    with any app on runs the hooks. Compiled, the unconditional adds are torch ops inside the
    graph (fused by Inductor) and launch no kernel of ours at all. Counted at the kernel entry
    point, results against HF."""
    import vllm_xmix.ops as ops

    st = steer_llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner \
        .compilation_config.static_forward_context["vllm_xmix"]
    launches = []
    real = ops.steer_add
    monkeypatch.setattr(ops, "steer_add", lambda *a, **k: (launches.append(1), real(*a, **k))[1])
    before = dict(st.variant_steps)
    off = gen(steer_llm, PROMPTS[:2], sp())
    assert not launches, "an app-free step launched hook kernels"
    ran = lambda: sum(v for m, v in st.variant_steps.items() if m)  # noqa: E731  (steps with some op on)
    assert st.variant_steps[0] > before.get(0, 0) and ran() == sum(v for m, v in before.items() if m)
    mixed = gen(steer_llm, PROMPTS[:2], [sp(), sp([{"name": "happy"}])])
    if steer_llm.mode == "eager":
        assert ran() > sum(v for m, v in before.items() if m)
    if steer_llm.mode == "eager":
        assert launches, "a step with an app on ran no hook kernel"
    else:  # compiled: unconditional adds are torch ops fused by Inductor, no kernel of ours
        assert not launches, "compiled: the steering adds were not fused into the graph"
    assert off == [hf.greedy(p, N) for p in PROMPTS[:2]]
    assert mixed == [hf.greedy(PROMPTS[0], N), hf.greedy(PROMPTS[1], N, app_deltas([{"name": "happy"}]))]
