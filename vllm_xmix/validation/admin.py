"""Apps on a running server, front end: the checks and bookkeeping behind the OpenAI server's
``/v1/mi/apps`` routes (the routes themselves: ``_vllm_compat/api_server.py``; the worker side:
``runtime/updates.py``; the design: docs/design.md, "Apps on a running server").

* ``GET /v1/mi/apps``: :func:`list_apps`;
* ``POST /v1/mi/apps/{name}`` (replace) and ``POST /v1/mi/apps`` (add): :func:`check_key` and
  :func:`check_content_type`, then :func:`prepare_change` parses and checks the body against the model and the deployment and
  returns the worker's payload; once every worker applied it, :func:`commit_change` makes the
  front end's request checks (names, layers, write sizes, prefix-cache salts) use the new apps
  and stamps the new version into the selections of requests added from then on.

Bodies are JSON only: an app as in a deployment file (``{"name"?, "ops": [...]}``) with vectors
inline, as a list of numbers, ``{"base64": <little-endian float32 bytes>}`` or ``{"safetensors":
<base64 of a .safetensors file>, "key"?: name}``. File paths (a string, a deployment file's
short form, or ``{"path": ...}``: a server-side file, and ``.pt`` files are pickles) and anything
that does not decode as such are refused. Errors are
:class:`AdminError` with the HTTP status and a message naming the field.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import os
from dataclasses import dataclass

import numpy as np

from ..hf_config import text_config
from ..runtime import app_structure, pool_kind
from ..spec import AppSpec, DeploymentConfig, XmixSpecError, resolve_layers
from ..spec.errors import _validated
from .requests import _deployment_info, app_versions, check_combined_magnitude, check_write_magnitude, \
    measure_deployment, set_live_deployment

#: environment variable holding the admin key (``vllm-xmix serve --admin-key`` sets it); without
#: it the admin routes take vLLM's ``--api-key``
ADMIN_KEY_ENV = "VLLM_XMIX_ADMIN_KEY"
#: the header that carries the admin key when vLLM's ``Authorization`` carries its API key
ADMIN_KEY_HEADER = "X-Admin-Key"
_NEXT_VERSION: dict[int, dict[str, int]] = {}


class AdminError(Exception):
    """A change refused: ``status`` (HTTP) and the message (naming the field)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def admin_keys(api_keys) -> list[str]:
    """The keys the changing routes accept: the admin key (:data:`ADMIN_KEY_ENV`) if set, else
    vLLM's API keys (``--api-key``, or ``VLLM_API_KEY``)."""
    k = os.environ.get(ADMIN_KEY_ENV)
    if k:
        return [k]
    return [x for x in (api_keys or [os.environ.get("VLLM_API_KEY")]) if x]


