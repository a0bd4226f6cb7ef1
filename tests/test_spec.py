"""App specs as plain data: JSON round trip, content-hash identity, vector files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import D_MODEL, unit_rms

from vllm_xmix import MIApp, XmixSpecError, deploy
from vllm_xmix.spec import VectorFile, load_vector, parse_deployment, parse_request_apps


def _app(name="a", v=None, scale=1.0, layers=(1, 2)):
    a = MIApp(name)
    a.write("add", vector=unit_rms(0) if v is None else v, scale=scale).layers(list(layers)).submodule("resid_post")
    return a


def test_json_round_trip_and_hash():
    a = _app()
    spec = a.to_spec()
    back = MIApp.from_json(a.to_json())
    assert back == spec and back.content_hash() == spec.content_hash()
    assert spec.ops[0].hook == "hook_resid_post" and spec.ops[0].layers == [1, 2]
    np.testing.assert_array_equal(np.asarray(spec.ops[0].vector, np.float32), unit_rms(0))
    # same name, different vector / scale / layers -> different app
    assert _app(v=unit_rms(1)).content_hash() != spec.content_hash()
    assert _app(scale=2.0).content_hash() != spec.content_hash()
    assert _app(layers=(1,)).content_hash() != spec.content_hash()
    # deploy() output is JSON (it goes into additional_config and over HTTP)
    cfg = deploy(a)
    assert json.loads(json.dumps(cfg)) == cfg
    assert parse_deployment(cfg["xmix"]).apps[0] == spec
    assert parse_deployment(json.dumps(cfg["xmix"])).apps[0] == spec


def test_hash_is_the_same_for_a_vector_inline_or_in_a_file(tmp_path):
    """An app's identity is its values: the same vector inline, in a .npy, .safetensors or .pt
    file gives one content hash (a request naming the app by its builder is not refused as
    "differs from the deployed app"); other values, in a file or inline, give another; a file
    rewritten with new values gives a new hash (the digest is not kept past a change)."""
    from safetensors.numpy import save_file

    from vllm_xmix.spec import check_request_against_deployment

    v = unit_rms(3)
    np.save(tmp_path / "v.npy", v)
    save_file({"dir": v, "other": unit_rms(4)}, str(tmp_path / "v.safetensors"))
    torch.save({"dir": torch.from_numpy(v.copy())}, tmp_path / "v.pt")
    def keyed(path, key):
        a = MIApp("a")
        a.write("add", vector=str(path), key=key).layers([1, 2]).submodule("resid_post")
        return a

    hashes = {_app(v=f).content_hash() for f in (v, v.astype(np.float64).tolist(), str(tmp_path / "v.npy"))}
    hashes |= {keyed(tmp_path / "v.safetensors", "dir").content_hash(), keyed(tmp_path / "v.pt", "dir").content_hash(),
               parse_deployment({"apps": [{"name": "a", "ops": [{"primitive": "write", "kind": "add", "hook": "hook_resid_post",
                   "layers": [1, 2], "vector": {"path": str(tmp_path / "v.npy")}}]}]}).apps[0].content_hash()}
    assert len(hashes) == 1, hashes
    assert keyed(tmp_path / "v.safetensors", "other").content_hash() not in hashes
    assert _app(v=unit_rms(4)).content_hash() not in hashes
    deployed = parse_deployment(deploy(_app(v=str(tmp_path / "v.npy")))["xmix"])
    check_request_against_deployment(parse_request_apps([_app(v=v)]), deployed, 4)  # no "differs"
    with pytest.raises(XmixSpecError, match="differs from the deployed app"):
        check_request_against_deployment(parse_request_apps([_app(v=unit_rms(4))]), deployed, 4)
    import os
    import time

    before = _app(v=str(tmp_path / "v.npy")).content_hash()
    np.save(tmp_path / "v.npy", unit_rms(5))
    os.utime(tmp_path / "v.npy", ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert _app(v=str(tmp_path / "v.npy")).content_hash() not in (before, *hashes)


def test_layers_forms():
    assert MIApp("r").write("add", vector=unit_rms(0)).layers(range(3)).to_spec().ops[0].layers == [0, 1, 2]
    assert MIApp("i").write("add", vector=unit_rms(0)).layers(2).to_spec().ops[0].layers == [2]
    assert MIApp("s").write("add", vector=unit_rms(0)).layers("all").to_spec().ops[0].layers == "all"
    with pytest.raises(XmixSpecError, match="duplicate layer"):
        MIApp("d").write("add", vector=unit_rms(0)).layers([1, 1]).to_spec()
    with pytest.raises(XmixSpecError, match="negative layer"):
        MIApp("n").write("add", vector=unit_rms(0)).layers([-1]).to_spec()


def test_vector_files(tmp_path):
    from safetensors.numpy import save_file

    v = unit_rms(3)
    save_file({"dir": v, "other": v * 2}, str(tmp_path / "v.safetensors"))
    save_file({"only": v}, str(tmp_path / "one.safetensors"))
    torch.save(torch.from_numpy(v), tmp_path / "v.pt")
    torch.save({"dir": torch.from_numpy(v)}, tmp_path / "d.pt")
    np.save(tmp_path / "v.npy", v)
    np.save(tmp_path / "m.npy", np.ones((2, D_MODEL), np.float32))
    for ref in [VectorFile(path=str(tmp_path / "v.safetensors"), key="dir"), VectorFile(path=str(tmp_path / "one.safetensors")),
                VectorFile(path=str(tmp_path / "v.pt")), VectorFile(path=str(tmp_path / "d.pt"), key="dir"),
                VectorFile(path=str(tmp_path / "v.npy"))]:
        np.testing.assert_array_equal(load_vector(ref, "f"), v)
    with pytest.raises(XmixSpecError, match=r"f\.key: .* holds \['dir', 'other'\]; name one"):
        load_vector(VectorFile(path=str(tmp_path / "v.safetensors")), "f")
    with pytest.raises(XmixSpecError, match=r"f\.key: 'nope' not in"):
        load_vector(VectorFile(path=str(tmp_path / "v.safetensors"), key="nope"), "f")
    with pytest.raises(XmixSpecError, match=r"f: expected a 1-D vector \[d_model\], got shape \[2, 64\]"):
        load_vector(VectorFile(path=str(tmp_path / "m.npy")), "f")
    # a key where the file has no keys selects nothing: refused, not ignored
    with pytest.raises(XmixSpecError, match=r"f\.key: a \.npy file holds one array: key 'dir' selects nothing"):
        load_vector(VectorFile(path=str(tmp_path / "v.npy"), key="dir"), "f")
    with pytest.raises(XmixSpecError, match=r"f\.key: .*v\.pt holds a single Tensor, not a dict of tensors"):
        load_vector(VectorFile(path=str(tmp_path / "v.pt"), key="dir"), "f")
    # not real numbers: refused, not coerced (complex would lose its imaginary part)
    torch.save(torch.ones(D_MODEL, dtype=torch.complex64), tmp_path / "c.pt")
    np.save(tmp_path / "b.npy", np.ones(D_MODEL, bool))
    with pytest.raises(XmixSpecError, match=r"f: expected real numbers, got a torch\.complex64 tensor"):
        load_vector(VectorFile(path=str(tmp_path / "c.pt")), "f")
    with pytest.raises(XmixSpecError, match=r"f: expected real numbers, got dtype bool"):
        load_vector(VectorFile(path=str(tmp_path / "b.npy")), "f")
    # a builder vector given as a path stays a path in the spec (loaded by each worker)
    a = MIApp("p")
    a.write("add", vector=tmp_path / "v.safetensors", key="dir")
    assert a.to_spec().ops[0].vector == VectorFile(path=str(tmp_path / "v.safetensors"), key="dir")


def test_inline_vectors_are_real_numbers_and_take_no_key():
    """An in-memory vector with ``key=`` (which only selects a tensor in a file) is refused, and so
    are vectors that are not real numbers, in the builder and in a JSON deployment."""
    with pytest.raises(XmixSpecError, match=r"k\.write\.vector: key='dir' names a tensor in a file"):
        MIApp("k").write("add", vector=unit_rms(0), key="dir")
    with pytest.raises(XmixSpecError, match=r"w\.read\.weight: key='dir' names a tensor in a file"):
        MIApp("w").read("linear_probe", weight=unit_rms(0), key="dir")
    for bad, what in ((unit_rms(0).astype(np.complex64), "complex64"), (np.array(["1"] * D_MODEL), "<U1"),
                      (np.ones(D_MODEL, bool), "bool"), ([True] * D_MODEL, "bool")):
        with pytest.raises(XmixSpecError, match=rf"c\.write\.vector: not a vector of real numbers \(dtype {what}\)"):
            MIApp("c").write("add", vector=bad)
    with pytest.raises(XmixSpecError, match=r"c\.write\.vector: expected real numbers, got a torch\.bool tensor"):
        MIApp("c").write("add", vector=torch.ones(D_MODEL, dtype=torch.bool))
    assert MIApp("i").write("add", vector=[1] * D_MODEL).layers([0]).to_spec().ops[0].vector == [1.0] * D_MODEL
    j = MIApp("j")
    j.write("add", vector=unit_rms(0)).layers([0])
    raw = deploy(j)["xmix"]
    for entry, shown in ((True, "bool True"), ("1.5", "str '1.5'")):
        bad = json.loads(json.dumps(raw))
        bad["apps"][0]["ops"][0]["vector"][3] = entry
        with pytest.raises(XmixSpecError, match=rf"additional_config\.xmix\.apps\.0\.ops\.0\.vector: expected a number, got {shown}"):
            parse_deployment(bad)


def test_request_forms():
    assert [a.name for a in parse_request_apps(["x", {"name": "y", "scale": 2}])] == ["x", "y"]
    assert parse_request_apps({"apps": [{"name": "y", "scale": 2}]})[0].scale == 2.0
    assert parse_request_apps('[{"name": "y", "layers": [1]}]')[0].layers == [1]
    assert parse_request_apps([_app("z")])[0].name == "z"
    assert parse_request_apps([]) == []


def test_probe_weights_from_files_checked_against_the_model(tmp_path):
    """Probe / cosine weights load like steering vectors (safetensors, .pt, .npy) and are checked
    against the model's d_model (n_experts at the router logits) when the deployment is validated."""
    import numpy as np
    import torch
    from safetensors.numpy import save_file

    from vllm_xmix import MIApp, XmixSpecError
    from vllm_xmix.spec import parse_deployment, validate_deployment
    from vllm_xmix.spec import deploy as dep

    w = np.arange(64, dtype=np.float32) / 64
    save_file({"probe": w}, str(tmp_path / "w.safetensors"))
    torch.save({"probe": torch.from_numpy(w)}, tmp_path / "w.pt")
    np.save(tmp_path / "w.npy", w[:63])
    for path, key in ((tmp_path / "w.safetensors", "probe"), (tmp_path / "w.pt", "probe")):
        a = MIApp("p")
        a.read("linear_probe", weight=path, key=key).layers([1])
        a.read("cosine", weight=path, key=key, name="cos").layers([2])
        validate_deployment(parse_deployment(dep(a)["xmix"]), 4, 64)
    bad = MIApp("p")
    bad.read("linear_probe", weight=tmp_path / "w.npy").layers([1])
    with pytest.raises(XmixSpecError, match=r"ops\.0\.weight: length 63 != d_model 64"):
        validate_deployment(parse_deployment(dep(bad)["xmix"]), 4, 64)
    router = MIApp("r")
    router.read("linear_probe", weight=[1.0, 2.0, 3.0]).submodule("mlp.hook_router_logits")
    with pytest.raises(XmixSpecError, match=r"weight: length 3 != n_experts 4"):
        validate_deployment(parse_deployment(dep(router)["xmix"]), 4, 64, n_experts=4)


