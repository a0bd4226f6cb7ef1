"""Requests: parsing a request's app selection (``mi_apps`` / ``extra_args["xmix"]``),
checking it against the deployment, and the canonical wire form."""

from __future__ import annotations

import json
import math
from typing import Any

from .deployment import resolve_layers
from .errors import XmixSpecError, _json, _validated
from .model import DeploymentConfig, RequestApp
from .vector_files import load_vector

#: per app, per router_bias op index: (the experts its mask sets to -inf, how many experts)
RouterMasks = dict[str, dict[int, tuple[frozenset, int]]]


def router_masks(dep: DeploymentConfig) -> RouterMasks:
    """The -inf entries (masked experts) of every ``router_bias`` write of ``dep``, from its
    vector inline or in a file (read here: call once per deployment, not per request).

    Raises:
        XmixSpecError: a vector file that cannot be read (:func:`.vector_files.load_vector`)."""
    out: RouterMasks = {}
    for app in dep.apps:
        for oi, op in enumerate(app.ops):
            if op.primitive != "write" or op.kind != "router_bias":
                continue
            v = op.vector if isinstance(op.vector, list) else \
                load_vector(op.vector, f"{app.name}.ops.{oi}.vector", allow_neg_inf=True).tolist()
            out.setdefault(app.name, {})[oi] = (frozenset(j for j, x in enumerate(v) if math.isinf(x)), len(v))
    return out


def _coerce_request_list(raw: Any, field: str) -> list[Any]:
    """The items of a request's app selection (a list, ``{"apps": [...]}``, or JSON of either)."""
    if isinstance(raw, str):
        if not raw.strip():
            raise XmixSpecError(f"{field}: empty; expected a list of apps, e.g. ['<app name>'] or "
                                "'[{\"name\": \"<app name>\", \"scale\": 4}]'")
        if not raw.lstrip().startswith(("[", "{")):
            try:  # JSON text of a name, null, a number: say so, with the list it should be
                inner = json.loads(raw)
            except (ValueError, RecursionError):
                inner = raw
            if isinstance(inner, str):
                raise XmixSpecError(f"{field}: expected a list of apps (e.g. {json.dumps([inner])}), got "
                                    f"{'the name' if inner == raw else 'the JSON string'} {raw!r}")
            raise XmixSpecError(f"{field}: expected a list of apps (e.g. [\"<app name>\"]), got JSON {raw.strip()}")
        raw = _json(raw, field)
    if isinstance(raw, dict):
        if "apps" not in raw or set(raw) - {"apps"}:
            raise XmixSpecError(f"{field}: expected a list of apps (or its wire form {{'apps': [...]}}), got a "
                                f"mapping with keys {sorted(raw)}")
        raw = raw["apps"]
    if isinstance(raw, (str, dict)) or not isinstance(raw, (list, tuple)):
        raise XmixSpecError(f"{field}: expected a list of apps, got {type(raw).__name__}")
    if len(raw) > MAX_REQUEST_APPS:  # (checked before any item: each costs microseconds on the event loop)
        raise XmixSpecError(f"{field}: {len(raw)} apps; a request selects at most {MAX_REQUEST_APPS} (each app once)")
    return list(raw)


#: the most apps one request may select (far more than a deployment holds: a longer list is
#: refused before its items are looked at, so a huge one cannot hold the server's event loop)
MAX_REQUEST_APPS = 1024


def parse_request_apps(raw: Any, field: str = "mi_apps") -> list[RequestApp]:
    """Parse a request's app selection without a deployment (structure, types, finiteness).

    Accepts a list whose items are app names or ``{"name", "scale"?, "layers"?}`` dicts (or
    :class:`RequestApp`), a ``{"apps": [...]}`` dict, or a JSON string of either (the form
    ``vllm_xargs`` carries over HTTP).

    Raises:
        XmixSpecError: e.g. ``mi_apps[0].scale: expected a number, got str 'high'``.
    """
    items = _coerce_request_list(raw, field)
    out: list[RequestApp] = []
    seen: set[str] = set()
    for i, it in enumerate(items):
        f = f"{field}[{i}]"
        if isinstance(it, RequestApp):
            ra = it
        elif isinstance(it, str):
            ra = RequestApp(name=it)
        elif isinstance(it, dict):
            ra = _validated(RequestApp, it, f)
        elif hasattr(it, "name") and hasattr(it, "to_spec"):  # an MIApp: by name, checked by content
            try:
                ra = RequestApp(name=it.name, hash=it.content_hash())
            except XmixSpecError as e:
                raise XmixSpecError(f"{f}: {e}") from None
        else:
            raise XmixSpecError(f"{f}: expected an app name or {{'name': ..., 'scale': ...}}, got {type(it).__name__}")
        if ra.name in seen:
            raise XmixSpecError(f"{f}.name: app {short_name(ra.name)} listed twice")
        seen.add(ra.name)
        out.append(ra)
    return out


#: the longest app name an error message repeats whole
MAX_NAME_ECHO = 64


def short_name(name: str) -> str:
    """``repr(name)``, shortened to :data:`MAX_NAME_ECHO` characters with its length said (a
    request's unknown name is echoed in its error, and a client may send any string)."""
    if len(name) <= MAX_NAME_ECHO:
        return repr(name)
    return f"{name[:MAX_NAME_ECHO]!r}... ({len(name)} characters)"


