"""Scheduler: ``Scheduler.update_from_output`` is wrapped so that read values, which arrive
with each step's ``ModelRunnerOutput``, are kept per request until the request's next
``EngineCoreOutput`` and travel in its ``kv_transfer_params["xmix"]`` to the front end."""

from __future__ import annotations

import functools

from ..spec import CONFIG_KEY
from .core import mark


def patch_scheduler() -> None:
    """Read values of a step arrive with its ``ModelRunnerOutput``; a request gets an
    ``EngineCoreOutput`` only in steps that emit a token, so values of earlier prefill chunks wait
    here (per request) and go out with the next output, in ``kv_transfer_params["xmix"]``."""
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
                        chunks = pending.pop(o.request_id, None)
                        if chunks:
                            o.kv_transfer_params = {**(o.kv_transfer_params or {}), CONFIG_KEY: chunks}
                for rid in [r for r in pending if r not in self.requests]:
                    del pending[rid]  # finished or aborted without a further output
            return outs

        return update_from_output

    mark("Scheduler.update_from_output", Scheduler, "update_from_output", wrap)
