"""Input processor: ``InputProcessor.process_inputs`` is wrapped so that a request's app
selection is checked when the request is added (:func:`vllm_xmix.validation.validate_request`:
a ``ValueError`` naming the request and the field, HTTP 400 on the server), written in canonical
form (the engine request's ``SamplingParams`` clone keeps no ``mi_apps`` spelling beside it),
and a steered request gets a ``cache_salt`` derived from its apps (steered prefill KV must
not be shared with unsteered requests through the prefix cache)."""

from __future__ import annotations

import functools

from ..spec import CONFIG_KEY, XmixSpecError
from ..validation import validate_request
from .core import mark


def patch_input_processor() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    def wrap(orig):
        @functools.wraps(orig)
        def process_inputs(self, request_id, prompt, params, *args, **kwargs):
            try:
                wire, salt = validate_request(self.vllm_config, params)
            except XmixSpecError as e:  # which request of a batch was refused
                raise XmixSpecError(f"request {request_id}: {e}") from None
            req = orig(self, request_id, prompt, params, *args, **kwargs)
            if wire is not None and req.sampling_params is not None:
                ea = dict(req.sampling_params.extra_args or {})
                ea[CONFIG_KEY] = wire
                req.sampling_params.extra_args = ea
                # the canonical selection (with the app versions) is now the only one: a
                # vllm_xmix.SamplingParams unpickled in a worker (the scheduler output goes to
                # the workers of a multiprocess executor by pickle, e.g. with tensor
                # parallelism) would otherwise derive a selection from its mi_apps spelling again
                # and refuse the stamped one as a second selection
                if getattr(req.sampling_params, "mi_apps", None) is not None:
                    req.sampling_params.mi_apps = None
                if salt is not None:
                    req.cache_salt = f"{req.cache_salt}|{salt}" if req.cache_salt else salt
            return req

        return process_inputs

    mark("InputProcessor.process_inputs", InputProcessor, "process_inputs", wrap)
