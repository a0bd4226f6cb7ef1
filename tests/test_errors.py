"""Bad input: a clear ValueError naming the field, per request; the engine keeps serving."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from conftest import D_MODEL, PROMPTS, close_llm, make_llm, unit_rms

from vllm_xmix import MIApp, XmixSpecError, deploy


def _gen(llm, params, prompts=PROMPTS[:2]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def eager_llm(tiny_llama):
    from conftest import deployment

    llm = make_llm(tiny_llama, "eager", additional_config=deployment())
    yield llm
    close_llm(llm)


@pytest.mark.parametrize("mi_apps, match", [
    ([{"name": "happy", "scale": "high"}], r"mi_apps\[0\]\.scale: expected a number, got str"),
    ([{"name": "happy", "scale": True}], r"mi_apps\[0\]\.scale: expected a number, got bool"),
    ([{"name": "happy", "scale": math.nan}], r"mi_apps\[0\]\.scale: must be finite"),
    ([{"name": "happy", "scale": math.inf}], r"mi_apps\[0\]\.scale: must be finite"),
    ([{"name": "happy", "colour": 1}], r"mi_apps\[0\]\.colour: Extra inputs"),
    ([{"scale": 1.0}], r"mi_apps\[0\]\.name: Field required"),
    ([42], r"mi_apps\[0\]: expected an app name"),
    (["happy", "happy"], r"mi_apps\[1\]\.name: app 'happy' listed twice"),
    ("happy", r"mi_apps: expected a list of apps \(e\.g\. \[\"happy\"\]\), got the name 'happy'"),
    ('"happy"', r"mi_apps: expected a list of apps \(e\.g\. \[\"happy\"\]\), got the JSON string '\"happy\"'"),
    ("null", r"mi_apps: expected a list of apps \(e\.g\. \[\"<app name>\"\]\), got JSON null"),
    ([{"name": "happy", "layers": []}], r"mi_apps\[0\]\.layers: empty list"),
    ([{"name": "happy", "layers": ["1"]}], r"mi_apps\[0\]\.layers: layer indices must be integers, got str"),
    ([{"name": "happy", "layers": [True]}], r"mi_apps\[0\]\.layers: layer indices must be integers, got bool"),
])
def test_bad_request_rejected_at_sampling_params(mi_apps, match):
    from vllm_xmix import SamplingParams

    with pytest.raises(ValueError, match=match):
        SamplingParams(mi_apps=mi_apps, max_tokens=4)


@pytest.mark.parametrize("extra, match", [
    ({"apps": [{"name": "nope"}]}, r"extra_args\.xmix\[0\]\.name: unknown app 'nope'; deployed apps: \['happy', 'sad'\]"),
    ({"apps": [{"name": "happy", "layers": [3]}]}, r"extra_args\.xmix\[0\]\.layers: layer 3 is not a deployed layer of app 'happy'"),
    ({"apps": [{"name": "sad", "layers": [7]}]}, r"extra_args\.xmix\[0\]\.layers: layer 7 is not a deployed layer"),
    ({"apps": [{"name": "happy", "scale": "x"}]}, r"extra_args\.xmix\[0\]\.scale: expected a number"),
    ({"apps": [{"name": "happy", "scale": float("nan")}]}, r"must be finite"),
    # finite but overflowing the dtype: inf/NaN in reused KV-cache blocks would reach other requests
    ({"apps": [{"name": "happy", "scale": 1e38}]},
     r"extra_args\.xmix\[0\]\.scale: app 'happy' op 0 would write values up to .* overflow to inf/NaN"),
    ('{"apps": [{"name": "nope"}]}', r"unknown app 'nope'"),  # the JSON-string form vllm_xargs carries
    ({"apps": "happy"}, r"extra_args\.xmix: expected a list of apps, got str"),
    ("not json", r"extra_args\.xmix: expected a list of apps"),
    ('[{"name": "happy"', r"extra_args\.xmix: not valid JSON"),
])
def test_bad_request_rejected_when_added_engine_keeps_serving(eager_llm, hf, extra, match):
    import vllm

    bad = vllm.SamplingParams(temperature=0, max_tokens=4, extra_args={"xmix": extra})
    good = vllm.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(ValueError, match=match):
        _gen(eager_llm, [good, bad])  # the bad one is in a batch with a good one
    # the engine still serves, and nothing of the rejected request leaked into the next batch
    assert _gen(eager_llm, good) == [hf.greedy(p, 6) for p in PROMPTS[:2]]


@pytest.mark.parametrize("extra, field", [
    ({"mi_apps": ["happy"]}, "extra_args.mi_apps"),  # the vllm_xmix.SamplingParams argument's name
    ({"XMIX": {"apps": [{"name": "happy"}]}}, "extra_args.XMIX"),
    ({"xmix_apps": ["happy"]}, "extra_args.xmix_apps"),
    ({"Mi_App": ["happy"]}, "extra_args.Mi_App"),
    ({"mi-apps": ["happy"], "other": 1}, "extra_args.mi-apps"),
    # near misses holding a selection (a typo nothing reads: the request would run unsteered)
    ({"xmx": ["happy"]}, "extra_args.xmx"),
    ({"xmix ": ["happy"]}, 'extra_args["xmix "]'),
    ({"x_mix": {"apps": [{"name": "happy"}]}}, "extra_args.x_mix"),
    ({"apps": [{"name": "happy", "scale": 2.0}]}, "extra_args.apps"),
    ({"MiApps": '["happy"]'}, "extra_args.MiApps"),
])
def test_misspelled_selection_key_is_refused_not_ignored(eager_llm, hf, extra, field):
    """A selection under a key nothing reads would run the request without its apps: refused,
    naming the key, and the engine keeps serving (keys of other users of extra_args pass)."""
    import vllm

    bad = vllm.SamplingParams(temperature=0, max_tokens=4, extra_args=extra)
    good = vllm.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(ValueError, match=re.escape(field) + r": unknown key, which nothing reads"):
        _gen(eager_llm, [good, bad])
    assert _gen(eager_llm, good) == [hf.greedy(p, 6) for p in PROMPTS[:2]]
    # (extra_args is other extensions' too: a key that only resembles one passes without a
    # selection in it, e.g. "mix", "maps")
    other = vllm.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                extra_args={"other": 1, "mix": 0.5, "maps": {"a": [1]}, "xmx": 3})
    assert _gen(eager_llm, other) == [hf.greedy(p, 6) for p in PROMPTS[:2]]


def test_request_accepts_numpy_numbers_and_sequences():
    from vllm_xmix import SamplingParams

    p = SamplingParams(mi_apps=[{"name": "happy", "scale": np.float32(2.0), "layers": range(1, 3)}])
    assert p.extra_args["xmix"] == {"apps": [{"name": "happy", "scale": 2.0, "layers": [1, 2]}]}
    p = SamplingParams(mi_apps=[{"name": "happy", "layers": (np.int64(2),)}])
    assert p.extra_args["xmix"]["apps"][0]["layers"] == [2]


def test_mi_apps_assigned_after_construction_is_what_runs(eager_llm, hf):
    """``mi_apps`` assigned after ``SamplingParams`` is built replaces the selection it made: None
    runs the request unsteered (the HF oracle's tokens), another app runs that app (an unknown
    name refused, naming it), never the selection of construction time."""
    import vllm

    from vllm_xmix import SamplingParams

    def sp(**kw):
        return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **kw)

    plain = [hf.greedy(p, 6) for p in PROMPTS[:2]]
    steered = _gen(eager_llm, sp(mi_apps=["happy"]))
    assert steered != plain
    cleared = sp(mi_apps=["happy"], extra_args={"other": 1})
    cleared.mi_apps = None
    assert cleared.extra_args == {"other": 1}
    assert _gen(eager_llm, cleared) == plain
    later = sp()
    later.mi_apps = ["happy"]
    assert _gen(eager_llm, later) == steered
    renamed = sp(mi_apps=["sad"])
    renamed.mi_apps = ["happy"]
    assert _gen(eager_llm, renamed) == steered
    renamed.mi_apps = ["nope"]
    with pytest.raises(ValueError, match=r"mi_apps\[0\]\.name: unknown app 'nope'"):
        _gen(eager_llm, renamed)
    with pytest.raises(ValueError, match=r"mi_apps\[0\]\.scale: expected a number, got str"):
        renamed.mi_apps = [{"name": "happy", "scale": "x"}]
    # a selection given in extra_args is not mi_apps' to replace
    given = vllm.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                extra_args={"xmix": {"apps": [{"name": "happy"}]}})
    both = sp(extra_args=dict(given.extra_args))
    with pytest.raises(ValueError, match="the selection is given twice"):
        both.mi_apps = ["sad"]
    assert _gen(eager_llm, both) == steered
    # the list edited in place (not assigned) is caught when vLLM copies the params, saying how to change it
    edited = sp(mi_apps=["happy"])
    edited.mi_apps.append("sad")
    with pytest.raises(ValueError, match="edited in place after construction, assign it a new list"):
        _gen(eager_llm, edited)


def test_miapp_object_must_match_deployed_content(eager_llm):
    """Passing an MIApp selects by name, but a different vector under the same name is an error."""
    from conftest import HAPPY_LAYERS, HAPPY_SCALE, V_HAPPY

    from vllm_xmix import SamplingParams

    same = MIApp("happy")
    same.write("add", vector=V_HAPPY, scale=HAPPY_SCALE).layers(HAPPY_LAYERS).submodule("hook_resid_post")
    other = MIApp("happy")
    other.write("add", vector=V_HAPPY * 2, scale=HAPPY_SCALE).layers(HAPPY_LAYERS)
    by_name = _gen(eager_llm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, mi_apps=["happy"]))
    assert _gen(eager_llm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, mi_apps=[same])) == by_name
    with pytest.raises(ValueError, match=r"mi_apps\[0\]: app 'happy' differs from the deployed app of that name"):
        _gen(eager_llm, SamplingParams(temperature=0, max_tokens=5, mi_apps=[other]))


def test_request_for_engine_without_apps(tiny_llama):
    from vllm_xmix import SamplingParams

    llm = make_llm(tiny_llama, "eager")
    try:
        with pytest.raises(ValueError, match=r"mi_apps: app\(s\) \['happy'\] requested but no apps are deployed"):
            _gen(llm, SamplingParams(max_tokens=3, mi_apps=["happy"]))
        assert len(_gen(llm, SamplingParams(max_tokens=3, ignore_eos=True))[0]) == 3
    finally:
        close_llm(llm)


def _app(**kw):
    a = MIApp("x")
    op = a.write("add", vector=kw.pop("vector", unit_rms(0)), scale=kw.pop("scale", 1.0))
    if "layers" in kw:
        op.layers(kw.pop("layers"))
    if "hook" in kw:
        op.submodule(kw.pop("hook"))
    return a


@pytest.mark.parametrize("make, match", [
    (lambda: deploy(_app(vector=np.ones(D_MODEL - 1, np.float32))), r"ops\.0\.vector: length 63 != d_model 64"),
    (lambda: deploy(_app(layers=[1, 4])), r"ops\.0\.layers: layer index 4 out of range \[0, 4\)"),
    (lambda: deploy(_app(vector=np.full(D_MODEL, np.nan, np.float32))), r"vector: entry 0 is nan: of the non-finite values only -inf is allowed"),
    (lambda: {"xmix": {"apps": [{"name": "x", "ops": [{"vector": [1.0] * D_MODEL, "hook": "hook_resid_sideways"}]}]}},
     r"unknown hook 'hook_resid_sideways'"),
    (lambda: {"xmix": {"apps": [{"name": "x", "ops": [{"vector": {"path": "/nonexistent.safetensors"}}]}]}},
     r"vector\.path: file not found"),
    (lambda: {"xmix": {"apps": [{"name": "x", "ops": [{"kind": "ablate", "vector": [0.0] * D_MODEL}]}]}},
     r"ops\.0\.vector: zero vector has no direction to ablate"),
    (lambda: {"xmix": {"apps": []}}, r"additional_config\.xmix: no apps deployed and no entries reserved"),
    (lambda: {"xmix": {"apps": [], "reserve": {"versions": 1}}}, r"no apps deployed and no entries reserved"),
])
def test_bad_deployment_rejected_at_engine_start(tiny_llama, make, match):
    """A bad deployment fails LLM() with a ValueError naming the field (before any worker starts)."""
    with pytest.raises(ValueError, match=match):
        make_llm(tiny_llama, "eager", additional_config=make())


@pytest.mark.parametrize("key", ["xmx", "mi_apps", "XMIX", "x-mix"])
def test_deployment_under_a_misspelled_key_is_refused(tiny_llama, key):
    """A deployment under a key nothing reads would start an engine without its apps (requests
    naming them then fail as unknown apps, far from the typo): refused at engine start, naming
    the key. Other extensions' keys pass, a bare "apps" among them."""
    with pytest.raises(ValueError, match=re.escape(f"additional_config.{key}: unknown key, which nothing reads")):
        make_llm(tiny_llama, "eager", additional_config={key: deploy(_app())["xmix"]})
    from types import SimpleNamespace as NS

    from vllm_xmix.validation import validate_engine_config

    validate_engine_config(NS(additional_config={"apps": ["other-plugin"], "mix": {"a": 1}}))  # no error


