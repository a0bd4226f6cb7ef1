"""Checks of an OpenAI-server request's app selection before the server starts answering, so
that a bad selection is an HTTP 400 also for streaming requests (whose status is sent before the
engine sees the request).

A request selects apps with a top-level ``"mi_apps"`` body field (the shape of
``SamplingParams(mi_apps=...)``: names, or objects with ``name``, ``scale``, ``layers``), or with
``vllm_xargs["xmix"]`` (the same list, or its JSON text). A body field or ``vllm_xargs`` key
that looks like a selection but is neither (``"xmx"``, ``"mi_app"``, ``"extra_body"`` sent as a
field) is refused by name: a request the apps would silently not apply to is never answered.
"""

from __future__ import annotations

import difflib
import json
import re

import msgspec

from ..spec import CONFIG_KEY, XmixSpecError
from .requests import field_path, looks_like_selection_key, selection_reads, validate_selection

BODY_FIELD = "mi_apps"
#: the routes whose requests apps apply to (and whose responses carry read values)
SELECTION_ROUTES = ("/v1/completions", "/v1/chat/completions")
#: the routes of apps on a running server (their bodies are apps, not selections)
ADMIN_PREFIX = "/v1/mi/"
#: the longest route path an error message repeats
_MAX_ECHO = 80


_QUOTED = r'\["(?:[^"\\]|\\.)*"\]'
#: the field an error message starts with (``"<field>: ..."``, as every selection and app error
#: here is written): a dotted path with list indices, e.g. ``vllm_xargs.xmix[0].scale``,
#: ``vllm_xargs["xmix "]`` or, in pydantic's spelling of an app body, ``body.ops.0.vector``
_FIELD = re.compile(rf"((?:[A-Za-z_][A-Za-z0-9_-]*|{_QUOTED})(?:\[\d+\]|\.[A-Za-z_][A-Za-z0-9_-]*|\.\d+|{_QUOTED})*): ")
#: request-body objects a selection is mistakenly put in (the offline spelling ``extra_args``,
#: ``/inference/v1/generate``'s ``sampling_params`` and its ``extra_args``, vLLM's transfer
#: parameters): the keys :func:`_selection_paths` looks at; any other object (schemas, metadata,
#: template arguments: user data that may name a property ``xmix``) is not looked into
_CONTAINERS = {"extra_args": (), "kv_transfer_params": (), "ec_transfer_params": (),
               "sampling_params": ("extra_args",), "vllm_xargs": ()}


def error_param(message: str) -> str | None:
    """The request field an error ``message`` names first, for the OpenAI error body's ``param``
    (``"vllm_xargs.xmix[0].name: unknown app 'nope'"`` -> ``"vllm_xargs.xmix[0].name"``), or None
    for a message that does not start with one."""
    m = _FIELD.match(message)
    return m.group(1) if m else None


def _as_utf8(body: bytes) -> bytes:
    """A JSON body as UTF-8 bytes: a body in UTF-16 or UTF-32 (which vLLM's server accepts, its
    JSON decoder detecting the encoding from the first bytes, RFC 4627) is re-encoded, so that the
    byte searches of :func:`_mentions` and the parse see its keys; a UTF-8 body (the usual case:
    two byte comparisons) is returned as it is, and so is one that does not decode."""
    if len(body) < 2 or (body[0] not in (0, 0xEF, 0xFE, 0xFF) and body[1]):  # (UTF-16/32: a NUL or a BOM up front)
        return body
    enc = json.detect_encoding(body)
    if enc == "utf-8":
        return body
    try:
        return body.decode(enc).encode("utf-8")
    except (UnicodeDecodeError, LookupError):
        return body


