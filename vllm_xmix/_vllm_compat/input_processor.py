"""Where requests enter the engine: each request's app selection is checked
(:func:`vllm_xmix.validation.validate_request`: a ``ValueError`` naming the request and the
field, HTTP 400 on the server), written in canonical form (the engine request's
``SamplingParams`` clone keeps no ``mi_apps`` spelling beside it), and a steered request gets a
``cache_salt`` derived from its apps (steered prefill KV must not be shared with unsteered
requests through the prefix cache).

* ``InputProcessor.process_inputs``: every prompt a front end (``LLM``, the OpenAI server)
  turns into an ``EngineCoreRequest``;
* ``LLMEngine.add_request`` / ``AsyncLLM.add_request`` given an ``EngineCoreRequest`` (a path
  vLLM deprecates, which skips ``process_inputs``): the same check, canonical form and salt
  (:func:`check_engine_request`), before the request reaches the output processor or the
  engine core, so a malformed selection is refused there and never reaches the workers."""

from __future__ import annotations

import functools

from ..spec import CONFIG_KEY, XmixSpecError
from ..validation import validate_request
from ..validation.requests import READ_SALT, selection_reads, validate_selection
from .core import mark


#: attribute of an engine request's ``SamplingParams`` (front end only: not a msgspec field, so
#: never sent to the engine core) saying whether its apps may return values; read by the output
#: processor's ``add_request`` (absent: they may)
READS_ATTR = "_xmix_reads"


def stamp(req, wire, salt, reads: bool) -> None:
    """Write the checked selection ``wire`` (canonical dict) into ``req.sampling_params`` and add
    ``salt`` (or None) to ``req.cache_salt`` once (an ``EngineCoreRequest``, in place); ``reads``:
    whether the selection has a read on (:data:`READS_ATTR`)."""
    if wire is None or req.sampling_params is None:
        return
    try:
        setattr(req.sampling_params, READS_ATTR, bool(reads))
    except AttributeError:  # (a SamplingParams without a __dict__: the output processor assumes reads)
        pass
    # the canonical selection (with the app versions) is to be the only one: a
    # vllm_xmix.SamplingParams unpickled in a worker (the scheduler output goes to
    # the workers of a multiprocess executor by pickle, e.g. with tensor
    # parallelism) would otherwise derive a selection from its mi_apps spelling again
    # and refuse the stamped one as a second selection (cleared first: clearing
    # mi_apps takes the selection it made out of extra_args)
    if getattr(req.sampling_params, "mi_apps", None) is not None:
        req.sampling_params.mi_apps = None
    ea = dict(req.sampling_params.extra_args or {})
    ea[CONFIG_KEY] = wire
    req.sampling_params.extra_args = ea
    if salt is None:
        return
    parts = (req.cache_salt or "").split("|")
    # (a read's salt is new per check, uuid4: a request that has one keeps it)
    has = salt in parts or (READ_SALT in salt and any(READ_SALT in p and p.startswith("xmix") for p in parts))
    if not has:
        req.cache_salt = f"{req.cache_salt}|{salt}" if req.cache_salt else salt


def check_engine_request(vllm_config, req) -> None:
    """Check the selection of an ``EngineCoreRequest`` passed to ``add_request`` directly, and
    write its canonical form and cache salt (:func:`stamp`), in place. A request that came out of
    ``process_inputs`` is already canonical: its app versions (which the front end writes and
    users may not) are taken out and written again as they are now, so checking it twice changes
    nothing else (its salt included). The request's ``SamplingParams`` is replaced by a clone
    before it is written: the caller's own object (which it may pass again) keeps its spelling.

    Raises:
        XmixSpecError (a ValueError): ``request <id>: extra_args.xmix...``, naming the field."""
    sp = getattr(req, "sampling_params", None)
    ea = getattr(sp, "extra_args", None) if sp is not None else None
    if not ea or CONFIG_KEY not in ea:
        return
    raw = ea[CONFIG_KEY]
    if isinstance(raw, dict) and isinstance(raw.get("apps"), list):
        raw = {**raw, "apps": [{k: v for k, v in a.items() if k != "version"} if isinstance(a, dict) else a
                               for a in raw["apps"]]}
    try:
        wire, salt = validate_selection(vllm_config, raw, getattr(sp, "n", 1), field="extra_args.xmix")
    except XmixSpecError as e:
        raise XmixSpecError(f"request {req.request_id}: {e}") from None
    req.sampling_params = sp.clone()
    stamp(req, wire, salt, bool(selection_reads(vllm_config, wire)))


def patch_input_processor() -> None:
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.llm_engine import LLMEngine

    def wrap(orig):
        @functools.wraps(orig)
        def process_inputs(self, request_id, prompt, params, *args, **kwargs):
            try:
                wire, salt = validate_request(self.vllm_config, params)
            except XmixSpecError as e:  # which request of a batch was refused
                raise XmixSpecError(f"request {request_id}: {e}") from None
            req = orig(self, request_id, prompt, params, *args, **kwargs)
            stamp(req, wire, salt, bool(selection_reads(self.vllm_config, wire)))
            return req

        return process_inputs

    def wrap_add(orig):
        @functools.wraps(orig)
        def add_request(self, request_id, prompt, *args, **kwargs):
            if isinstance(prompt, EngineCoreRequest):
                check_engine_request(self.vllm_config, prompt)
            return orig(self, request_id, prompt, *args, **kwargs)

        return add_request

    def wrap_add_async(orig):
        @functools.wraps(orig)
        async def add_request(self, request_id, prompt, *args, **kwargs):
            if isinstance(prompt, EngineCoreRequest):
                check_engine_request(self.vllm_config, prompt)
            return await orig(self, request_id, prompt, *args, **kwargs)

        return add_request

    mark("InputProcessor.process_inputs", InputProcessor, "process_inputs", wrap)
    mark("LLMEngine.add_request (EngineCoreRequest)", LLMEngine, "add_request", wrap_add)
    mark("AsyncLLM.add_request (EngineCoreRequest)", AsyncLLM, "add_request", wrap_add_async)