def test_a_read_weight_whose_dot_product_can_overflow_is_refused():
    """A probe / cosine weight of 1e37 entries passes every per-entry check (finite in float32),
    but its float32 dot product with an ordinary activation is inf, so its scores would be
    inf/NaN and its triggers never fire: refused by norm when the deployment is validated. The
    largest accepted norm keeps the dot product finite for any activation the next RMSNorm can
    still normalise."""
    from vllm_xmix.spec import parse_deployment, validate_deployment
    from vllm_xmix.spec.vectors import MAX_READ_WEIGHT_NORM

    x = np.full(64, 10.0, np.float32)  # an ordinary activation
    for kind in ("linear_probe", "cosine"):
        big = np.full(64, 1e37, np.float32)
        with np.errstate(over="ignore"):
            assert not np.isfinite(np.dot(big, x))  # what the read would compute
        a = MIApp("p")
        a.read(kind, weight=big, name="r").layers([1])
        with pytest.raises(XmixSpecError, match=r"ops\.0\.weight: norm 8e\+37 is too large: .* overflow float32"):
            validate_deployment(parse_deployment(deploy(a)["xmix"]), 4, 64)
    edge = np.full(64, MAX_READ_WEIGHT_NORM / 8 * 0.999, np.float32)  # norm just inside the bound
    ok = MIApp("p")
    ok.read("linear_probe", weight=edge).layers([1])
    validate_deployment(parse_deployment(deploy(ok)["xmix"]), 4, 64)
    worst = np.full(64, np.sqrt(np.finfo(np.float32).max) / 8 * 0.999, np.float32)  # stream norm at the bound
    assert np.isfinite(np.dot(edge, worst))