def _mentions(body: bytes) -> bool:
    """Whether a raw body may hold a selection key (``xmix``, ``mi_apps``, ``mi-apps``, in any
    case, or spelled with JSON escapes such as ``\\u0058MIX``): only such bodies are parsed. One
    lower-cased copy and four byte searches, on every POST (~0.15 ms for a body of 100 KB;
    ``bytes.lower`` is faster than a case-insensitive regular expression by far), so that a
    key of any case in a misspelled container (``vllm_xarg.XMIX``) is found too. Bodies with
    ASCII escapes (``\\u00``: accented text from clients that escape non-ASCII) and long
    base64 data (about one match of ``xmix`` in any case per MB) are parsed for nothing; vLLM
    parses every body anyway."""
    low = body.lower()
    return CONFIG_KEY.encode() in low or b"mi_apps" in low or b"mi-apps" in low or b"\\u00" in low


def _is_selection_key(key) -> bool:
    """``xmix`` or ``mi_apps``, in any case, with ``-`` for ``_``."""
    return isinstance(key, str) and key.lower().replace("-", "_") in (CONFIG_KEY, BODY_FIELD)


def _looks_like_container(key: str) -> bool:
    """A top-level key that is, or looks like a misspelling of, ``vllm_xargs`` or ``extra_args``."""
    k = key.lower().replace("-", "").replace("_", "")
    return bool(difflib.get_close_matches(k, ["vllmxargs", "extraargs"], n=1, cutoff=0.8))


def _selection_paths(data: dict):
    """Paths of the selection keys (``xmix``, ``mi_apps``, any case) of a request body: at the top
    level, and directly inside the objects of :data:`_CONTAINERS` (and their listed sub-objects)
    or of a top-level key that looks like ``vllm_xargs`` / ``extra_args``."""
    for key, value in data.items():  # (JSON object keys are strings)
        if _is_selection_key(key):
            yield field_path("", key)
        elif isinstance(value, dict) and (key in _CONTAINERS or _looks_like_container(key)):
            yield from _keys_in(field_path("", key), value, _CONTAINERS.get(key, ()))


def _keys_in(path: str, obj: dict, subs=()):
    """Paths of the selection keys directly in ``obj`` (at ``path``) and in its sub-objects ``subs``."""
    for k, v in obj.items():
        if _is_selection_key(k):
            yield field_path(path, k)
        elif k in subs and isinstance(v, dict):
            yield from _keys_in(field_path(path, k), v)


def on_route_error(body: bytes) -> str | None:
    """For a request to one of :data:`SELECTION_ROUTES`: the error message of
    :func:`xargs_type_error` or :func:`misplaced_selection` for its raw JSON ``body`` (parsed
    once, and only if it mentions a selection; UTF-16 and UTF-32 bodies too), else None."""
    data = _selection_body(body)
    if data is None:
        return None
    return xargs_type_error(data) or misplaced_selection(data)


def misplaced_selection(data: dict) -> str | None:
    """For a request to one of :data:`SELECTION_ROUTES`: the error message if its JSON body
    ``data`` holds an ``xmix`` or ``mi_apps`` key anywhere but at ``vllm_xargs.xmix`` and the top
    level (``extra_args.xmix``, the offline spelling; ``sampling_params.extra_args.xmix``;
    ``kv_transfer_params.xmix``; a misspelled ``vllm_xargs`` such as ``vllm_xarg.xmix``), which
    the server would not read: the request would run without its apps. Else None."""
    for path in _selection_paths(data):
        if path not in (BODY_FIELD, f"vllm_xargs.{CONFIG_KEY}"):
            return (f"{path}: not read by this server, so the request would run without these apps; select "
                    f"apps with vllm_xargs.{CONFIG_KEY} or a top-level \"{BODY_FIELD}\" field")
    return None


