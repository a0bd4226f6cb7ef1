"""Apps on a running server: `GET /v1/mi/apps`, `POST /v1/mi/apps/{name}` (replace parameters)
and `POST /v1/mi/apps` (add into reserved capacity) on a real OpenAI server (CPU, compiled, one
server for the module). Requests streaming while a vector is replaced keep the parameters they
started with; each request's tokens and probe values equal HF with the parameters that request
saw and a fresh offline engine deployed with them; every refusal is a 4xx naming the field, and
the server keeps serving. The tests share the server and run in file order (later ones count on
the apps the earlier ones changed)."""

from __future__ import annotations

import base64
import json
import pickle
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import HAPPY_LAYERS, HAPPY_SCALE, PROMPTS, V_HAPPY, close_llm, make_llm, running_server, unit_rms

KEY = "admin-secret"
W = unit_rms(71) / 8  # a probe weight
V2 = unit_rms(72)  # happy's replacement vector
V_NEW = unit_rms(73)  # the added app's vector
W_NEW = unit_rms(74) / 8  # the added app's probe
N_LONG = 200  # tokens of the requests in flight during the replace


def base_deployment() -> dict:
    """happy (add at resid_post 1, 2) and probe (linear probe at 2), with reserved capacity:
    one spare version per app, one add at every resid_post, one probe at every hooked site."""
    from vllm_xmix import MIApp, deploy

    happy = MIApp("happy")
    happy.write("add", vector=V_HAPPY, scale=HAPPY_SCALE).layers(HAPPY_LAYERS).submodule("hook_resid_post")
    probe = MIApp("probe")
    probe.read("linear_probe", weight=W, bias=0.5).layers([2]).submodule("hook_resid_post")
    dep = deploy(happy, probe)
    dep["xmix"]["reserve"] = {"versions": 1, "add": {"hook_resid_post": "all"}, "linear_probe": 1}
    return dep


def app_json(name, ops) -> dict:
    return {"name": name, "ops": ops}


def happy_ops(v, scale=HAPPY_SCALE):
    return [{"primitive": "write", "kind": "add", "hook": "hook_resid_post", "layers": HAPPY_LAYERS,
             "vector": [float(x) for x in v], "scale": scale}]


NEW_OPS = [{"primitive": "write", "kind": "add", "hook": "hook_resid_post", "layers": [0, 3],
            "vector": {"base64": base64.b64encode(V_NEW.astype("<f4").tobytes()).decode()}, "scale": 2.0},
           {"primitive": "read", "kind": "linear_probe", "name": "score", "hook": "hook_resid_post", "layers": [3],
            "weight": [float(x) for x in W_NEW], "bias": -0.25}]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    import os

    log = tmp_path_factory.mktemp("admin") / "server.log"
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", tiny_llama, "--dtype", "float32",
            "--max-model-len", "256", "--max-num-seqs", "8", "--additional-config", json.dumps(base_deployment())]
    os.environ["VLLM_XMIX_ADMIN_KEY"] = KEY  # (the server's environment: running_server copies it)
    try:
        with running_server(args, log) as url:
            yield url, tiny_llama
    finally:
        os.environ.pop("VLLM_XMIX_ADMIN_KEY", None)


def call(url, path, body=None, key=KEY, raw: bytes | None = None, headers=None, method=None):
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["X-Admin-Key"] = key
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, headers=h, method=method or ("POST" if data is not None else "GET"))
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def complete(url, model, prompt, apps, n):
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "mi_apps": apps}
    status, resp = call(url, "/v1/completions", body, key=None)
    assert status == 200, resp
    return resp["choices"][0]["token_ids"], resp.get("mi_results")