def test_builder_refuses_a_second_layers_submodule_or_cond_on_one_op():
    """A second call would silently replace the first (a user may mean both predicates)."""
    for chain, method in ((lambda op: op.layers([1]).layers([2]), "layers"),
                          (lambda op: op.submodule("hook_resid_post").submodule("hook_resid_pre"), "submodule"),
                          (lambda op: op.cond(tokens=[1]).cond(tokens_prev=[2]), "cond")):
        a = MIApp("x")
        with pytest.raises(XmixSpecError, match=rf"x\.{method}: already given for this op"):
            chain(a.write("add", vector=unit_rms(0)))
    a = MIApp("x")  # one of each, and a second op with its own, stay fine
    a.write("add", vector=unit_rms(0)).layers([1]).submodule("hook_resid_pre").cond(tokens=[1])
    a.write("add", vector=unit_rms(1)).layers([2]).submodule("hook_resid_post")
    assert [op.layers for op in a.to_spec().ops] == [[1], [2]]


def test_layers_as_arrays_and_tensors():
    for layers in (np.arange(1, 3), torch.tensor([1, 2]), [np.int64(1), np.int64(2)]):
        a = MIApp("x")
        a.write("add", vector=unit_rms(0)).layers(layers)
        assert a.to_spec().ops[0].layers == [1, 2]
    for one in (1, np.int64(1), np.int32(1)):  # one layer, a Python or a numpy integer
        a = MIApp("x")
        a.write("add", vector=unit_rms(0)).layers(one)
        assert a.to_spec().ops[0].layers == [1]
    for bad, msg in ((np.array([[1, 2]]), "1-D list of layer indices"), (np.array([1.0, 2.0]), "must be integers")):
        a = MIApp("x")
        a.write("add", vector=unit_rms(0)).layers(bad)
        with pytest.raises(XmixSpecError, match=msg):
            a.to_spec()