def take_body_selection(request) -> tuple[str | None, str, object]:
    """Move a request's top-level ``mi_apps`` field into ``vllm_xargs["xmix"]`` (as JSON text,
    the form the engine reads), so one path serves both spellings. Returns (the error message
    for a body that looks like a selection but is not one, or gives it twice, else None; the
    name errors about the selection use, ``mi_apps`` or ``vllm_xargs.xmix``; the selection as
    the client sent it, checked as such).
    Known fields of vLLM's request models are never looked at (only ``model_extra``)."""
    extra = getattr(request, "model_extra", None)
    extra = extra if isinstance(extra, dict) else {}
    xargs = getattr(request, "vllm_xargs", None) or {}
    for key in extra:
        if key == BODY_FIELD:
            continue
        if key == "extra_body":
            return ("extra_body: is the OpenAI Python client's argument, not a request field; send its "
                    f"contents as top-level fields (e.g. {{\"{BODY_FIELD}\": [...]}})"), "", None
        if looks_like_selection_key(key):
            return (f"{field_path('', key)}: unknown request field; apps are selected with \"{BODY_FIELD}\" "
                    f"(or vllm_xargs.{CONFIG_KEY})"), "", None
    for key in xargs:
        if key != CONFIG_KEY and looks_like_selection_key(key):
            return (f"{field_path('vllm_xargs', key)}: unknown key; apps are selected with "
                    f"vllm_xargs.{CONFIG_KEY} or a top-level \"{BODY_FIELD}\" field"), "", None
    if BODY_FIELD in extra:
        if CONFIG_KEY in xargs:
            return (f"{BODY_FIELD}: given beside vllm_xargs.{CONFIG_KEY}, which selects apps too: give the "
                    "selection once"), "", None
        sel = extra.pop(BODY_FIELD)
        if sel is None:
            return None, BODY_FIELD, None
        if isinstance(sel, str):  # (JSON text is vllm_xargs' form; this field carries the list itself)
            return (f"{BODY_FIELD}: expected a list of apps (names, or objects with name, scale, layers), "
                    f"e.g. {json.dumps(_list_example(sel))}, got a string; JSON text of the list goes in "
                    f"vllm_xargs.{CONFIG_KEY}"), "", None
        request.vllm_xargs = {**xargs, CONFIG_KEY: json.dumps(sel)}
        return None, BODY_FIELD, sel
    return None, f"vllm_xargs.{CONFIG_KEY}", xargs.get(CONFIG_KEY)


def _list_example(text: str) -> list:
    """The list a string given as the ``mi_apps`` field most likely meant: its JSON's list (an
    object inside one), a name inside one, or a placeholder."""
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, list):
        return parsed
    if isinstance(parsed, (dict, str)):
        return [parsed]
    return [text] if not text.lstrip().startswith(("[", "{")) else ["<app name>"]


def _n_prompts(prompt) -> int:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def http_selection_check(serving, request, n_prompts: int = 1) -> tuple[str | None, bool]:
    """Checks of a request's ``vllm_xargs["xmix"]`` before the OpenAI server starts answering (so
    a bad selection is an HTTP 400 also for streaming requests, whose status is sent before the
    engine sees the request; a top-level ``mi_apps`` is moved into ``vllm_xargs`` first,
    :func:`take_body_selection`). Returns (the error message or None, whether the request's
    responses may carry read values or trigger records: False for a request without apps, whose
    apps only write, or whose reading apps are off (scale 0); True where that is not known here,
    e.g. without the engine's configuration)."""
    err, field, sent = take_body_selection(request)
    if err is not None:
        return err, False
    xargs = getattr(request, "vllm_xargs", None) or {}
    if CONFIG_KEY not in xargs:
        return None, False
    vllm_config = getattr(getattr(serving, "engine_client", None), "vllm_config", None)
    try:
        if vllm_config is None:
            return None, True  # the engine checks it when the request is added
        wire, _ = validate_selection(vllm_config, sent, getattr(request, "n", 1) or 1, field=field)
        if not wire or not wire["apps"]:
            return None, False
        if getattr(request, "use_beam_search", False):
            raise XmixSpecError(f"{field}: beam search builds its own sampling requests, which "
                                "would run without the apps; not supported with vllm-xmix apps")
        reads = selection_reads(vllm_config, wire)
        if reads and n_prompts > 1:
            raise XmixSpecError(f"{field}: apps {reads} have reads, but a completions request with "
                                f"{n_prompts} prompts returns one kv_transfer_params for all of them; send one "
                                "prompt per request")
    except XmixSpecError as e:
        return str(e), False
    return None, bool(reads)