class Stream:
    """A streaming completion read in a thread: ``first`` is set once its first chunk came."""

    def __init__(self, url, model, prompt, apps, n):
        body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "mi_apps": apps, "stream": True}
        self.req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                          headers={"Content-Type": "application/json"})
        self.tokens, self.finished, self.first = [], None, threading.Event()
        self.t = threading.Thread(target=self._run)
        self.t.start()

    def _run(self):
        with urllib.request.urlopen(self.req, timeout=300) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: {"):
                    continue
                c = json.loads(line[6:])["choices"][0]
                self.tokens += c.get("token_ids") or []
                if c.get("finish_reason"):
                    self.finished = c["finish_reason"]
                self.first.set()

    def join(self):
        self.t.join(300)
        return self.tokens


def probe_values(hf, ids, deltas, layer, w, b):
    x = hf.record(ids, [(layer, "hook_resid_post")], deltas)[(layer, "hook_resid_post")]
    return x @ w + b


def deltas_of(v, layers, scale):
    return {L: np.float32(scale) * v for L in layers}


def test_list_names_ops_sites_hashes(server):
    from vllm_xmix.spec import parse_deployment

    url, _ = server
    status, listed = call(url, "/v1/mi/apps", key=None)  # no key needed: vLLM has no --api-key here
    assert status == 200, listed
    dep = parse_deployment(base_deployment()["xmix"])
    by = {a["name"]: a for a in listed["data"]}
    assert set(by) == {"happy", "probe"}
    assert by["happy"]["hook_sites"] == ["blocks.1.hook_resid_post", "blocks.2.hook_resid_post"]
    assert by["happy"]["ops"] == [{"primitive": "write", "kind": "add", "hook": "hook_resid_post", "layers": [1, 2]}]
    assert by["probe"]["ops"][0]["name"] == "probe" and by["probe"]["hook_sites"] == ["blocks.2.hook_resid_post"]
    for a in dep.apps:
        assert by[a.name]["content_hash"] == a.content_hash() and by[a.name]["version"] == 0
    assert listed["reserve"]["versions"] == 1


def test_replace_while_streaming_then_add_each_request_sees_its_parameters(server, hf):
    """Requests streaming when happy's vector is replaced (and when an app is added) finish with
    the old vector; requests after the call run the new one and the added app; each equals HF
    and a fresh engine deployed with the parameters it saw."""
    url, model = server
    old = [Stream(url, model, p, ["happy", "probe"], N_LONG) for p in PROMPTS[:2]]
    for s in old:
        assert s.first.wait(120)
    status, resp = call(url, "/v1/mi/apps/happy", {"ops": happy_ops(V2)})
    assert status == 200, resp
    assert ["happy", 0] in resp["in_flight_versions"], resp  # the old version was still running
    assert all(s.finished is None for s in old), "the streams ended before the replace: nothing in flight"
    status, added = call(url, "/v1/mi/apps", app_json("newapp", NEW_OPS))
    assert status == 201, added
    assert added["origin"] == "added" and added["hook_sites"] == ["blocks.0.hook_resid_post",
                                                                   "blocks.3.hook_resid_post"]
    new_happy = [complete(url, model, p, ["happy", "probe"], 8) for p in PROMPTS[:2]]
    new_app = [complete(url, model, p, ["newapp"], 8) for p in PROMPTS[2:4]]
    old_toks = [s.join() for s in old]
    for s in old:
        assert s.finished == "length" and len(s.tokens) == N_LONG

    d_old, d_new = deltas_of(V_HAPPY, HAPPY_LAYERS, HAPPY_SCALE), deltas_of(V2, HAPPY_LAYERS, HAPPY_SCALE)
    d_added = deltas_of(V_NEW, [0, 3], 2.0)
    for p, toks in zip(PROMPTS[:2], old_toks):
        assert toks == hf.greedy(p, N_LONG, d_old), p
    assert any(toks != hf.greedy(p, 8, d_old) for p, (toks, _) in zip(PROMPTS[:2], new_happy))  # it changed
    for p, (toks, res) in zip(PROMPTS[:2], new_happy):
        assert toks == hf.greedy(p, 8, d_new), p
        want = probe_values(hf, p + toks[:-1], d_new, 2, W, 0.5)
        np.testing.assert_allclose(res["probe"]["probe"], want, rtol=1e-4, atol=1e-5)
    for p, (toks, res) in zip(PROMPTS[2:4], new_app):
        assert toks == hf.greedy(p, 8, d_added), p
        want = probe_values(hf, p + toks[:-1], d_added, 3, W_NEW, -0.25)
        np.testing.assert_allclose(res["newapp"]["score"], want, rtol=1e-4, atol=1e-5)

    # a fresh engine deployed with the parameters the later requests saw gives the same
    from vllm import SamplingParams

    from vllm_xmix import MIApp, deploy

    happy = MIApp("happy")
    happy.write("add", vector=V2, scale=HAPPY_SCALE).layers(HAPPY_LAYERS).submodule("hook_resid_post")
    probe = MIApp("probe")
    probe.read("linear_probe", weight=W, bias=0.5).layers([2]).submodule("hook_resid_post")
    new = MIApp("newapp")
    new.write("add", vector=V_NEW, scale=2.0).layers([0, 3]).submodule("hook_resid_post")
    new.read("linear_probe", weight=W_NEW, bias=-0.25, name="score").layers([3]).submodule("hook_resid_post")
    llm = make_llm(server[1], "eager", additional_config=deploy(happy, probe, new))
    try:
        sp = lambda apps: SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,  # noqa: E731
                                         extra_args={"xmix": apps})
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]],
                            [sp(["happy", "probe"])] * 2 + [sp(["newapp"])] * 2, use_tqdm=False)
    finally:
        close_llm(llm)
    for o, (toks, res), key in zip(outs, new_happy + new_app, [("probe", "probe")] * 2 + [("newapp", "score")] * 2):
        assert list(o.outputs[0].token_ids) == toks
        np.testing.assert_allclose(res[key[0]][key[1]], o.mi_results[key[0]][key[1]], rtol=1e-4, atol=1e-5)