def check_request_against_deployment(apps: list[RequestApp], dep: DeploymentConfig, n_layers: int,
                                     field: str = "mi_apps", hashes: dict[str, str] | None = None,
                                     masks: RouterMasks | None = None) -> None:
    """Raises XmixSpecError for unknown app names, layers outside the app's deployed layers, an
    app passed as an object whose content differs from the deployed app of that name, and a
    negative scale for an app whose router_bias masks experts (``masks``: :func:`router_masks`
    of ``dep``, computed here when not given)."""
    names = [a.name for a in dep.apps]
    for i, ra in enumerate(apps):
        try:
            app = dep.app(ra.name)
        except KeyError:
            raise XmixSpecError(
                f"{field}[{i}].name: unknown app {short_name(ra.name)}; deployed apps: "
                f"{names or 'none (no additional_config.xmix)'}"
            ) from None
        if masks is None and ra.scale is not None and ra.scale < 0:
            masks = router_masks(dep)
        if ra.scale is not None and ra.scale < 0 and any(m for m, _ in (masks or {}).get(ra.name, {}).values()):
            raise XmixSpecError(
                f"{field}[{i}].scale: must be >= 0 for app {ra.name!r}, whose router_bias masks experts "
                f"with -inf (got {ra.scale}); a negative scale turns the mask into +inf/NaN"
            )
        if ra.scale not in (None, 0.0) and not any(op.primitive == "write" for op in app.ops):
            raise XmixSpecError(
                f"{field}[{i}].scale: app {ra.name!r} has no writes, a scale would change nothing (only 0, "
                "which switches the app off, is accepted)")
        if ra.hash is not None:
            deployed = (hashes or {}).get(ra.name) or app.content_hash()
            if ra.hash != deployed:
                raise XmixSpecError(
                    f"{field}[{i}]: app {ra.name!r} differs from the deployed app of that name "
                    f"(content hash {ra.hash} != deployed {deployed}); requests select deployed apps"
                )
        if ra.layers is not None:
            allowed = set()
            for op in app.ops:
                allowed.update(resolve_layers(op.layers, n_layers, f"{field}[{i}].layers"))
            bad = [x for x in ra.layers if x not in allowed]
            if bad:
                raise XmixSpecError(
                    f"{field}[{i}].layers: layer {bad[0]} is not a deployed layer of app {ra.name!r} "
                    f"(deployed: {sorted(allowed)})"
                )
            useful = set()  # layers of the app's writes and returned reads (condition reads do nothing alone)
            for op in app.ops:
                if op.primitive == "write" or op.buffer is None:
                    useful.update(resolve_layers(op.layers, n_layers, f"{field}[{i}].layers"))
            if not useful & set(ra.layers):
                raise XmixSpecError(
                    f"{field}[{i}].layers: {ra.layers} selects only condition reads of app {ra.name!r}, so the "
                    f"app would do nothing; its writes and returned reads are at layers {sorted(useful)}")
            for op in app.ops:  # a latched write needs its read on at one of the read's layers at least
                if op.primitive != "write" or op.cond is None or op.cond.latch is None:
                    continue
                wl = set(resolve_layers(op.layers, n_layers, f"{field}[{i}].layers")) & set(ra.layers)
                rl = resolve_layers(app.latch_read(op.cond.latch).layers, n_layers, f"{field}[{i}].layers")
                if wl and not set(rl) & set(ra.layers):
                    raise XmixSpecError(
                        f"{field}[{i}].layers: {ra.layers} selects writes of app {ra.name!r} latched on read "
                        f"{op.cond.latch!r} (layers {sorted(wl)}) but none of that read's layers {rl}, so the latch "
                        "could never fire; add one of them")


def check_router_masks(apps: list[RequestApp], dep: DeploymentConfig, n_layers: int,
                       field: str = "mi_apps", masks: RouterMasks | None = None) -> None:
    """Raises XmixSpecError if the router masks of the selected apps together mask every expert
    at some layer (softmax over all -inf logits is NaN, and NaN would reach the KV cache), the
    masks inline or in files alike (``masks``: :func:`router_masks` of ``dep``, computed here when
    not given)."""
    if masks is None:
        masks = router_masks(dep)
    masked: dict[int, set[int]] = {}
    n_exp = None
    for ra in apps:
        if ra.scale == 0:
            continue
        app = dep.app(ra.name)
        for oi, (idx, n) in masks.get(ra.name, {}).items():
            op = app.ops[oi]
            n_exp = n
            layers = resolve_layers(op.layers, n_layers, field)
            if ra.layers is not None:
                layers = [L for L in layers if L in set(ra.layers)]
            for L in layers:
                masked.setdefault(L, set()).update(idx)
    for L, idx in sorted(masked.items()):
        if n_exp is not None and len(idx) >= n_exp:
            raise XmixSpecError(f"{field}: the selected apps mask every expert at layer {L} (-inf everywhere)")


def request_to_wire(apps: list[RequestApp]) -> dict[str, Any]:
    """The canonical ``extra_args["xmix"]`` payload."""
    return {"apps": [a.model_dump(exclude_none=True) for a in apps]}