def test_scalars_and_vectors_that_float32_turns_into_inf_or_zero_are_refused(tmp_path):
    """Vectors, scales, clamp targets and probe biases are applied in float32: a bias beyond its
    range (every score would be inf / null), a scale or clamp target below its smallest normal, a
    vector whose every entry underflows (the app would silently apply nothing) are refused,
    naming the field; 0 and a vector of zeros as given are the caller's choice and accepted."""
    w = [0.1] * D_MODEL
    cases = [({"primitive": "read", "kind": "linear_probe", "layers": [1], "weight": w, "bias": 1e308},
              r"ops\.0\.bias: 1e\+308 exceeds float32's range"),
             ({"primitive": "read", "kind": "linear_probe", "layers": [1], "weight": w, "bias": -4e38},
              r"ops\.0\.bias: -4e\+38 exceeds float32's range"),
             ({"primitive": "write", "kind": "add", "layers": [1], "vector": w, "scale": 1e-300},
              r"ops\.0\.scale: 1e-300 underflows float32"),
             ({"primitive": "write", "kind": "clamp", "layers": [1], "vector": w, "value": -1e-40},
              r"ops\.0\.value: -1e-40 underflows float32"),
             ({"primitive": "write", "kind": "add", "layers": [1], "vector": [1e-46] * D_MODEL},
              r"ops\.0\.vector: every entry underflows float32"),
             ({"primitive": "read", "kind": "linear_probe", "layers": [1], "weight": [-1e-47] * D_MODEL},
              r"ops\.0\.weight: every entry underflows float32"),
             # an inline vector's entry beyond float32's range: at deploy(), as a file's at load
             ({"primitive": "write", "kind": "add", "layers": [1], "vector": [1.0] * (D_MODEL - 1) + [1e39]},
              r"ops\.0\.vector: entry 63 \(1e\+39\) exceeds float32's range \(\+-3\.4e\+38\)")]
    for op, msg in cases:
        with pytest.raises(XmixSpecError, match=msg):
            parse_deployment({"apps": [{"name": "a", "ops": [op]}]})
    for op in ({"primitive": "write", "kind": "add", "layers": [1], "vector": w, "scale": 0},
               {"primitive": "write", "kind": "add", "layers": [1], "vector": [0.0] * D_MODEL},
               {"primitive": "write", "kind": "add", "layers": [1], "vector": [1e-46] * (D_MODEL - 1) + [1e-3]},
               {"primitive": "read", "kind": "linear_probe", "layers": [1], "weight": w, "bias": 3e38}):
        parse_deployment({"apps": [{"name": "a", "ops": [op]}]})
    with pytest.raises(XmixSpecError, match=r"mi_apps\[0\]\.scale: 1e-45 underflows float32"):
        parse_request_apps([{"name": "a", "scale": 1e-45}], field="mi_apps")


