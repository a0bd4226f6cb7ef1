"""Scheduler: ``Scheduler.update_from_output`` is wrapped so that read values, which arrive
with each step's ``ModelRunnerOutput``, are kept per request until the request's next
``EngineCoreOutput`` and travel in its ``kv_transfer_params["xmix"]`` to the front end; and
the scheduler's ``check_stop`` so that a probe's ``stop`` trigger ends a request where vLLM's
own stop checks do (``runtime.triggers``). The ``check_stop`` wrapper is installed only while a
request of this process has a fired stop trigger that has not yet ended it: vLLM calls
``check_stop`` per running request per step, so without a fired trigger every request runs vLLM's
own function."""

from __future__ import annotations

import functools
import weakref

from vllm.sampling_params import RequestOutputKind

from ..runtime.triggers import TriggerTable, stop_reason
from ..spec import CONFIG_KEY
from . import core
from .core import mark

#: kv_transfer_params key of a request's trigger records (front end: ``ReadResults.add_triggers``)
TRIGGERS_KEY = "xmix_triggers"
_NO_TABLE = object()

_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
#: schedulers of this process with a request whose stop trigger fired and which has not ended yet;
#: while there is one, ``scheduler.check_stop`` is the wrapper (``patch_scheduler``)
_STOPPING: "weakref.WeakSet" = weakref.WeakSet()


def _final_only(request) -> bool:
    """Whether the request's read values can wait in the engine core for its final output: the
    front end turns only that output into a ``RequestOutput``
    (``RequestOutputKind.FINAL_ONLY``: offline ``generate`` and non-streaming server requests)
    and the engine core sends it. A request with stop strings is ended by the front end (its
    detokenizer matches them on an ordinary output, then aborts the request in the engine core,
    which sends no final output), so its values travel with every output instead."""
    sp = getattr(request, "sampling_params", None)
    return sp is not None and sp.output_kind == _FINAL_ONLY and not sp.stop