def test_replace_changes_listing_hash_and_prefix_cache_salt(server, hf):
    """After a replace the listed content hash changes, and a request repeating an earlier
    prompt runs the new vector (no KV computed with the old one is reused)."""
    url, model = server
    _, before = call(url, "/v1/mi/apps", key=None)
    h0 = {a["name"]: a["content_hash"] for a in before["data"]}
    p = PROMPTS[0]
    toks_a, _ = complete(url, model, p, ["happy"], 8)
    v3 = unit_rms(75)
    status, resp = call(url, "/v1/mi/apps/happy", {"ops": happy_ops(v3, scale=3.0)})
    assert status == 200, resp
    assert resp["content_hash"] != h0["happy"] and resp["version"] > 0
    toks_b, _ = complete(url, model, p, ["happy"], 8)  # same prompt: a prefix-cache hit would reuse old KV
    assert toks_b == hf.greedy(p, 8, deltas_of(v3, HAPPY_LAYERS, 3.0))
    toks_c, _ = complete(url, model, p, [{"name": "happy", "scale": 0.5}], 8)
    assert toks_c == hf.greedy(p, 8, deltas_of(v3, HAPPY_LAYERS, 0.5))


def _safetensors_b64(arr) -> str:
    from safetensors.numpy import save

    return base64.b64encode(save({"v": arr})).decode()