def test_a_vector_given_as_one_number_or_null_is_refused_plainly():
    """One number (or null) where a vector goes: one message naming the field, not pydantic's
    one per member of the field's union (a list, a file reference)."""
    for v, got in ((5, "int 5"), (True, "bool True"), (2.5, "float 2.5"), (None, "null")):
        with pytest.raises(XmixSpecError) as e:
            parse_deployment({"apps": [{"name": "a", "ops": [{"primitive": "write", "kind": "add", "layers": [0],
                                                              "vector": v}]}]})
        assert str(e.value) == ("additional_config.xmix.apps.0.ops.0.vector: expected a list of numbers (a vector) "
                                f"or a file reference, got {got}"), str(e.value)
    with pytest.raises(XmixSpecError, match=r"ops\.0\.weight: expected a list of numbers \(a vector\) or a file "
                                            r"reference, got int 3"):
        parse_deployment({"apps": [{"name": "a", "ops": [{"primitive": "read", "kind": "linear_probe", "layers": [0],
                                                          "weight": 3}]}]})


def test_a_selection_too_long_to_be_real_is_refused_before_its_items_are_checked():
    """A request selects each app once and lists each layer once: a list longer than any
    deployment could use is refused by its length, before the (per-item) checks, so a huge
    selection cannot hold the server's event loop."""
    from vllm_xmix.spec.model import MAX_REQUEST_LAYERS
    from vllm_xmix.spec.request import MAX_REQUEST_APPS

    with pytest.raises(XmixSpecError, match=rf"mi_apps: {MAX_REQUEST_APPS + 1} apps; a request selects at most"):
        parse_request_apps([f"a{i}" for i in range(MAX_REQUEST_APPS + 1)])
    with pytest.raises(XmixSpecError, match=r"mi_apps\[0\]\.layers: 5000 layer indices; a request lists at most"):
        parse_request_apps([{"name": "a", "layers": [1] * 5000}])
    assert len(parse_request_apps([f"a{i}" for i in range(MAX_REQUEST_APPS)])) == MAX_REQUEST_APPS
    assert parse_request_apps([{"name": "a", "layers": list(range(MAX_REQUEST_LAYERS))}])[0].layers[-1] == 4095