def test_unsupported_architecture_is_an_error(tmp_path):
    """Apps on an architecture without an adapter: an error at engine start, never a no-op."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_embd=64, n_layer=2, n_head=2, n_positions=256)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"architecture \['GPT2LMHeadModel'\] is not supported"):
        make_llm(str(tmp_path), "eager", additional_config=deploy(_app()), skip_tokenizer_init=True)


def test_vllm_plugins_excluding_xmix_is_an_error(tiny_llama, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    with pytest.raises(ValueError, match="VLLM_PLUGINS is set and does not name 'xmix'"):
        make_llm(tiny_llama, "eager", additional_config=deploy(_app()))


def test_builder_errors():
    with pytest.raises(XmixSpecError, match=r"c.cond: give a predicate"):
        MIApp("c").write("add", vector=unit_rms(0)).cond()
    with pytest.raises(XmixSpecError, match=r"cond.tokenz: Extra inputs are not permitted"):
        a = MIApp("c")
        a.write("add", vector=unit_rms(0)).cond(tokenz=[1, 2])
        a.to_spec()
    with pytest.raises(XmixSpecError, match=r"unknown read kind 'probe'; known: capture, linear_probe"):
        MIApp("r").read("probe", weight=unit_rms(0))
    with pytest.raises(XmixSpecError, match=r"unknown write kind 'rotate'; known: add, ablate, clamp, router_bias"):
        a = MIApp("a")
        a.write("rotate", vector=unit_rms(0))
        a.to_spec()
    with pytest.raises(XmixSpecError, match=r"value: only a 'clamp' write takes a value \(this write is 'ablate'\)"):
        a = MIApp("a")
        a.write("ablate", vector=unit_rms(0), value=1.0)
        a.to_spec()
    with pytest.raises(XmixSpecError, match=r"kind: only 'router_bias' writes at 'mlp.hook_router_logits' \(got 'add'\)"):
        deploy(_app(hook="mlp.hook_router_logits"))
    with pytest.raises(XmixSpecError, match=r"submodule: unknown hook 'blocks.\{L\}.attn.hook_pattern'; known TransformerLens hook names"):
        deploy(_app(hook="blocks.{L}.attn.hook_pattern"))
    with pytest.raises(XmixSpecError, match=r"submodule: 'blocks.2.hook_resid_post' names layer 2; give layers with \.layers"):
        MIApp("b").write("add", vector=unit_rms(0)).submodule("blocks.2.hook_resid_post")
    with pytest.raises(XmixSpecError, match=r"value: a 'clamp' write needs the target projection value"):
        MIApp("c").write("clamp", vector=unit_rms(0)).to_spec()
    with pytest.raises(XmixSpecError, match=r"expected a 1-D vector"):
        MIApp("m").write("add", vector=np.ones((2, D_MODEL)))
    with pytest.raises(XmixSpecError, match=r"name: 'bad name!' must match"):
        deploy(_named("bad name!"))
    with pytest.raises(XmixSpecError, match=r"duplicate app names \['x'\]"):
        deploy(_app(), _app())
    with pytest.raises(XmixSpecError, match=r"ops\.0\.scale: expected a number, got str '4\.0'"):
        deploy(_app(scale="4.0"))
    with pytest.raises(XmixSpecError, match=r"ops\.0\.layers: layer indices must be integers, got str"):
        deploy(_app(layers=["1"]))
    with pytest.raises(XmixSpecError, match=r"write\.vector: not a vector of real numbers"):
        MIApp("s").write("add", vector=["a"] * D_MODEL)
    with pytest.raises(XmixSpecError, match=r"ops\.0\.vector: expected a number, got str 'a'"):
        deploy({"name": "x", "ops": [{"vector": ["a"] * D_MODEL}]})


def _named(name):
    a = MIApp(name)
    a.write("add", vector=unit_rms(0))
    return a


def test_inductor_freezing_is_refused(tiny_llama):
    """Freezing would inline the runtime's buffers (zeros when compiled) as constants: the fused
    steering adds would silently do nothing."""
    with pytest.raises(ValueError, match=r"freezing=True would inline the runtime's buffers"):
        make_llm(tiny_llama, "compiled", additional_config=deploy(_app()),
                 compilation_config={"inductor_compile_config": {"freezing": True}})


def test_microbatching_is_refused(tiny_llama):
    """vLLM's UBatchWrapper keeps CUDA graphs keyed by token count only, so it would replay the
    app-free graph variant in every step: refused when the engine is configured (``--ubatch-size``
    > 1; dual-batch overlap is the same condition, ``use_ubatching``, but the CPU build turns it
    off before the check)."""
    with pytest.raises(ValueError, match=r"microbatching \(dual-batch overlap, --ubatch-size > 1\) is not supported"):
        make_llm(tiny_llama, "eager", additional_config=deploy(_app()), ubatch_size=2,
                 all2all_backend="deepep_low_latency")


def test_bad_graph_variant_setting_is_refused_at_engine_start(tiny_llama, monkeypatch):
    """A bad VLLM_XMIX_GRAPH_VARIANTS is a clear configuration error, before any process starts."""
    monkeypatch.setenv("VLLM_XMIX_GRAPH_VARIANTS", "per-app")
    with pytest.raises(ValueError, match=r"VLLM_XMIX_GRAPH_VARIANTS='per-app': expected 'apps' \(the default\)"):
        make_llm(tiny_llama, "eager", additional_config=deploy(_app()))
    monkeypatch.delenv("VLLM_XMIX_GRAPH_VARIANTS")
    monkeypatch.setenv("VLLM_XMIX_PIECEWISE_VARIANTS", "full")
    with pytest.raises(ValueError, match=r"VLLM_XMIX_PIECEWISE_VARIANTS='full': expected 'apps' \(the default\) or 'onoff'"):
        make_llm(tiny_llama, "eager", additional_config=deploy(_app()))
    monkeypatch.delenv("VLLM_XMIX_PIECEWISE_VARIANTS")
    monkeypatch.setenv("VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE", "64 tokens")
    with pytest.raises(ValueError, match=r"VLLM_XMIX_APP_MAX_CUDAGRAPH_CAPTURE_SIZE='64 tokens': expected an integer >= 1"):
        make_llm(tiny_llama, "eager", additional_config=deploy(_app()))


def test_overflowing_deployed_scale_is_refused(tiny_llama):
    """A deployed scale whose writes overflow the model's dtype (inf/NaN in reused KV-cache
    blocks would reach other requests) is refused when the engine is configured."""
    with pytest.raises(ValueError, match=r"apps\.0\(x\)\.ops\.0\.scale: app 'x' op 0 would write values up to .* dtype "
                                         r"torch\.float32, writes up to .* stay finite"):
        make_llm(tiny_llama, "eager", additional_config=deploy(_app(scale=1e38)))



def test_adds_that_overflow_together_are_refused(tiny_llama):
    """Adds accumulate in the residual stream over layers and apps: writes each within the limit
    (d_model 64 in float32: 1.44e17) that together exceed it are refused, one app's over its
    layers when the engine is configured, several apps' per request; within it they run, and the
    engine keeps serving plain requests unchanged."""
    from vllm_xmix import SamplingParams

    ones = np.ones(D_MODEL, dtype=np.float32)
    big = MIApp("big")
    big.write("add", vector=ones, scale=5e16).layers([0, 1, 2])
    with pytest.raises(ValueError, match=r"apps\.0\(big\): the adds of the selected apps write up to 1\.5e\+17 into "
                                         r"the residual stream together \(3 writes over their layers and apps"):
        make_llm(tiny_llama, "eager", additional_config=deploy(big))
    h1, h2 = MIApp("h1"), MIApp("h2")
    h1.write("add", vector=ones, scale=1e17).layers([1])
    h2.write("add", vector=ones, scale=1e17).layers([2])
    llm = make_llm(tiny_llama, "eager", additional_config=deploy(h1, h2))
    try:
        sp = lambda apps: SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, mi_apps=apps)
        plain = _gen(llm, sp(None))
        with pytest.raises(ValueError, match=r"mi_apps: the adds of the selected apps write up to 2e\+17 into the "
                                             r"residual stream together \(2 writes"):
            _gen(llm, sp(["h1", "h2"]))
        alone = _gen(llm, sp(["h1"]))
        assert alone != plain  # each alone runs (and writes)
        both = _gen(llm, sp([{"name": "h1", "scale": 5e16}, {"name": "h2", "scale": 5e16}]))
        assert both != plain
        assert _gen(llm, sp(None)) == plain
    finally:
        close_llm(llm)


def test_write_magnitude_bound_follows_the_dtype():
    """float16 holds writes up to 65504/256: a directional ablation (scale 1) or a reflection
    (scale 3) fits, a large add or clamp target does not; float32 takes the large add."""
    from types import SimpleNamespace as NS

    import torch

    from vllm_xmix.validation import check_write_magnitude

    a, b = MIApp("abl"), MIApp("add")
    a.write("ablate", vector=unit_rms(1)).layers([1])
    b.write("add", vector=unit_rms(2), scale=1.0).layers([1])
    c = MIApp("clamp")
    c.write("clamp", vector=unit_rms(3), value=1e4).layers([1])
    dep = deploy(a, b, c)
    half, full = (NS(additional_config=dep, model_config=NS(dtype=d)) for d in (torch.float16, torch.float32))
    check_write_magnitude(half, "abl", None, "f")
    check_write_magnitude(half, "abl", 3.0, "f")
    check_write_magnitude(half, "add", 20.0, "f")
    with pytest.raises(XmixSpecError, match=r"f: app 'add' op 0 would write values up to .*torch\.float16, writes up to 256 "):
        check_write_magnitude(half, "add", 1e5, "f")
    with pytest.raises(XmixSpecError, match=r"f: app 'clamp' op 0 would write values up to 1e\+04 \(scale 1, value 10000\)"):
        check_write_magnitude(half, "clamp", None, "f")
    # the deployment's own check names the op's field: its scale, or a clamp's value
    with pytest.raises(XmixSpecError, match=r"^apps\.2\(clamp\)\.ops\.0\.value: app 'clamp' op 0 would write"):
        check_write_magnitude(half, "clamp", None, "apps.2(clamp)", per_op=True)
    check_write_magnitude(full, "add", 1e5, "f")
    # the residual stream's next RMSNorm sums squares in float32 over d_model: with d_model 4096
    # writes stay below sqrt(3.4e38 / 4096) / 16 ~ 1.8e16 even where bf16 / float32 hold far more
    wide = NS(additional_config=dep, model_config=NS(dtype=torch.bfloat16, hf_config=NS(hidden_size=4096)))
    check_write_magnitude(wide, "add", 1e15 / float(np.abs(unit_rms(2)).max()), "f")
    with pytest.raises(XmixSpecError, match=r"f: app 'add' op 0 .*writes up to 1\.8e\+16 stay finite here \(the "
                                            r"next RMSNorm's float32 sum of squares included\)"):
        check_write_magnitude(wide, "add", 1e30, "f")


def test_a_selection_check_reads_the_model_config_once_per_engine():
    """A request's selection is checked against the model's layer count, read from the Hugging
    Face config once per engine config and not per request (a transformers config answers each
    attribute read through Python-level overrides); the count still bounds the request."""
    from types import SimpleNamespace as NS

    import torch

    from vllm_xmix.validation import validate_selection

    reads = []

    class Config:
        def __getattribute__(self, name):
            if name == "num_hidden_layers":
                reads.append(name)
                return 4
            return object.__getattribute__(self, name)

    a = MIApp("add")
    a.write("add", vector=unit_rms(2), scale=1.0).layers("all")
    vc = NS(additional_config=deploy(a), model_config=NS(dtype=torch.float32, hf_config=Config()))
    wire, _ = validate_selection(vc, [{"name": "add", "layers": [3]}])
    assert [x["name"] for x in wire["apps"]] == ["add"] and len(reads) == 1
    for _ in range(3):
        validate_selection(vc, [{"name": "add"}])
    assert len(reads) == 1
    with pytest.raises(XmixSpecError, match=r"mi_apps\[0\]\.layers: layer 4 .* \(deployed: \[0, 1, 2, 3\]\)"):
        validate_selection(vc, [{"name": "add", "layers": [4]}])


def test_a_checked_selection_is_remembered_per_deployment_state(monkeypatch):
    """A selection that passed is checked once per deployment state: the next request with it gets
    its own copy of the same canonical selection and salt (a prompt read still gets a salt of its
    own), an app change on a running server (a new state) checks it again, and a refused
    selection is refused every time."""
    from types import SimpleNamespace as NS

    import torch

    from vllm_xmix.spec import CONFIG_KEY, parse_deployment
    from vllm_xmix.validation import requests as vreq

    a = MIApp("add")
    a.write("add", vector=unit_rms(2), scale=1.0).layers("all")
    p = MIApp("probe")
    p.read("linear_probe", weight=unit_rms(2)).layers([1])
    vc = NS(additional_config=deploy(a, p), model_config=NS(dtype=torch.float32, hf_config=NS(num_hidden_layers=4)))
    parsed = []
    orig = vreq.parse_request_apps
    monkeypatch.setattr(vreq, "parse_request_apps", lambda raw, **kw: parsed.append(raw) or orig(raw, **kw))

    w1, s1 = vreq.validate_selection(vc, [{"name": "add", "scale": 0.5}])
    w2, s2 = vreq.validate_selection(vc, [{"name": "add", "scale": 0.5}])
    assert len(parsed) == 1 and w1 == w2 and s1 == s2 and s1.startswith("xmix:"), (w1, s1, s2)
    w1["apps"][0]["scale"] = 9.0  # (a request's own dicts: writing one changes no other's)
    assert vreq.validate_selection(vc, [{"name": "add", "scale": 0.5}])[0]["apps"][0]["scale"] == 0.5
    # the same selection named as the engine names it (errors only differ in the field's name)
    assert vreq.validate_selection(vc, [{"name": "add", "scale": 0.5}], field="extra_args.xmix")[1] == s1
    assert vreq.validate_selection(vc, [{"name": "add", "scale": 0.25}])[1] != s1 and len(parsed) == 2
    w4, _ = vreq.validate_selection(vc, [{"name": "add", "layers": [1, 2]}])
    w4["apps"][0]["layers"].append(3)  # (its lists too)
    assert vreq.validate_selection(vc, [{"name": "add", "layers": [1, 2]}])[0]["apps"][0]["layers"] == [1, 2]
    assert len(parsed) == 3

    r1 = vreq.validate_selection(vc, ["probe"])[1]
    r2 = vreq.validate_selection(vc, ["probe"])[1]
    assert vreq.READ_SALT in r1 and r1 != r2 and r1.split(vreq.READ_SALT)[0] == r2.split(vreq.READ_SALT)[0]

    for _ in range(2):  # refused each time, never remembered
        with pytest.raises(XmixSpecError, match="unknown app"):
            vreq.validate_selection(vc, [{"name": "nope"}])
    n = len(parsed)
    vreq.set_live_deployment(vc, parse_deployment(vc.additional_config[CONFIG_KEY]), {"add": 3})
    w3, _ = vreq.validate_selection(vc, [{"name": "add", "scale": 0.5}])
    assert len(parsed) == n + 1 and w3["apps"][0]["version"] == 3, w3


def test_error_param_names_the_field_a_message_starts_with():
    """The OpenAI error body's ``param``: the field path an error message starts with, in the
    request spelling (list indices in brackets) and in pydantic's spelling of an app body
    (``body.ops.0.vector``); None for a message that does not start with a field."""
    from vllm_xmix.validation.http import error_param

    assert error_param("mi_apps[0].name: unknown app 'x'") == "mi_apps[0].name"
    assert error_param('vllm_xargs["xmix "]: unknown key') == 'vllm_xargs["xmix "]'
    assert error_param("body.ops.0.vector: length 64 != d_model 128") == "body.ops.0.vector"
    assert error_param("body.ops.10.vector.safetensors: not a safetensors file") == "body.ops.10.vector.safetensors"
    assert error_param("layer 99 is not a deployed layer") is None