def test_refusals_are_4xx_naming_the_field_and_the_server_serves_on(server, hf):
    url, model = server
    # the capacity and added-app checks below need newapp on the server (the streaming test
    # adds it; run alone or on another worker, this test adds it itself)
    _, listed = call(url, "/v1/mi/apps", key=None)
    if "newapp" not in {a["name"] for a in listed["data"]}:
        status, added = call(url, "/v1/mi/apps", app_json("newapp", NEW_OPS))
        assert status == 201, added
    good = {"ops": happy_ops(V_HAPPY)}
    cases = [
        # (path, body or raw bytes, key, status, message part)
        ("/v1/mi/apps/nope", good, KEY, 404, "unknown app 'nope'"),
        ("/v1/mi/apps/happy", {"ops": happy_ops(V_HAPPY[:63])}, KEY, 400, "length 63 != d_model 64"),
        ("/v1/mi/apps/happy", good, None, 401, "missing key"),
        ("/v1/mi/apps/happy", good, "wrong", 401, "wrong key"),
        ("/v1/mi/apps", app_json("x", NEW_OPS), None, 401, "missing key"),
        ("/v1/mi/apps/happy", b"not json", KEY, 400, "body: not valid JSON (Expecting value at line 1 column 1)"),
        ("/v1/mi/apps/happy", b'{"ops": [}', KEY, 400, "body: not valid JSON (Expecting value at line 1 column 10)"),
        ("/v1/mi/apps/happy", pickle.dumps({"ops": happy_ops(V_HAPPY)}), KEY, 400, "no pickles"),
        ("/v1/mi/apps/happy", {"ops": [{**happy_ops(V_HAPPY)[0], "vector": {"safetensors": base64.b64encode(
            pickle.dumps(V_HAPPY)).decode()}}]}, KEY, 400, "body.ops.0.vector.safetensors: not a safetensors file"),
        ("/v1/mi/apps/happy", {"ops": [{**happy_ops(V_HAPPY)[0], "vector": {"path": "/etc/passwd"}}]}, KEY, 400,
         "body.ops.0.vector.path: file paths are not accepted"),
        ("/v1/mi/apps/happy", {"ops": [{**happy_ops(V_HAPPY)[0], "vector": "/etc/passwd"}]}, KEY, 400,
         "body.ops.0.vector: a string is a file path, and file paths are not accepted"),
        ("/v1/mi/apps/happy", {"ops": [{**happy_ops(V_HAPPY)[0], "layers": [1]}]}, KEY, 400,
         f"body.ops.0.layers: [1] where the deployed app has {HAPPY_LAYERS}: a replace keeps app 'happy''s ops"),
        ("/v1/mi/apps/happy", {"ops": [{**happy_ops(V_HAPPY)[0], "hook": "hook_resid_pre"}]}, KEY, 400,
         'body.ops.0.hook: "hook_resid_pre" where the deployed app has "hook_resid_post"'),
        ("/v1/mi/apps/happy", {"ops": happy_ops(V_HAPPY) * 2}, KEY, 400,
         "body.ops: 2 op(s) where the deployed app has 1: a replace keeps"),
        ("/v1/mi/apps/happy", {"ops": [{**happy_ops(V_HAPPY)[0], "scale": 1e30}]}, KEY, 400,
         "body.ops.0.scale: app 'happy' op 0 would write values"),
        ("/v1/mi/apps/happy", {"name": "other", "ops": happy_ops(V_HAPPY)}, KEY, 400, "body.name"),
        ("/v1/mi/apps", {"name": "probe", "ops": NEW_OPS}, KEY, 409, "already deployed"),
        ("/v1/mi/apps", {"ops": NEW_OPS}, KEY, 400, "body.name"),
        ("/v1/mi/apps", app_json("cap", [{"primitive": "read", "kind": "capture", "layers": [1]}]), KEY, 422,
         "cannot be added on a running server"),
        ("/v1/mi/apps", app_json("abl", [{"primitive": "write", "kind": "ablate", "layers": [1],
                                          "vector": [float(x) for x in V_NEW]}]), KEY, 422, "cannot be added"),
        ("/v1/mi/apps", app_json("mid", [{"primitive": "write", "kind": "add", "hook": "hook_resid_mid",
                                          "layers": [1], "vector": [float(x) for x in V_NEW]}]), KEY, 422,
         "reserved no 'add' entry at blocks.1.hook_resid_mid"),
    ]
    for ctype in ("text/plain", "application/x-www-form-urlencoded", ""):  # vLLM's own routes take JSON only too
        got, resp = call(url, "/v1/mi/apps/happy", good, headers={"Content-Type": ctype})
        assert got == 415 and resp["error"]["message"].startswith("Content-Type: expected application/json"), resp
    for path, body, key, status, msg in cases:
        raw = body if isinstance(body, bytes) else None
        got, resp = call(url, path, None if raw else body, key=key, raw=raw)
        assert got == status, (path, msg, got, resp)
        assert msg in resp["error"]["message"], (msg, resp)
        if resp["error"]["message"].startswith("body."):  # the OpenAI error body's param: the field named
            assert resp["error"]["param"] == resp["error"]["message"].split(": ")[0], resp

    # no capacity left: newapp holds the only reserved add at layer 0
    st, resp = call(url, "/v1/mi/apps", app_json("full", [{**NEW_OPS[0], "layers": [0]}]))
    assert st == 507 and "the one reserved 'add' entry at blocks.0.hook_resid_post is in use" in resp["error"]["message"], resp
    # a safetensors vector is accepted; the added app runs
    st, resp = call(url, "/v1/mi/apps", app_json("st", [{**NEW_OPS[0], "layers": [1],
                                                        "vector": {"safetensors": _safetensors_b64(V_NEW)}}]))
    assert st == 201, resp
    # requests may not pick a version themselves
    status, resp = call(url, "/v1/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": 2,
                                                 "mi_apps": [{"name": "happy", "version": 0}]}, key=None)
    assert status == 400 and "mi_apps[0].version: set by the server" in json.dumps(resp), resp
    # the front end checks requests against the added app: its layers and its write sizes
    for sel, msg in (([{"name": "newapp", "layers": [1]}], "mi_apps[0].layers: layer 1 is not a deployed layer"),
                     ([{"name": "newapp", "scale": 1e30}], "mi_apps[0].scale: app 'newapp' op 0 would write")):
        status, resp = call(url, "/v1/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": 2,
                                                     "mi_apps": sel}, key=None)
        assert status == 400 and msg in json.dumps(resp), resp
    # the server still serves: the current happy, and the safetensors app
    _, listed = call(url, "/v1/mi/apps", key=None)
    assert {a["name"] for a in listed["data"]} >= {"happy", "probe", "newapp", "st"}
    toks, _ = complete(url, model, PROMPTS[1], ["st"], 8)
    assert toks == hf.greedy(PROMPTS[1], 8, deltas_of(V_NEW, [1], 2.0))
    toks, _ = complete(url, model, PROMPTS[1], [], 8)
    assert toks == hf.greedy(PROMPTS[1], 8, {})