def test_vector_beyond_float32_and_corrupt_npy(tmp_path):
    v = np.full(D_MODEL, 1.0)
    v[3] = 1e300
    with pytest.raises(XmixSpecError, match=r"entry 3 \(1e\+300\) exceeds float32's range"):
        load_vector(v.tolist(), "vector")
    np.save(tmp_path / "obj.npy", np.array([object()] * 4, dtype=object), allow_pickle=True)
    with pytest.raises(XmixSpecError, match="not a plain numeric .npy array") as e:
        load_vector(VectorFile(path=str(tmp_path / "obj.npy")), "vector")
    assert "allow_pickle" not in str(e.value)


def test_selection_given_twice_is_refused():
    from vllm_xmix import SamplingParams

    with pytest.raises(ValueError, match=r"given twice, as mi_apps and as extra_args\['xmix'\]"):
        SamplingParams(mi_apps=["a"], extra_args={"xmix": {"apps": [{"name": "b"}]}})
    sp = SamplingParams(mi_apps=["a"], extra_args={"other": 1})  # other extra args are kept
    assert sp.extra_args["other"] == 1 and sp.extra_args["xmix"] == {"apps": [{"name": "a"}]}
    import msgspec  # vLLM's IPC decodes a copy through __post_init__, with both set: the same selection

    back = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert back.extra_args == sp.extra_args and back.mi_apps == sp.mi_apps


def test_integers_beyond_float_range_are_refused_by_field():
    """JSON numbers may have any number of digits: an integer beyond float range (a scale, a
    vector entry, a threshold) is refused naming the field, not with an OverflowError."""
    huge = 10**400
    with pytest.raises(XmixSpecError, match=r"mi_apps\[0\]\.scale: must be finite, got an integer beyond float range"):
        parse_request_apps([{"name": "a", "scale": huge}])
    for op, field in (({"kind": "add", "vector": [huge] + [0.0] * (D_MODEL - 1)}, "vector"),
                      ({"kind": "add", "vector": [1.0] * D_MODEL, "scale": huge}, "scale"),
                      ({"primitive": "read", "kind": "linear_probe", "weight": [1.0] * D_MODEL, "bias": -huge}, "bias"),
                      ({"primitive": "read", "kind": "linear_probe", "weight": [1.0] * D_MODEL,
                        "on": {"threshold": huge}}, "on.threshold")):
        with pytest.raises(XmixSpecError, match=rf"apps\.0\.ops\.0\.{field}.*beyond float range"):
            parse_deployment({"apps": [{"name": "a", "ops": [op]}]})


def test_short_forms_and_refusals_a_user_meets_first(tmp_path):
    """What a first user writes: a deployment file's ``vector: v.npy`` (a path, relative to the
    file) and the same string in JSON; a request's ``"layers": "all"`` (as the builder takes it);
    and what is refused clearly: an unknown name echoed in full whatever its size, ``deploy()``
    with no apps, a list of apps passed as one argument."""
    from vllm_xmix.cli import load_deployment_file
    from vllm_xmix.spec import check_request_against_deployment

    np.save(tmp_path / "v.npy", unit_rms(7))
    (tmp_path / "apps.yaml").write_text(
        "apps:\n- name: happy\n  ops:\n  - {primitive: write, kind: add, hook: hook_resid_post, layers: [1, 2], vector: v.npy}\n")
    dep = parse_deployment(load_deployment_file(str(tmp_path / "apps.yaml")))
    assert dep.apps[0].ops[0].vector == VectorFile(path=str(tmp_path / "v.npy"))
    assert dep.apps[0].content_hash() == _app("happy", v=unit_rms(7)).content_hash()
    js = parse_deployment(json.dumps({"apps": [{"name": "p", "ops": [
        {"primitive": "read", "kind": "linear_probe", "layers": [1], "weight": str(tmp_path / "v.npy")}]}]}))
    assert js.apps[0].ops[0].weight == VectorFile(path=str(tmp_path / "v.npy"))

    (ra,) = parse_request_apps([{"name": "happy", "layers": "all"}])
    assert ra.layers is None
    assert parse_request_apps([{"name": "happy", "layers": np.array([1, 2])}])[0].layers == [1, 2]  # arrays as before
    check_request_against_deployment([ra], dep, 4)
    with pytest.raises(XmixSpecError, match="mi_apps.0..layers"):
        parse_request_apps([{"name": "happy", "layers": "some"}])
    # another spelling of "all" is refused, saying which one is taken (requests and deployments)
    with pytest.raises(XmixSpecError, match=r"""mi_apps\[0\]\.layers: expected a list of layer indices or "all", got str 'ALL'"""):
        parse_request_apps([{"name": "happy", "layers": "ALL"}])
    with pytest.raises(XmixSpecError, match=r"""layers: expected a list of layer indices or "all", got str 'All'"""):
        parse_deployment({"apps": [{"name": "p", "ops": [{"primitive": "write", "kind": "add", "layers": "All",
                                                          "vector": [1.0] * 4}]}]})

    long = "x" * 100_000
    with pytest.raises(XmixSpecError) as e:
        check_request_against_deployment(parse_request_apps([long]), dep, 4)
    assert "(100000 characters)" in str(e.value) and len(str(e.value)) < 400, len(str(e.value))

    with pytest.raises(XmixSpecError, match="deploy: no apps given"):
        deploy()
    with pytest.raises(XmixSpecError, match=r"deploy: argument 0 is a list of 1; pass the apps as arguments"):
        deploy([_app()])