#: msgspec (a vLLM dependency) parses JSON several times faster than the json module: it runs on
#: the server's event loop (for every streamed chunk of a request with reads, :mod:`.openai_server`)
_DECODE = msgspec.json.Decoder()


def parse_json(text: str | bytes):
    """The JSON value of ``text`` (msgspec; the json module where msgspec is stricter, e.g. a
    number beyond float range), or None if neither parses it."""
    try:
        return _DECODE.decode(text)
    except (ValueError, RecursionError):  # (msgspec.DecodeError is one; nesting deeper than it goes: RecursionError)
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            return None


def _selection_body(body: bytes) -> dict | None:
    """The JSON object of a raw request ``body`` that may select apps (:func:`_mentions`, after
    :func:`_as_utf8`), else None: no selection key in its bytes, not JSON, or not an object."""
    body = _as_utf8(body)
    if not _mentions(body):
        return None
    data = parse_json(body)
    return data if isinstance(data, dict) else None


def selection_off_route(path: str, body: bytes) -> str | None:
    """For a POST to a route outside :data:`SELECTION_ROUTES` (and the ``/v1/mi/`` routes): the
    error message if its JSON ``body`` selects apps (a top-level ``mi_apps`` field, or
    ``vllm_xargs.xmix``; also an ``xmix`` / ``mi_apps`` key nested in the body's objects, e.g.
    ``sampling_params.extra_args.xmix``), which that route would not apply (``/v1/messages``, the embedding
    routes) or apply without returning read values (``/v1/responses``,
    ``/v1/chat/completions/batch``, ``/inference/v1/generate``); else None. ``path``: the
    request's URL path; ``body``: its raw bytes (parsed only if they mention a selection; UTF-16
    and UTF-32 bodies too)."""
    data = _selection_body(body)
    if data is None:
        return None
    xargs = data.get("vllm_xargs")
    if BODY_FIELD in data:
        field = BODY_FIELD
    elif isinstance(xargs, dict) and CONFIG_KEY in xargs:
        field = f"vllm_xargs.{CONFIG_KEY}"
    else:  # e.g. /inference/v1/generate's sampling_params.extra_args.xmix
        field = next(_selection_paths(data), None)
        if field is None:
            return None
    route = path if len(path) <= _MAX_ECHO else path[:_MAX_ECHO] + "..."
    return (f"{field}: apps apply on {' and '.join(SELECTION_ROUTES)} only; {route} would not apply them "
            "or return their read values: send the request to one of those routes")


def xargs_type_error(data: dict) -> str | None:
    """For a request to one of :data:`SELECTION_ROUTES`: the error message if the
    ``vllm_xargs.xmix`` of its JSON body ``data`` has a type vLLM's ``vllm_xargs`` does not take
    (an object, or a list holding objects or lists: its values are strings, numbers and lists of
    those), which vLLM would refuse with its request model's validation dump; else None."""
    xargs = data.get("vllm_xargs")
    sel = xargs.get(CONFIG_KEY) if isinstance(xargs, dict) else None
    if isinstance(sel, bool):  # (vLLM's request model would pass it on as the number 1 or 0)
        return (f"vllm_xargs.{CONFIG_KEY}: expected a list of apps (app names, or the selection list as JSON "
                f"text), got bool {json.dumps(sel)}")
    flat = (str, int, float)
    if sel is None or isinstance(sel, flat) or (isinstance(sel, list) and all(isinstance(x, flat) for x in sel)):
        return None
    got = "an object" if isinstance(sel, dict) else "a list holding objects or lists"
    return (f"vllm_xargs.{CONFIG_KEY}: got {got}, but vLLM's vllm_xargs values are strings, numbers and "
            f"lists of those: send app names, the selection list as JSON text (json.dumps of it), or a "
            f"top-level \"{BODY_FIELD}\" field, which takes objects")