def patch_scheduler() -> None:
    """Read values of a step arrive with its ``ModelRunnerOutput``; a request gets an
    ``EngineCoreOutput`` only in steps that emit a token, so values of earlier prefill chunks wait
    here (per request) and go out with the next output, in ``kv_transfer_params["xmix"]``. A
    request whose outputs the front end only uses at the end (``FINAL_ONLY``) keeps its values
    here until its final output: no per-token transport and front-end work for them."""
    import vllm.v1.core.sched.scheduler as sched_mod
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    orig_check_stop = getattr(sched_mod.check_stop, "__wrapped__", sched_mod.check_stop)

    @functools.wraps(orig_check_stop)
    def check_stop(request, *args, **kwargs):
        if orig_check_stop(request, *args, **kwargs):
            return True
        reason = request.__dict__.get("_xmix_stop")
        if reason is None:
            return False
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = reason
        return True

    check_stop.__xmix_patched__ = True
    check_stop.__wrapped__ = orig_check_stop

    def set_check_stop() -> None:
        """vLLM's ``check_stop`` while no scheduler of this process has a request to stop, the
        wrapper otherwise (``_update_request_with_output`` looks the name up per call)."""
        sched_mod.check_stop = check_stop if len(_STOPPING) else orig_check_stop

    def track_stops(self) -> None:
        """Forget this scheduler's stopping requests that have ended (or left), then install or
        remove the wrapper."""
        ids = self.__dict__.get("_xmix_stopping")
        if ids:
            ids.intersection_update(self.requests)
        if not ids:
            _STOPPING.discard(self)
        set_check_stop()

    def triggers_of(self):
        tt = self.__dict__.get("_xmix_triggers", _NO_TABLE)
        if tt is _NO_TABLE:
            tt = self.__dict__["_xmix_triggers"] = TriggerTable.from_vllm_config(self.vllm_config)
        return tt

    def note_triggers(self, tt, reads) -> None:
        """Scan this step's values of triggered reads (before the step's tokens are appended):
        keep each read entry's first crossing on the request; a ``stop`` makes its next
        ``check_stop`` end it (the token sampled in this step is kept)."""
        for rid, chunks in reads.items():
            req = self.requests.get(rid)
            if req is None or not chunks:
                continue
            d = req.__dict__
            apps = {app for app, name, *_ in chunks if (app, name) in tt.by_read}
            if not apps:
                continue
            d.setdefault("_xmix_armed", set()).update(apps)
            self.__dict__.setdefault("_xmix_armed_ids", set()).add(rid)
            for ev in tt.scan(chunks):
                fired = d.setdefault("_xmix_fired", {})
                key = ev[:3]
                if key not in fired or ev[4] < fired[key][4]:
                    fired[key] = ev
                    d["_xmix_unsent"] = True
                if ev[3] == "stop" and d.get("_xmix_stop") is None:
                    d["_xmix_stop"] = stop_reason(ev[0], ev[1])
                    self.__dict__.setdefault("_xmix_stopping", set()).add(rid)
                    _STOPPING.add(self)
                    set_check_stop()

    def wrap(orig):
        @functools.wraps(orig)
        def update_from_output(self, scheduler_output, model_runner_output):
            reads = getattr(model_runner_output, "xmix_reads", None)
            pending = self.__dict__.setdefault("_xmix_pending", {})
            tt = triggers_of(self)
            if reads:
                if tt is not None:
                    note_triggers(self, tt, reads)
                # the step's own lists (reads_of makes one per request) join the waiting ones
                # whole; a request's values still waiting (an earlier prefill chunk's, or all of a
                # final-only request's) take this step's after them
                both = reads.keys() & pending.keys() if pending else ()
                if both:
                    reads = {**reads}
                    for rid in both:
                        pending[rid].extend(reads.pop(rid))
                pending.update(reads)
            # requests with a triggered read, looked up now (a finished one leaves self.requests)
            armed_ids = self.__dict__.get("_xmix_armed_ids")
            live = {rid: self.requests[rid] for rid in armed_ids if rid in self.requests} if armed_ids else {}
            outs = orig(self, scheduler_output, model_runner_output)
            if self in _STOPPING:
                track_stops(self)
            if armed_ids:
                armed_ids.intersection_update(self.requests)  # finished or aborted ones
            if live:
                for eco in outs.values():
                    for o in eco.outputs:
                        req = live.get(o.request_id)
                        if req is None:
                            continue
                        d = req.__dict__
                        if (o.finish_reason is not None or d.get("_xmix_unsent")):
                            if o.finish_reason is not None or not _final_only(req):
                                d["_xmix_unsent"] = False
                                o.kv_transfer_params = {**(o.kv_transfer_params or {}), TRIGGERS_KEY: {
                                    "apps": sorted(d["_xmix_armed"]),
                                    "events": sorted(d.get("_xmix_fired", {}).values(), key=lambda e: e[4])}}
            if pending:
                # (per request with values and step: one pop, one lookup; this runs for every
                # request with a read in every step)
                final_only = self.__dict__.setdefault("_xmix_final_only", {})
                for eco in outs.values():
                    for o in eco.outputs:
                        rid = o.request_id
                        chunks = pending.pop(rid, None)
                        if not chunks:
                            continue
                        if o.finish_reason is None:
                            fo = final_only.get(rid)
                            if fo is None:
                                fo = final_only[rid] = _final_only(self.requests.get(rid))
                            if fo:  # the front end uses the values at the end only: they go out then
                                pending[rid] = chunks
                                continue
                        else:
                            final_only.pop(rid, None)
                        kv = o.kv_transfer_params
                        o.kv_transfer_params = {CONFIG_KEY: chunks} if kv is None else {**kv, CONFIG_KEY: chunks}
                if pending:
                    for rid in [r for r in pending if r not in self.requests]:
                        del pending[rid]  # finished or aborted without a further output
                if len(final_only) > 2 * len(self.requests) + 64:  # (finished and aborted ones)
                    for rid in [r for r in final_only if r not in self.requests]:
                        del final_only[rid]
            return outs

        return update_from_output

    mark("Scheduler.update_from_output", Scheduler, "update_from_output", wrap)
    core.record("scheduler.check_stop (while a stop trigger is pending)")