def test_a_read_kind_without_its_primitive_names_the_primitive():
    """An op is a write unless it says ``primitive: read``: a probe declared without it gets an
    error that names the missing primitive, not only an unknown write kind."""
    from vllm_xmix.spec import AppSpec
    from vllm_xmix.spec.errors import _validated

    op = {"kind": "linear_probe", "layers": [1], "weight": [0.0] * 8, "bias": 0.0}
    with pytest.raises(XmixSpecError, match=r"ops.0.kind: 'linear_probe' is a read kind: a read op needs "
                                            r"\"primitive\": \"read\""):
        _validated(AppSpec, {"name": "p", "ops": [op]}, "app")
    assert _validated(AppSpec, {"name": "p", "ops": [{**op, "primitive": "read"}]}, "app").ops[0].kind == "linear_probe"


def test_deploy_names_its_argument():
    """deploy's errors name the argument as the caller passed it (not the engine config's path),
    and an argument that is no app at all is refused by its type."""
    with pytest.raises(XmixSpecError, match=r"^deploy: argument 0 is NoneType; expected an MIApp"):
        deploy(None)
    good = {"name": "a", "ops": [{"primitive": "write", "kind": "add", "layers": [1], "vector": [1.0] * D_MODEL}]}
    with pytest.raises(XmixSpecError, match=r"^deploy: argument 1 is int"):
        deploy(good, 5)
    bad = {"name": "b", "ops": [{"primitive": "write", "kind": "add", "layers": [1], "vector": [1.0, math.nan]}]}
    with pytest.raises(XmixSpecError, match=r"^deploy argument 1\.ops\.0\.vector: entry 1 is nan"):
        deploy(good, bad)
    with pytest.raises(XmixSpecError, match=r"^deploy argument 0\.ops: Field required"):
        deploy({"name": "c"})
    assert deploy(good)["xmix"]["apps"][0]["ops"][0]["vector"] == [1.0] * D_MODEL


def test_a_file_key_beside_the_vector_says_where_it_goes():
    """``key:`` written beside ``vector: file`` (not inside its ``{path, key}``) is refused
    saying where the key goes, for a write's vector and a probe's weight."""
    for op, field in (({"primitive": "write", "kind": "add", "layers": [1], "vector": "v.safetensors", "key": "happy"},
                       "vector"),
                      ({"primitive": "read", "kind": "linear_probe", "layers": [1], "weight": "w.pt", "key": "w"},
                       "weight")):
        with pytest.raises(XmixSpecError, match=rf"ops\.0\.key: a file's key goes with its path, {field}: "
                                                rf"\{{path: \.\.\., key: '{op['key']}'\}}, not beside {field}"):
            parse_deployment({"apps": [{"name": "a", "ops": [op]}]})
