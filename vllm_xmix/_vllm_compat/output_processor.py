"""Output processor (front end): ``RequestState.make_request_output`` is wrapped so that the
read values of a request are assembled per position (:mod:`vllm_xmix.results`) and set as
``RequestOutput.mi_results``; the final values also go into the response's
``kv_transfer_params["xmix_results"]`` (JSON), which the OpenAI server returns.
``RequestOutput.add`` (how vLLM's ``RequestOutputCollector`` merges the outputs a slow consumer
has not taken yet into one) is wrapped so that the merged output carries the values of the
newest output merged in."""

from __future__ import annotations

import functools

from ..spec import CONFIG_KEY
from .core import mark
from .scheduler import TRIGGERS_KEY


def patch_output_processor() -> None:
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.output_processor import RequestState

    from ..results import ReadResults, to_json

    if not isinstance(getattr(RequestOutput, "mi_results", None), property):
        def mi_results(self):
            """Read results of this request (``{app: {read: array}}``, see vllm_xmix.results), or
            None for a request without reads."""
            view = self.__dict__.get("_xmix_view")
            return None if view is None else view.get()

        RequestOutput.mi_results = property(mi_results)

    def wrap(orig):
        @functools.wraps(orig)
        def make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason,
                                kv_transfer_params=None, *args, **kwargs):
            acc = self.__dict__.get("_xmix_reads")
            if kv_transfer_params and (CONFIG_KEY in kv_transfer_params or TRIGGERS_KEY in kv_transfer_params):
                if acc is None:
                    n_prompt = (len(self.prompt_token_ids) if self.prompt_token_ids is not None
                                else len(self.prompt_embeds))
                    acc = self.__dict__["_xmix_reads"] = ReadResults(n_prompt)
                if CONFIG_KEY in kv_transfer_params:
                    acc.add(kv_transfer_params[CONFIG_KEY])
                if TRIGGERS_KEY in kv_transfer_params:
                    acc.add_triggers(kv_transfer_params[TRIGGERS_KEY])
                kv_transfer_params = {k: v for k, v in kv_transfer_params.items()
                                      if k not in (CONFIG_KEY, TRIGGERS_KEY)} or None
            n_gen = None
            if acc is not None and finish_reason is not None:
                det = getattr(self, "detokenizer", None)
                n_gen = det.num_output_tokens() if det is not None else None
                # the OpenAI server returns kv_transfer_params in its (non-streaming) responses:
                # the final values go there too, as JSON ("xmix_results")
                kv_transfer_params = {**(kv_transfer_params or {}),
                                      "xmix_results": to_json(acc.assemble(n_generated=n_gen))}
            out = orig(self, new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params,
                       *args, **kwargs)
            if acc is not None and isinstance(out, RequestOutput):
                out.__dict__["_xmix_view"] = acc.view(n_generated=n_gen)
            return out

        return make_request_output

    mark("RequestState.make_request_output", RequestState, "make_request_output", wrap)

    def wrap_add(orig):
        @functools.wraps(orig)
        def add(self, next_output, *args, **kwargs):
            orig(self, next_output, *args, **kwargs)
            view = next_output.__dict__.get("_xmix_view")
            if view is not None:  # the newer output's view: all chunks up to it, its token count
                self.__dict__["_xmix_view"] = view

        return add

    mark("RequestOutput.add", RequestOutput, "add", wrap_add)
