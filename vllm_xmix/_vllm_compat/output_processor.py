"""Output processor (front end). ``OutputProcessor.add_request`` is wrapped so that the state of
each request that selects apps remembers the app versions it runs (:func:`live_versions`: which
versions requests in flight still use, so an app change on a running server never reuses their
entries) and, if its apps may return values (``input_processor.READS_ATTR``), is switched to a
subclass of vLLM's ``RequestState`` (:func:`_apps_class`; requests without apps or with
write-only apps keep vLLM's class and run its ``make_request_output`` unchanged), whose
``make_request_output`` assembles the request's read values per position
(:mod:`vllm_xmix.results`) and sets them as ``RequestOutput.mi_results``; the final values also go
into the response's ``kv_transfer_params["xmix_results"]`` (JSON), which the OpenAI server
returns. ``RequestOutput.add`` (how vLLM's ``RequestOutputCollector`` merges the outputs a slow
consumer has not taken yet into one) is wrapped so that the merged output carries the values of
the newest output merged in."""

from __future__ import annotations

import functools

from vllm.outputs import RequestOutput

from ..results import ReadResults, ResultsView
from ..spec import CONFIG_KEY
from .core import mark
from .input_processor import READS_ATTR
from .scheduler import TRIGGERS_KEY


_VERSIONS_ATTR = "_xmix_versions"


def live_versions(output_processor) -> list[list]:
    """``[app, version]`` of every app version (0: the deployment's own) that an unfinished request of
    this front end runs (its state lives from when it is added until its final output or abort)."""
    out = set()
    for st in list(output_processor.request_states.values()):
        out.update(st.__dict__.get(_VERSIONS_ATTR, ()))
    return [list(x) for x in sorted(out)]


#: per vLLM ``RequestState`` class: its subclass for requests that select apps (see :func:`_apps_class`)
_APPS_CLASSES: dict[type, type] = {}


def _apps_class(base: type) -> type:
    """The subclass of ``base`` (vLLM's ``RequestState``) that a request's state is switched to
    when the request selects apps: its ``make_request_output`` assembles the read values (a
    class, not a method bound on the instance, which would make every such state a reference
    cycle that only the garbage collector frees)."""
    cls = _APPS_CLASSES.get(base)
    if cls is None:
        cls = _APPS_CLASSES[base] = type(f"Apps{base.__name__}", (_AppsRequestOutputs, base),
                                         {"_xmix_base_output": base.make_request_output})
    return cls


class _AppsRequestOutputs:
    """``make_request_output`` of a request with apps: the read values that came with this
    output (``kv_transfer_params``) kept per request (:class:`vllm_xmix.results.ReadResults`),
    the output's view of them set (``RequestOutput.mi_results``, a :class:`ResultsView`), and on
    the final output the values as JSON in ``kv_transfer_params["xmix_results"]``; then vLLM's
    own method (``_xmix_base_output``, the base class's, set by :func:`_apps_class`). This runs
    for every output of such a request on the front end's event loop: it makes as few calls as
    it can."""

    _xmix_reads: ReadResults | None = None  # the request's values, from its first output with any
    _xmix_base_output = None

    def make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason,
                            kv_transfer_params=None, *args, **kwargs):
        acc = self._xmix_reads
        if kv_transfer_params and (CONFIG_KEY in kv_transfer_params or TRIGGERS_KEY in kv_transfer_params):
            if acc is None:
                n_prompt = (len(self.prompt_token_ids) if self.prompt_token_ids is not None
                            else len(self.prompt_embeds))
                acc = self._xmix_reads = ReadResults(n_prompt)
            if CONFIG_KEY in kv_transfer_params:
                acc.add(kv_transfer_params[CONFIG_KEY])
            if TRIGGERS_KEY in kv_transfer_params:
                acc.add_triggers(kv_transfer_params[TRIGGERS_KEY])
            kv_transfer_params = (None if len(kv_transfer_params) == 1 else  # (only ours: the common case)
                                  {k: v for k, v in kv_transfer_params.items()
                                   if k not in (CONFIG_KEY, TRIGGERS_KEY)} or None)
        n_gen = None
        if acc is not None and finish_reason is not None:
            det = getattr(self, "detokenizer", None)
            n_gen = det.num_output_tokens() if det is not None else None
            # the OpenAI server returns kv_transfer_params in its (non-streaming) responses:
            # the final values go there too, as JSON ("xmix_results")
            kv_transfer_params = {**(kv_transfer_params or {}),
                                  "xmix_results": acc.final_json(n_gen)}
        out = self._xmix_base_output(new_token_ids, pooling_output, finish_reason, stop_reason,
                                     kv_transfer_params, *args, **kwargs)
        if acc is not None and out is not None and (out.__class__ is RequestOutput or isinstance(out, RequestOutput)):
            out._xmix_view = _new_view(ResultsView, (acc, acc.n_chunks, n_gen))
        return out


#: ``ResultsView((acc, upto, n_generated))`` without the type call's detour
_new_view = tuple.__new__


def patch_output_processor() -> None:
    from vllm.v1.engine.output_processor import OutputProcessor

    def wrap_add(orig):
        @functools.wraps(orig)
        def add_request(self, request, *args, **kwargs):
            out = orig(self, request, *args, **kwargs)
            sp = getattr(request, "sampling_params", None)
            sel = (getattr(sp, "extra_args", None) or {}).get(CONFIG_KEY) if sp is not None else None
            st = self.request_states.get(request.request_id)
            if sel is None or st is None:
                return out
            if isinstance(sel, dict):  # the canonical form (InputProcessor.process_inputs)
                vs = tuple((a["name"], a.get("version", 0)) for a in sel.get("apps", ()))
                if vs:
                    st.__dict__[_VERSIONS_ATTR] = vs
                has_apps = bool(vs)
            else:  # (every request that entered through the engine is canonical: input_processor)
                has_apps = bool(sel)
            # only a request whose apps may return values needs the subclass (a request with
            # write-only apps gets vLLM's make_request_output for every output)
            if has_apps and not isinstance(st, _AppsRequestOutputs) and getattr(sp, READS_ATTR, True):
                st.__class__ = _apps_class(type(st))
            return out

        return add_request

    mark("OutputProcessor.add_request", OutputProcessor, "add_request", wrap_add)

    # (a class default, so that the per-token paths read the view as a plain attribute)
    if "_xmix_view" not in RequestOutput.__dict__:
        RequestOutput._xmix_view = None
    if not isinstance(getattr(RequestOutput, "mi_results", None), property):
        def mi_results(self):
            """Read results of this request (``{app: {read: array}}``, see vllm_xmix.results), or
            None for a request without reads; assembled on first access and kept (for this
            output's view: a merge of outputs brings a newer one)."""
            view = self._xmix_view
            if view is None:
                return None
            kept = self.__dict__.get("_xmix_value")
            if kept is None or kept[0] is not view:
                kept = self.__dict__["_xmix_value"] = (view, view.get())
            return kept[1]

        RequestOutput.mi_results = property(mi_results)

    def wrap_add(orig):
        @functools.wraps(orig)
        def add(self, next_output, *args, **kwargs):
            orig(self, next_output, *args, **kwargs)
            view = next_output._xmix_view
            if view is not None:  # the newer output's view: all chunks up to it, its token count
                self._xmix_view = view

        return add

    mark("RequestOutput.add", RequestOutput, "add", wrap_add)
