"""Checks of one request's app selection against the engine's deployment, when the request is
added (offline and over HTTP): names, scales, layers and router masks against what is deployed,
write magnitudes against the model's dtype, and the request's prefix-cache salt (steered prefill
KV must not be shared with unsteered requests).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import re
import uuid

from ..hf_config import text_config
from ..spec import (CONFIG_KEY, XmixSpecError, check_request_against_deployment, check_router_masks, load_vector,
                    parse_deployment, parse_request_apps, request_to_wire, resolve_layers, router_masks)


#: projections (ablate, clamp) set the stream's projection on r to (1 - c) x.r + c value; x.r is
#: taken to be at most this in size when checking that a scale c keeps the write in the dtype
PROJ_SPAN = 64.0
_DEP_CACHE: dict[int, tuple] = {}
_LAYERS_CACHE: dict[int, tuple] = {}
#: checked selections: (engine config id, selection as canonical JSON, n) -> (the deployment
#: state they were checked against, wire, salt, whether it reads the prompt); most requests of a
#: deployment select one of a few selections, and each HTTP request is checked twice (before the
#: server answers, and where it enters the engine: the second finds the first's)
_SEL_CACHE: dict[tuple, tuple] = {}
_SEL_CACHE_MAX = 4096
#: selections longer than this as JSON (characters) are checked every time, not remembered
_SEL_KEY_MAX = 4096


#: a key in a field path: a name (hyphens allowed), or any other key as ``["..."]`` (JSON-quoted)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def field_path(parent: str, key: str) -> str:
    """``parent`` + ``key`` as error messages name a field: ``a.b``, or ``a["b c"]`` for a key
    that is not a plain name ("" parent: the key alone)."""
    if _NAME.fullmatch(key):
        return f"{parent}.{key}" if parent else key
    return f"{parent}[{json.dumps(key)}]"


#: how a selection key may be misspelled (lower case, ``_`` for ``-``, no surrounding spaces):
#: refused under any value, offline in ``extra_args`` and over HTTP
SELECTION_SPELLINGS = (CONFIG_KEY, "mi_apps", "mi_app", "xmix_apps")


def _normal_key(key: str) -> str:
    return key.strip().lower().replace("-", "_")


@functools.lru_cache(maxsize=1024)  # per request and key: the same few keys come again and again
def looks_like_selection_key(key: str) -> bool:
    """Whether ``key`` looks like a misspelled selection key: one of :data:`SELECTION_SPELLINGS`,
    ``apps``, or close to ``mi_apps`` / ``xmix`` in any case, with ``-`` / ``_`` anywhere and
    surrounding spaces (``xmx``, ``x_mix``, ``MiApps``, ``"xmix "``). Over HTTP nothing else reads
    such keys, so the key alone decides (``validation.http``); ``extra_args`` and
    ``additional_config`` are other extensions' too, so there a near miss is refused only with a
    value shaped like a selection (:func:`selection_shaped`)."""
    k = _normal_key(key)
    return k in SELECTION_SPELLINGS or k == "apps" or \
        bool(difflib.get_close_matches(k.replace("_", ""), ["miapps", "xmix"], n=1, cutoff=0.7))


def selection_shaped(value) -> bool:
    """Whether ``value`` has the shape of an app selection or deployment: a non-empty list whose
    items are all app names, ``{"name": ...}`` dicts or ``MIApp`` objects; a dict with ``apps``; or
    JSON text of one of these."""
    if isinstance(value, str):
        text = value.strip()
        if text[:1] not in ("[", "{"):
            return False
        try:
            value = json.loads(text)
        except ValueError:
            return False
    if isinstance(value, dict):
        return "apps" in value
    if isinstance(value, (list, tuple)) and value:
        from ..spec import MIApp

        return all(isinstance(v, (str, MIApp)) or (isinstance(v, dict) and "name" in v) for v in value)
    return False


def misspelled_selection_key(data: dict, allow: tuple[str, ...] = ()) -> str | None:
    """The first key of ``data`` (``extra_args`` or ``additional_config``) other than ``xmix``
    that holds a selection nothing reads: a spelling of the selection key (any value), or a near
    miss of it holding a selection-shaped value (:func:`looks_like_selection_key`,
    :func:`selection_shaped`); None if none. Other keys (other extensions': ``{"mix": 0.5}``,
    ``{"maps": {...}}``) pass, as do the near misses in ``allow`` (normalized: lower case, ``_``)."""
    for key, value in data.items():
        if key == CONFIG_KEY or not isinstance(key, str):
            continue
        k = _normal_key(key)
        if k in SELECTION_SPELLINGS or (k not in allow and looks_like_selection_key(key) and selection_shaped(value)):
            return key
    return None


#: what a cache salt for prompt reads holds before its per-request part (uuid4): a request
#: with one never shares prompt blocks, whatever else is salted
READ_SALT = ":read-"


def _deployment_info(vllm_config):
    """(deployment or None, {app name: content hash}, {app name: [(op index, deployed scale,
    size)]}, write limits, router masks) of the engine's apps as they are now (the deployment, or
    after a change on a running server :func:`set_live_deployment`), parsed, hashed and measured
    once: see :func:`measure_deployment`."""
    key = id(vllm_config)
    hit = _DEP_CACHE.get(key)
    if hit is not None and hit[0] is vllm_config:
        return hit[1:6]
    add = vllm_config.additional_config
    dep = parse_deployment(add[CONFIG_KEY]) if isinstance(add, dict) and CONFIG_KEY in add else None
    info = measure_deployment(vllm_config, dep)
    _DEP_CACHE[key] = (vllm_config, *info, {})
    return info


def _n_layers(vllm_config) -> int:
    """The model's decoder layers (``num_hidden_layers`` of its text config), read once per
    engine config: a transformers config answers attribute reads through Python-level
    ``__getattribute__`` overrides, a few dozen calls per read."""
    hit = _LAYERS_CACHE.get(id(vllm_config))
    if hit is not None and hit[0] is vllm_config:
        return hit[1]
    n = int(text_config(vllm_config.model_config.hf_config).num_hidden_layers)
    _LAYERS_CACHE[id(vllm_config)] = (vllm_config, n)
    return n


def measure_deployment(vllm_config, dep):
    """(``dep``, {app name: content hash}, {app name: [(op index, deployed scale, size)]}, write
    limits, router masks): per write op the size a scale multiplies (max |finite vector entry| of an add /
    router bias; for a projection see :func:`check_write_magnitude`), and the largest writes
    that stay finite with headroom: ``(residual stream, router logits)``. Router logits:
    ``finfo(dtype).max / 256``. The residual stream also goes through the next RMSNorm, whose
    float32 sum of squares over d_model overflows long before bf16 / float32 values do: at most
    ``sqrt(finfo(float32).max / d_model) / 16`` there (about 1.8e16 for d_model 4096). Router
    masks: the experts each ``router_bias`` write sets to -inf (:func:`~vllm_xmix.spec.router_masks`,
    inline vectors and files alike), for the requests' checks of masks combined or negated.

    Hashing an app serialises its vectors (milliseconds for d_model 4096): never per request."""
    import numpy as np
    import torch

    hashes = {a.name: a.content_hash() for a in dep.apps} if dep is not None else {}
    sizes: dict[str, list[tuple[int, float, float]]] = {}
    for app in (dep.apps if dep is not None else []):
        for oi, op in enumerate(app.ops):
            if op.primitive != "write":
                continue
            if op.kind in ("ablate", "clamp"):
                size = abs(float(op.value or 0.0))
            else:
                v = load_vector(op.vector, f"{app.name}.ops.{oi}.vector", allow_neg_inf=op.kind == "router_bias")
                v = v[np.isfinite(v)]
                size = float(np.abs(v).max()) if v.size else 0.0
            sizes.setdefault(app.name, []).append((oi, float(op.scale), size))
    dtype = getattr(vllm_config.model_config, "dtype", None)
    limit = float(torch.finfo(dtype if isinstance(dtype, torch.dtype) else torch.float32).max) / 256
    hf = getattr(vllm_config.model_config, "hf_config", None)
    d_model = int(getattr(text_config(hf), "hidden_size", 1) or 1) if hf is not None else 1
    stream = min(limit, float(np.sqrt(float(torch.finfo(torch.float32).max) / d_model)) / 16)
    masks = router_masks(dep) if dep is not None else {}
    return dep, hashes, sizes, (stream, limit), masks


def app_versions(vllm_config) -> dict[str, int]:
    """The version of each app that new requests run (absent: 0, the deployment's own);
    changed with :func:`set_live_deployment`."""
    _deployment_info(vllm_config)
    return _DEP_CACHE[id(vllm_config)][6]


def set_live_deployment(vllm_config, dep, versions: dict[str, int], info=None) -> None:
    """After an app was replaced or added on a running server: the front end's checks of new
    requests use ``dep`` (its apps, content hashes, so the prefix-cache salts, and write sizes)
    and stamp each selected app's version from ``versions`` into the canonical selection.
    ``info``: ``measure_deployment(vllm_config, dep)`` if already computed."""
    _DEP_CACHE[id(vllm_config)] = (vllm_config, *(info or measure_deployment(vllm_config, dep)), dict(versions))
    for k in [k for k in _SEL_CACHE if k[0] == id(vllm_config)]:  # (checked against the state replaced)
        del _SEL_CACHE[k]


def _deployment_of(vllm_config):
    """(deployment or None, {app name: content hash}): see :func:`_deployment_info`."""
    return _deployment_info(vllm_config)[:2]


def check_write_magnitude(vllm_config, app_name: str, scale: float | None, field: str, per_op: bool = False,
                          info=None) -> None:
    """A write whose size overflows the model's dtype puts inf/NaN into the KV cache, whose
    blocks later requests reuse: refused. Size of an add / router bias: |scale| x max |vector
    entry|; of a projection with coefficient c (the scale) and target value:
    |1 - c| x ``PROJ_SPAN`` + |c| x |value| (ablation, c = 1, never grows the stream).
    ``info``: :func:`measure_deployment` of the apps to check (default: the engine's, as now).

    ``scale``: the request's scale (None: the deployed ones). ``field``: how the error names the
    scale (``mi_apps[0].scale``); with ``per_op`` (the deployment's own check) the app's path,
    completed with the op's field (``<field>.ops.<i>.scale``, or ``.value`` for a clamp whose
    target is what is too large).

    Raises:
        XmixSpecError: naming the field, the size and the dtype's limit."""
    dep, _, sizes, (stream_limit, logit_limit), _ = info or _deployment_info(vllm_config)
    for oi, deployed, size in sizes.get(app_name, ()):
        c = deployed if scale is None else scale
        kind = dep.app(app_name).ops[oi].kind
        limit = logit_limit if kind == "router_bias" else stream_limit
        if kind in ("ablate", "clamp"):
            big = abs(1.0 - c) * PROJ_SPAN + abs(c) * size
        else:
            big = abs(c) * size
        if big > limit:
            dtype = getattr(vllm_config.model_config, "dtype", "float32")
            if per_op:  # the field to change: a clamp's value, a vector whose entries alone are too large, or the scale
                if kind == "clamp":
                    what = "value" if abs(c) * size >= abs(1.0 - c) * PROJ_SPAN else "scale"
                else:
                    what = "vector" if kind != "ablate" and size > limit else "scale"
                field = f"{field}.ops.{oi}.{what}"
            raise XmixSpecError(
                f"{field}: app {app_name!r} op {oi} would write values up to {big:.3g} (scale {c:g}"
                + (f", value {size:g}" if kind == "clamp" else
                   f", largest vector entry {size:g}" if kind != "ablate" else "") + "); "
                f"with the model's dtype {dtype}, writes up to {limit:.3g} stay finite here"
                + ("" if kind == "router_bias" else " (the next RMSNorm's float32 sum of squares included)")
                + ": larger ones overflow to inf/NaN, which would reach other requests through reused "
                "KV-cache blocks")


def check_combined_magnitude(vllm_config, selection, field: str, info=None) -> None:
    """The writes of several ops together: adds into the residual stream accumulate over the
    layers and apps that write them, so their sizes (|scale| x largest vector entry, each within
    :func:`check_write_magnitude`'s limit alone) summed over the selected layers and apps must
    stay within the residual stream's limit too; router biases add up per layer, within the
    router logits' limit. Projections (ablate, clamp) set a component rather than add to it and
    are checked per op only. ``selection``: ``[(app name, scale or None: the deployed ones,
    layers or None: the deployed ones)]``; ``info``: as for :func:`check_write_magnitude`.

    Raises:
        XmixSpecError: naming ``field``, the total, how many writes make it and the limit."""
    dep, _, sizes, (stream_limit, logit_limit), _ = info or _deployment_info(vllm_config)
    n_layers = _n_layers(vllm_config)
    stream, n_stream = 0.0, 0
    logits: dict[int, float] = {}
    for name, scale, layers in selection:
        app = dep.app(name)
        for oi, deployed, size in sizes.get(name, ()):
            op = app.ops[oi]
            if op.kind not in ("add", "router_bias"):
                continue
            at = resolve_layers(op.layers, n_layers, field)
            if layers is not None:
                chosen = set(layers)
                at = [L for L in at if L in chosen]
            big = abs(deployed if scale is None else scale) * size
            if op.kind == "add":
                stream += big * len(at)
                n_stream += len(at)
            else:
                for L in at:
                    logits[L] = logits.get(L, 0.0) + big
    dtype = getattr(vllm_config.model_config, "dtype", "float32")
    if stream > stream_limit:
        raise XmixSpecError(
            f"{field}: the adds of the selected apps write up to {stream:.3g} into the residual stream together "
            f"({n_stream} writes over their layers and apps, which accumulate); with the model's dtype {dtype}, "
            f"up to {stream_limit:.3g} in all stays finite through the next RMSNorm's float32 sum of squares: more "
            "overflows to inf/NaN, which would reach other requests through reused KV-cache blocks")
    for L, big in sorted(logits.items()):
        if big > logit_limit:
            raise XmixSpecError(
                f"{field}: the router biases of the selected apps add up to {big:.3g} at layer {L}; with the "
                f"model's dtype {dtype}, up to {logit_limit:.3g} stays finite: more overflows to inf/NaN, which "
                "would reach other requests through reused KV-cache blocks")


def validate_request(vllm_config, params):
    """Validate ``params.extra_args["xmix"]``; returns (canonical wire dict or None, salt or None).
    Errors name the field as the caller wrote it: ``mi_apps`` for a ``vllm_xmix.SamplingParams``
    built with ``mi_apps``, else ``extra_args.xmix``.

    Raises:
        XmixSpecError (a ValueError) naming the field; also for a key of ``extra_args`` that
        spells a selection otherwise (``mi_apps``, ``XMIX``, ``xmix-apps``: any case, ``-`` for
        ``_``), or a near miss of one (``xmx``, ``apps``) holding a selection
        (:func:`misspelled_selection_key`), which nothing would read: the request would run
        without its apps.
    """
    from vllm import SamplingParams

    if not isinstance(params, SamplingParams):
        return None, None
    ea = params.extra_args
    if not ea:
        return None, None
    key = misspelled_selection_key(ea)
    if key is not None:
        raise XmixSpecError(
            f"{field_path('extra_args', key)}: unknown key, which nothing reads, so the request would "
            f"run without these apps; select apps with extra_args[{CONFIG_KEY!r}] or "
            "vllm_xmix.SamplingParams(mi_apps=[...])")
    if CONFIG_KEY not in ea:
        return None, None
    field = "mi_apps" if getattr(params, "mi_apps", None) is not None else f"extra_args.{CONFIG_KEY}"
    return validate_selection(vllm_config, ea[CONFIG_KEY], getattr(params, "n", 1), field=field)


def selection_reads(vllm_config, wire) -> list[str]:
    """The apps of a checked selection (canonical ``wire``, :func:`validate_selection`) whose
    reads are on, so whose values (or trigger records) may come back to the front end: apps with
    a returned read (``AppSpec.has_reads``) at a scale other than 0 (scale 0: the app is off)."""
    apps = (wire or {}).get("apps") or ()
    if not apps:
        return []
    dep, _ = _deployment_of(vllm_config)
    return [a["name"] for a in apps if dep.app(a["name"]).has_reads and a.get("scale") != 0]


def validate_selection(vllm_config, raw, n: int = 1, field: str = "mi_apps"):
    """Validate a request's app selection (``extra_args["xmix"]`` / ``vllm_xargs["xmix"]``)
    against the engine's deployment; returns (canonical wire dict, cache salt or None). ``field``
    is how errors name the selection (``mi_apps`` offline, ``vllm_xargs.xmix`` over HTTP).

    A selection that passed is remembered with the deployment state it was checked against (its
    apps, their versions: :func:`set_live_deployment` makes a new state), so the next request
    with the same selection gets its own copy of the wire dict (and of its lists) and the salt
    without the checks; a request that reads the prompt still gets a salt part of its own.
    Refused selections, and selections longer than 4096 characters as JSON, are checked every
    time.

    Raises:
        XmixSpecError (a ValueError) naming the field.
    """
    try:
        text = json.dumps(raw, sort_keys=True, separators=(",", ":"))
        # (field only names the selection in errors, and errors are not remembered)
        key = (id(vllm_config), text, n) if len(text) <= _SEL_KEY_MAX else None
    except (TypeError, ValueError, RecursionError):  # not JSON-shaped: checked (and refused) below
        key = None
    _deployment_info(vllm_config)
    state = _DEP_CACHE[id(vllm_config)]
    hit = _SEL_CACHE.get(key) if key is not None else None
    if hit is None or hit[0] is not state:
        hit = (state, *_checked_selection(vllm_config, raw, n, field))
        if key is not None:
            if len(_SEL_CACHE) >= _SEL_CACHE_MAX:
                _SEL_CACHE.clear()
            _SEL_CACHE[key] = hit
    _, wire, salt, reads_prompt = hit
    wire = _own_copy(wire)  # (a request's canonical selection goes into its sampling params)
    if reads_prompt:  # values at every prompt position: the prompt must be computed, never a cache hit
        salt = f"{salt or 'xmix'}{READ_SALT}{uuid.uuid4().hex}"
    return wire, salt


def _own_copy(wire: dict) -> dict:
    """A canonical selection whose app dicts and their lists (``layers``) belong to the caller."""
    return {k: ([{f: (list(x) if isinstance(x, list) else x) for f, x in a.items()} for a in v] if k == "apps" else v)
            for k, v in wire.items()}


def _checked_selection(vllm_config, raw, n: int, field: str):
    """:func:`validate_selection` without the memo: (wire, salt of the apps that change the
    prompt's KV or None, whether an app reads the prompt)."""
    apps = parse_request_apps(raw, field=field)
    if not apps:
        return {"apps": []}, None, False
    for i, ra in enumerate(apps):
        if ra.version is not None:
            raise XmixSpecError(f"{field}[{i}].version: set by the server (the parameters the app has when the "
                                "request arrives); leave it out")
    dep, hashes = _deployment_of(vllm_config)
    if dep is None:
        raise XmixSpecError(
            f"{field}: app(s) {[a.name for a in apps]} requested but no apps are deployed on this "
            "engine (start it with additional_config={'xmix': ...}, see vllm_xmix.deploy)"
        )
    n_layers = _n_layers(vllm_config)
    masks = _deployment_info(vllm_config)[4]  # (cached: what _deployment_of read)
    check_request_against_deployment(apps, dep, n_layers, field=field, hashes=hashes, masks=masks)
    for i, ra in enumerate(apps):
        if ra.scale != 0.0:  # (None: the deployed scales)
            check_write_magnitude(vllm_config, ra.name, ra.scale, f"{field}[{i}].scale")
    check_combined_magnitude(vllm_config, [(ra.name, ra.scale, ra.layers) for ra in apps if ra.scale != 0.0], field)
    check_router_masks(apps, dep, n_layers, field=field, masks=masks)
    wire = request_to_wire(apps)
    versions = app_versions(vllm_config)
    for item in wire["apps"]:  # the parameters this request runs with: the app's version now
        if versions.get(item["name"]):
            item["version"] = versions[item["name"]]
    # apps whose coefficients are all zero change nothing: they do not split the prefix cache
    effective = []
    reads_prompt = False
    for i, ra in enumerate(apps):
        app = dep.app(ra.name)
        if ra.scale == 0:
            continue
        if app.has_reads and n > 1:
            raise XmixSpecError(f"{field}[{i}]: app {ra.name!r} has reads; reads with n > 1 (parallel "
                                f"sampling) are not supported (got n={n})")
        reads_prompt |= app.reads_prompt()
        # apps whose writes can land on prompt positions change the prompt's KV: salted by content;
        # apps that write only at generated positions (cond positions="generated") keep sharing
        scales = [op.scale if ra.scale is None else ra.scale for op in app.ops if op.primitive == "write"]
        if app.changes_prompt_kv() and any(s != 0.0 for s in scales):
            effective.append({"app": hashes[ra.name], "scale": ra.scale, "layers": ra.layers})
    salt = None
    if effective:
        salt = "xmix:" + hashlib.sha256(json.dumps(effective, sort_keys=True).encode()).hexdigest()[:24]
    return wire, salt, reads_prompt