def test_keys_and_reserve_errors_without_a_server(monkeypatch):
    """The changing routes' key rules (admin key, else vLLM's --api-key, else refused) and the
    reserve block's errors, naming the field."""
    from vllm_xmix.spec import XmixSpecError, parse_deployment
    from vllm_xmix.validation.admin import AdminError, _inline, check_key

    monkeypatch.delenv("VLLM_XMIX_ADMIN_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(AdminError, match="needs a key") as e:
        check_key({"X-Admin-Key": "x"}, None)
    assert e.value.status == 403
    check_key({"Authorization": "Bearer api"}, ["api"])  # vLLM's --api-key serves when no admin key is set
    monkeypatch.setenv("VLLM_XMIX_ADMIN_KEY", "adm")
    check_key({"Authorization": "Bearer api", "X-Admin-Key": "adm"}, ["api"])
    for headers, msg in (({"Authorization": "Bearer api"}, "wrong key"), ({}, "missing key")):
        with pytest.raises(AdminError, match=msg) as e:
            check_key(headers, ["api"])
        assert e.value.status == 401
    for reserve, msg in (({"capture": 1}, "reserve: capture: not reservable"),
                         ({"add": 0}, "reserve.add: expected an entry count"),
                         ({"add": {"mlp.hook_router_logits": "all"}}, "reserve.add: mlp.hook_router_logits: adds go"),
                         ({"versions": -1}, "reserve.versions: expected 0..16")):
        with pytest.raises(XmixSpecError, match=msg.replace(".", r"\.")):
            parse_deployment({"apps": [], "reserve": reserve})
    with pytest.raises(XmixSpecError, match="reserve: with fused_writes 'adds'"):
        parse_deployment({"apps": [], "fused_writes": "adds", "reserve": {"add": 1}})
    # a vector or a probe's weight given as a file path, in either spelling, is refused before any
    # file is looked at (the server would otherwise read its own files for the client)
    for key in ("vector", "weight"):
        for ref, field in (("/etc/passwd", f"body.ops.0.{key}: a string is a file path"),
                           ({"path": "/etc/passwd"}, f"body.ops.0.{key}.path: file paths are not accepted")):
            with pytest.raises(AdminError) as e:
                _inline({"ops": [{"primitive": "write", "kind": "add", "layers": [0], key: ref}]})
            assert e.value.status == 400 and str(e.value).startswith(field), str(e.value)
    # a body too large to parse on the event loop is refused by its size
    from vllm_xmix.validation.admin import MAX_BODY_BYTES, parse_body

    with pytest.raises(AdminError, match=r"body: \d+ bytes; an app change takes at most") as e:
        parse_body(b"[" + b"0," * (MAX_BODY_BYTES // 2) + b"0]")
    assert e.value.status == 413
    assert parse_body(json.dumps({"ops": [{"vector": [0.5] * 100_000}]}).encode())["ops"][0]["vector"][-1] == 0.5
    # a safetensors key that is not a string names the field (it was an unhashable-type message)
    from safetensors.numpy import save

    data = base64.b64encode(save({"a": np.ones(4, dtype=np.float32)})).decode()
    for key in (["a"], {"a": 1}, 3):
        with pytest.raises(AdminError) as e:
            _inline({"ops": [{"primitive": "write", "kind": "add", "layers": [0],
                              "vector": {"safetensors": data, "key": key}}]})
        assert e.value.status == 400 and str(e.value).startswith("body.ops.0.vector.key: expected the name"), str(e.value)
