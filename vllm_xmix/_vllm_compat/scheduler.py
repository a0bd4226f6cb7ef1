"""Scheduler: ``Scheduler.update_from_output`` is wrapped so that read values, which arrive
with each step's ``ModelRunnerOutput``, are kept per request until the request's next
``EngineCoreOutput`` and travel in its ``kv_transfer_params["xmix"]`` to the front end."""

from __future__ import annotations

import functools

from vllm.sampling_params import RequestOutputKind

from ..spec import CONFIG_KEY
from .core import mark

_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def _final_only(request) -> bool:
    """Whether the front end turns only the request's final output into a ``RequestOutput``
    (``RequestOutputKind.FINAL_ONLY``: offline ``generate`` and non-streaming server requests)."""
    sp = getattr(request, "sampling_params", None)
    return sp is not None and sp.output_kind == _FINAL_ONLY


def patch_scheduler() -> None:
    """Read values of a step arrive with its ``ModelRunnerOutput``; a request gets an
    ``EngineCoreOutput`` only in steps that emit a token, so values of earlier prefill chunks wait
    here (per request) and go out with the next output, in ``kv_transfer_params["xmix"]``. A
    request whose outputs the front end only uses at the end (``FINAL_ONLY``) keeps its values
    here until its final output: no per-token transport and front-end work for them."""
    from vllm.v1.core.sched.scheduler import Scheduler

    def wrap(orig):
        @functools.wraps(orig)
        def update_from_output(self, scheduler_output, model_runner_output):
            reads = getattr(model_runner_output, "xmix_reads", None)
            pending = self.__dict__.setdefault("_xmix_pending", {})
            if reads:
                for rid, chunks in reads.items():
                    if chunks:
                        pending.setdefault(rid, []).extend(chunks)
            outs = orig(self, scheduler_output, model_runner_output)
            if pending:
                for eco in outs.values():
                    for o in eco.outputs:
                        chunks = pending.get(o.request_id)
                        if not chunks:
                            continue
                        if o.finish_reason is None and _final_only(self.requests.get(o.request_id)):
                            continue  # the front end uses the values at the end only: they go out then
                        del pending[o.request_id]
                        o.kv_transfer_params = {**(o.kv_transfer_params or {}), CONFIG_KEY: chunks}
                for rid in [r for r in pending if r not in self.requests]:
                    del pending[rid]  # finished or aborted without a further output
            return outs

        return update_from_output

    mark("Scheduler.update_from_output", Scheduler, "update_from_output", wrap)