def check_key(headers, api_keys) -> None:
    """The changing routes need a key: :data:`ADMIN_KEY_HEADER` or ``Authorization: Bearer``.

    Raises:
        AdminError: 403 when the server has no key at all (the routes are off), 401 for a
        missing or wrong key."""
    keys = admin_keys(api_keys)
    if not keys:
        raise AdminError(403, "changing apps needs a key: start the server with --api-key or an admin key "
                              f"(vllm-xmix serve --admin-key, or {ADMIN_KEY_ENV})")
    given = []
    if headers.get(ADMIN_KEY_HEADER):
        given.append(headers.get(ADMIN_KEY_HEADER))
    scheme, _, token = (headers.get("Authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and token:
        given.append(token)
    if not given:
        raise AdminError(401, f"missing key: send it as '{ADMIN_KEY_HEADER}: <key>' or 'Authorization: Bearer <key>'")
    if not any(hmac.compare_digest(g.encode(), k.encode()) for g in given for k in keys):
        raise AdminError(401, "wrong key")


def _structure_change(new: list[dict], old: list[dict]) -> str:
    """Where a replace's ops (``runtime.updates.app_structure``) first differ from the deployed
    app's: ``"body.ops: 2 op(s) where the deployed app has 1"`` or ``"body.ops.0.layers: [2] where
    the deployed app has [1]"`` (values as JSON, cut to 60 characters); ``"body.ops"`` for equal ops."""
    def short(v) -> str:
        r = json.dumps(v)
        return r if len(r) <= 60 else r[:57] + "..."

    if len(new) != len(old):
        return f"body.ops: {len(new)} op(s) where the deployed app has {len(old)}"
    for i, (a, b) in enumerate(zip(new, old)):
        for k in list(b) + [k for k in a if k not in b]:
            if a.get(k) != b.get(k):
                return f"body.ops.{i}.{k}: {short(a.get(k))} where the deployed app has {short(b.get(k))}"
    return "body.ops"


#: the largest app-change body read (16 MiB: thousands of vectors of a large model as base64)
MAX_BODY_BYTES = 16 << 20


def check_content_type(headers) -> None:
    """A change's body is JSON, and says so (as vLLM's own routes require): ``Content-Type:
    application/json`` (or another ``+json`` / ``json`` type).

    Raises:
        AdminError: 415 for a request without a JSON content type (a form a browser page can send
        across sites included)."""
    ctype = (headers.get("Content-Type") or "").lower()
    if "json" not in ctype.split(";")[0]:
        raise AdminError(415, f"Content-Type: expected application/json, got {ctype or 'none'}")


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body.

    Raises:
        AdminError: 413 for a body over :data:`MAX_BODY_BYTES` (parsing it would hold the server's
        event loop, every stream with it); 400 for a body that is not a UTF-8 JSON object
        (pickles included)."""
    if len(raw) > MAX_BODY_BYTES:
        raise AdminError(413, f"body: {len(raw)} bytes; an app change takes at most {MAX_BODY_BYTES} (vectors inline "
                              "as base64 or safetensors are ~4 bytes a value: change fewer apps per call)")
    expected = 'expected a JSON object (an app: {"name", "ops": [...]}, vectors inline); nothing else (no pickles) is read'
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise AdminError(400, f"body: not UTF-8 text (byte {e.start}); {expected}") from None
    except json.JSONDecodeError as e:
        raise AdminError(400, f"body: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); {expected}") from None
    except (ValueError, RecursionError):
        raise AdminError(400, f"body: {expected}") from None
    if not isinstance(body, dict):
        raise AdminError(400, f"body: expected a JSON object, got {type(body).__name__}")
    return body


def _decode_vector(v, field: str):
    """An op's ``vector`` / ``weight`` as sent: a list of numbers stays; ``{"base64": ...}``
    (float32, little-endian) and ``{"safetensors": ..., "key"?}`` become one.

    Raises:
        AdminError: 400 for a file path, as ``{"path": ...}`` or as a string (a deployment
        file's short form of it: over HTTP it would make the server read its own files), and
        for a payload that does not decode."""
    if isinstance(v, str):
        raise AdminError(400, f"{field}: a string is a file path, and file paths are not accepted over HTTP; send "
                              "the values inline (a list of numbers, {\"base64\": float32 bytes} or {\"safetensors\": "
                              "file bytes in base64})")
    if not isinstance(v, dict):
        return v
    if "path" in v:
        raise AdminError(400, f"{field}.path: file paths are not accepted over HTTP; send the values inline (a list "
                              "of numbers, {\"base64\": float32 bytes} or {\"safetensors\": file bytes in base64})")
    extra = set(v) - {"base64", "safetensors", "key"}
    if extra or len(set(v) & {"base64", "safetensors"}) != 1:
        raise AdminError(400, f"{field}: expected a list of numbers, {{\"base64\": ...}} or {{\"safetensors\": ..., "
                              f"\"key\"?: ...}}, got keys {sorted(v)}")
    try:
        data = base64.b64decode(v.get("base64") or v.get("safetensors") or "", validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise AdminError(400, f"{field}: not valid base64") from None
    if "base64" in v:
        if "key" in v:
            raise AdminError(400, f"{field}.key: only a safetensors payload has keys")
        if len(data) % 4 or not data:
            raise AdminError(400, f"{field}.base64: {len(data)} bytes is not a whole number of float32 values")
        return np.frombuffer(data, dtype="<f4").astype(np.float64).tolist()
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        tensors = load(data)
    except (SafetensorError, Exception) as e:  # safetensors parses headers and raw buffers only, never code
        raise AdminError(400, f"{field}.safetensors: not a safetensors file ({type(e).__name__})") from None
    key = v.get("key")
    if key is not None and not isinstance(key, str):
        raise AdminError(400, f"{field}.key: expected the name of a tensor in the file (a string), got "
                              f"{type(key).__name__}")
    if key is None and len(tensors) != 1:
        raise AdminError(400, f"{field}.key: the file holds {sorted(tensors)}; name one")
    if key is not None and key not in tensors:
        raise AdminError(400, f"{field}.key: {key!r} not in the file (has {sorted(tensors)})")
    t = tensors[key] if key is not None else next(iter(tensors.values()))
    if t.dtype.kind != "f":
        raise AdminError(400, f"{field}.safetensors: expected floating-point values, got {t.dtype}")
    return t.astype(np.float64).reshape(-1).tolist() if t.ndim == 1 else t.tolist()


def _inline(body: dict) -> dict:
    out = dict(body)
    ops = out.get("ops")
    if isinstance(ops, list):
        out["ops"] = []
        for i, op in enumerate(ops):
            if isinstance(op, dict):
                op = dict(op)
                for key in ("vector", "weight"):
                    if key in op:
                        op[key] = _decode_vector(op[key], f"body.ops.{i}.{key}")
            out["ops"].append(op)
    return out


@dataclass
class Change:
    """A checked change: the worker's ``payload`` (without ``live``), the apps after it and
    their measures (``info``), the versions new requests run after it."""

    payload: dict
    dep: DeploymentConfig
    info: tuple
    versions: dict[str, int]


def prepare_change(vllm_config, action: str, name: str | None, body: dict) -> Change:
    """Check a replace (``action="replace"``, ``name`` from the path) or an add (``"add"``) of
    the app in ``body`` against the model and the apps as they are now.

    Raises:
        AdminError: 404 unknown app; 400 a malformed app, a vector of the wrong width, a
        replace that changes more than parameters, a write whose default scale overflows; 409 an
        add of a name in use; 422 an add the deployment reserved nothing for."""
    dep = _deployment_info(vllm_config)[0]
    if dep is None:
        raise AdminError(404 if action == "replace" else 422,
                         "no apps are deployed on this engine (start it with additional_config.xmix)")
    body = dict(body)
    if action == "replace":
        try:
            old = dep.app(name)
        except KeyError:
            raise AdminError(404, f"unknown app {name!r}; deployed apps: {[a.name for a in dep.apps]}") from None
        if body.get("name") is None:  # (absent or null: the app in the path)
            body["name"] = name
        if body["name"] != name:
            raise AdminError(400, f"body.name: {body['name']!r} differs from the app in the path {name!r}")
    else:
        name = body.get("name")
        if not isinstance(name, str):
            raise AdminError(400, "body.name: the new app's name is required (a string)")
        if any(a.name == name for a in dep.apps):
            raise AdminError(409, f"body.name: app {name!r} is already deployed (replace it with POST "
                                  f"/v1/mi/apps/{name})")
    try:
        app = _validated(AppSpec, _inline(body), "body")
        _check_for_model(vllm_config, app)
    except XmixSpecError as e:
        raise AdminError(400, str(e)) from None
    n_layers = text_config(vllm_config.model_config.hf_config).num_hidden_layers
    if action == "replace":
        new_s, old_s = app_structure(app, n_layers), app_structure(old, n_layers)
        if new_s != old_s:
            raise AdminError(400, f"{_structure_change(new_s, old_s)}: a replace keeps app {name!r}'s ops (kinds, "
                                  "hooks, layers, names, conditions, triggers) and changes parameters only (vector, "
                                  "weight, bias, value, scale, sigmoid, condition threshold)")
        apps = [app if a.name == name else a for a in dep.apps]
    else:
        _check_reserved(dep, app)
        apps = list(dep.apps) + [app]
    new = dep.model_copy(update={"apps": apps})
    info = measure_deployment(vllm_config, new)
    try:
        check_write_magnitude(vllm_config, name, None, "body", per_op=True, info=info)
        check_combined_magnitude(vllm_config, [(name, None, None)], "body", info=info)
    except XmixSpecError as e:
        raise AdminError(400, str(e)) from None
    version = _NEXT_VERSION.setdefault(id(vllm_config), {}).get(name, 0) + 1
    versions = {**app_versions(vllm_config), name: version}
    payload = {"action": action, "name": name, "version": version, "app": app.model_dump(mode="json")}
    return Change(payload, new, info, versions)


def _check_for_model(vllm_config, app: AppSpec) -> None:
    """Hooks of the architecture, layer range, vector widths (``validation.engine``'s checks),
    errors naming ``body.``."""
    from .engine import validate_for_model

    mc = vllm_config.model_config
    archs = list(getattr(mc, "architectures", None) or getattr(mc.hf_config, "architectures", []) or [])
    try:
        validate_for_model(DeploymentConfig(apps=[app]), archs, mc.hf_config)
    except XmixSpecError as e:
        msg = str(e).replace(f"additional_config.xmix.apps.0({app.name}).", "body.")
        raise XmixSpecError(msg.replace("additional_config.xmix", "body")) from None


def _check_reserved(dep: DeploymentConfig, app: AppSpec) -> None:
    """An added app's ops must be of reserved kinds (the worker checks the sites)."""
    kinds = dep.reserve.kinds() if dep.reserve is not None else {}
    for oi, op in enumerate(app.ops):
        kind = pool_kind(op)
        if kind is None or getattr(op, "on", None) is not None:
            raise AdminError(422, f"body.ops.{oi}: a {op.primitive} {op.kind!r} (with its cond/buffer/trigger) cannot "
                                  "be added on a running server; added apps take reserved entries: unconditional "
                                  "adds at residual-stream hooks, linear_probe and cosine reads without buffer or "
                                  "trigger")
        if kind not in kinds:
            raise AdminError(422, f"body.ops.{oi}: the deployment reserved no {kind!r} entries (reserve: "
                                  f"{dep.reserve.model_dump(mode='json', exclude_none=True) if dep.reserve else None})")


def commit_change(vllm_config, change: Change) -> None:
    """After every worker applied ``change``: new requests are checked against its apps and run
    its versions."""
    set_live_deployment(vllm_config, change.dep, change.versions, info=change.info)
    _NEXT_VERSION.setdefault(id(vllm_config), {})[change.payload["name"]] = change.payload["version"]


def list_apps(vllm_config) -> dict:
    """``GET /v1/mi/apps``: the apps new requests can select, each with its ops, hook sites,
    content hash and version (0: as deployed), whether it was deployed or added, and the
    deployment's reserve."""
    dep, hashes, *_ = _deployment_info(vllm_config)
    if dep is None:
        return {"object": "list", "data": [], "reserve": None}
    versions = app_versions(vllm_config)
    hf = vllm_config.model_config.hf_config
    n_layers = text_config(hf).num_hidden_layers
    base = {a.get("name") for a in (vllm_config.additional_config.get("xmix") or {}).get("apps", [])}
    data = []
    for app in dep.apps:
        ops, sites = [], []
        for op in app.ops:
            layers = resolve_layers(op.layers, n_layers, "layers")
            d = {"primitive": op.primitive, "kind": op.kind, "hook": op.hook, "layers": layers}
            if op.primitive == "read":
                d["name"] = op.name
            ops.append(d)
            sites += [f"blocks.{L}.{op.hook}" for L in layers if f"blocks.{L}.{op.hook}" not in sites]
        data.append({"name": app.name, "content_hash": hashes[app.name], "version": versions.get(app.name, 0),
                     "origin": "deployment" if app.name in base else "added", "ops": ops, "hook_sites": sites})
    return {"object": "list", "data": data, "fused_writes": dep.fused_writes,
            "reserve": dep.reserve.model_dump(mode="json", exclude_none=True) if dep.reserve else None}

