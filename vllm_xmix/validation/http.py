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

from ..spec import CONFIG_KEY, XmixSpecError
from .requests import _deployment_of, validate_selection

BODY_FIELD = "mi_apps"


def _looks_like_selection(key: str) -> bool:
    k = key.lower().replace("-", "_")
    return bool(difflib.get_close_matches(k.replace("_", ""), ["miapps", "xmix"], n=1, cutoff=0.7)) or \
        k in ("apps", "mi_app", "xmix_apps")


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
        if _looks_like_selection(key):
            return (f"{key}: unknown request field; apps are selected with \"{BODY_FIELD}\" "
                    f"(or vllm_xargs.{CONFIG_KEY})"), "", None
    for key in xargs:
        if key != CONFIG_KEY and _looks_like_selection(key):
            return (f"vllm_xargs.{key}: unknown key; apps are selected with vllm_xargs.{CONFIG_KEY} "
                    f"or a top-level \"{BODY_FIELD}\" field"), "", None
    if BODY_FIELD in extra:
        if CONFIG_KEY in xargs:
            return f"{BODY_FIELD} and vllm_xargs.{CONFIG_KEY} both select apps: give the selection once", "", None
        sel = extra.pop(BODY_FIELD)
        if sel is None:
            return None, BODY_FIELD, None
        request.vllm_xargs = {**xargs, CONFIG_KEY: json.dumps(sel)}
        return None, BODY_FIELD, sel
    return None, f"vllm_xargs.{CONFIG_KEY}", xargs.get(CONFIG_KEY)


def _n_prompts(prompt) -> int:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def http_precheck(serving, request, n_prompts: int = 1) -> str | None:
    """Checks of a request's ``vllm_xargs["xmix"]`` before the OpenAI server starts answering (so
    a bad selection is an HTTP 400 also for streaming requests, whose status is sent before the
    engine sees the request; a top-level ``mi_apps`` is moved into ``vllm_xargs`` first,
    :func:`take_body_selection`). Returns the error message or None."""
    err, field, sent = take_body_selection(request)
    if err is not None:
        return err
    xargs = getattr(request, "vllm_xargs", None) or {}
    if CONFIG_KEY not in xargs:
        return None
    vllm_config = getattr(getattr(serving, "engine_client", None), "vllm_config", None)
    try:
        if vllm_config is None:
            return None  # the engine checks it when the request is added
        wire, _ = validate_selection(vllm_config, sent, getattr(request, "n", 1) or 1, field=field)
        if not wire or not wire["apps"]:
            return None
        if getattr(request, "use_beam_search", False):
            raise XmixSpecError(f"{field}: beam search builds its own sampling requests, which "
                                "would run without the apps; not supported with vllm-xmix apps")
        dep, _ = _deployment_of(vllm_config)
        reads = [a["name"] for a in wire["apps"] if dep.app(a["name"]).has_reads and a.get("scale") != 0]
        if reads and n_prompts > 1:
            raise XmixSpecError(f"{field}: apps {reads} have reads, but a completions request with "
                                f"{n_prompts} prompts returns one kv_transfer_params for all of them; send one "
                                "prompt per request")
    except XmixSpecError as e:
        return str(e)
    return None
