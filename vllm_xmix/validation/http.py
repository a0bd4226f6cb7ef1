"""Checks of an OpenAI-server request's ``vllm_xargs["xmix"]`` before the server starts
answering, so that a bad selection is an HTTP 400 also for streaming requests (whose status is
sent before the engine sees the request).
"""

from __future__ import annotations

from ..spec import CONFIG_KEY, XmixSpecError
from .requests import _deployment_of, validate_selection


def _n_prompts(prompt) -> int:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def http_precheck(serving, request, n_prompts: int = 1) -> str | None:
    """Checks of a request's ``vllm_xargs["xmix"]`` before the OpenAI server starts answering (so
    a bad selection is an HTTP 400 also for streaming requests, whose status is sent before the
    engine sees the request). Returns the error message or None."""
    xargs = getattr(request, "vllm_xargs", None) or {}
    if CONFIG_KEY not in xargs:
        return None
    vllm_config = getattr(getattr(serving, "engine_client", None), "vllm_config", None)
    try:
        if vllm_config is None:
            return None  # the engine checks it when the request is added
        wire, _ = validate_selection(vllm_config, xargs[CONFIG_KEY], getattr(request, "n", 1) or 1,
                                     field=f"vllm_xargs.{CONFIG_KEY}")
        if not wire or not wire["apps"]:
            return None
        if getattr(request, "use_beam_search", False):
            raise XmixSpecError(f"vllm_xargs.{CONFIG_KEY}: beam search builds its own sampling requests, which "
                                "would run without the apps; not supported with vllm-xmix apps")
        dep, _ = _deployment_of(vllm_config)
        reads = [a["name"] for a in wire["apps"] if dep.app(a["name"]).has_reads and a.get("scale") != 0]
        if reads and n_prompts > 1:
            raise XmixSpecError(f"vllm_xargs.{CONFIG_KEY}: apps {reads} have reads, but a completions request with "
                                f"{n_prompts} prompts returns one kv_transfer_params for all of them; send one "
                                "prompt per request")
    except XmixSpecError as e:
        return str(e)
    return None
