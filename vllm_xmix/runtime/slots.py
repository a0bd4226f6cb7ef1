"""The request registry: which request with an app on holds which slot (a row of ``coef``), kept
in step with vLLM's scheduler output (new, finished, preempted and resumed requests).

A request gets its coefficient row ``[n_entries]`` float32 when it is scheduled for the first
time, and a slot when it is first in a step (:meth:`SlotRegistry.slot_for`); the row is uploaded
by the step fill (``pending_rows``). Preempted requests keep their slot (its condition state) until
the slots run out. App-free requests have no row and share the null slot 0.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import numpy as np

from ..spec import CONFIG_KEY, XmixSpecError, parse_request_apps
from .conditions import CK_TOKENS, CK_TOKENS_PREV
from .layout import DeviceLayout
from .variants import GraphVariants

logger = logging.getLogger("vllm.xmix")

NULL_SLOT = 0


@dataclass(frozen=True)
class _Selection:
    """One distinct app selection's registration data: the coefficient ``row`` ``[n_entries]``
    float32 (read-only), its fused writes' coefficients ``fc`` ``[n_fused]`` (None without fused
    entries), the variant ``masks`` (eager, compiled) it needs, whether a token condition of it is
    on (``tok_cond``: its prompt is staged), and its returned reads' infos."""

    row: np.ndarray
    fc: np.ndarray | None
    masks: tuple[int, int]
    tok_cond: bool
    reads: tuple
#: distinct selections whose coefficient rows are kept (most deployments see a handful)
_ROW_CACHE = 4096


class SlotRegistry:
    """Requests -> slots and their coefficient rows (see the module docstring).

    ``req_rows[rid]``: the request's row; ``req_slot[rid]``: its slot; ``free_slots``: slots
    1 .. max_slots-1 not held; ``pending_rows``: ``(slot, row, prompt length, prompt ids or
    None)`` to upload before the next forward; ``req_reads[rid]``: ``(read infos, prompt
    length)`` of its returned reads; ``req_fc[rid]``: its coefficients of the fused writes;
    ``step_pos[rid]``: absolute position of its first token in the current step (kept while a
    request with reads or conditions is registered; app-free requests in the step too);
    ``slot_fc``: per slot its fused writes' coefficients (slot 0 and free slots zeros)."""

    def __init__(self, layout: DeviceLayout, variants: GraphVariants) -> None:
        self.layout, self.variants = layout, variants
        self.max_slots = layout.max_slots
        self.req_rows: dict[str, np.ndarray] = {}
        self.req_slot: dict[str, int] = {}
        self.free_slots = list(range(layout.max_slots - 1, 0, -1))
        self.pending_rows: list[tuple] = []
        self.req_reads: dict[str, tuple[tuple, int]] = {}
        self.req_fc: dict[str, np.ndarray] = {}
        self.req_plen: dict[str, int] = {}
        self.req_prompt: dict[str, np.ndarray] = {}  # int32 prompt ids (token conditions only)
        self.preempted: dict[str, None] = {}  # preempted requests keep their slot (and its state)
        self.step_pos: dict[str, int] = {}
        # entries gated on token ids: only requests with one of them on need their prompt staged
        self._tok_cond = np.array([e.ckind in (CK_TOKENS, CK_TOKENS_PREV) for e in layout.entries], dtype=bool)
        self._rows: dict[str | tuple, _Selection | None] = {}
        #: per slot, the coefficients of the fused writes (``[max_slots, n_fused]`` float32, slot 0
        #: zeros): the step fill gathers each token's ``tok_fc`` row from it by its slot
        self.slot_fc = np.zeros((layout.max_slots, max(1, len(layout.fused_entries))), dtype=np.float32)

    def request_row(self, extra_args: dict | None) -> np.ndarray | None:
        """Coefficient row ``[n_entries]`` float32 (read-only, shared by requests with the same
        selection) for a request's ``SamplingParams.extra_args``, or None if no app is on.

        Raises:
            XmixSpecError: an unknown app or a malformed selection (the front end validates
            requests first, so this is a second line of defence)."""
        sel = self._selection(extra_args)
        return sel.row if sel is not None else None

    def _selection(self, extra_args: dict | None) -> _Selection | None:
        """What registering a request with these ``extra_args`` needs, built once per distinct
        selection (a new request is on the host path of a prefill step, which in vLLM's
        piecewise-graph mode waits for the host): keyed by the JSON text the front end wrote, or
        by the canonical JSON of a selection given as objects. None if no app is on. Raises as :meth:`request_row`."""
        if not extra_args or CONFIG_KEY not in extra_args:
            return None
        raw = extra_args[CONFIG_KEY]
        if type(raw) is str:  # the front end's JSON text: its own key (a tuple: no clash with the canonical form)
            key = ("text", raw)
        else:
            try:
                key = json.dumps(raw, sort_keys=True, separators=(",", ":"))
            except (TypeError, ValueError):  # not JSON-shaped: parsed (and refused) below, never cached
                key = None
        if key is not None and key in self._rows:
            return self._rows[key]
        row = self._build_row(raw)
        sel = None
        if row is not None:
            lay = self.layout
            reads = np.flatnonzero(lay.returned_mask & (row != 0)).tolist()
            sel = _Selection(row=row,
                             fc=row[lay.fused_entries] if lay.fused_entries.size else None,
                             masks=self.variants.row_masks(row),
                             tok_cond=bool(lay.conditions.has_token_cond and (row[self._tok_cond] != 0).any()),
                             reads=tuple(lay.read_info[e] for e in reads))
        if key is not None:
            if len(self._rows) >= _ROW_CACHE:
                self._rows.clear()
            self._rows[key] = sel
        return sel

    def _build_row(self, raw) -> np.ndarray | None:
        apps = parse_request_apps(raw, field="extra_args.xmix")
        if not apps:
            return None
        lay = self.layout
        row = np.zeros(lay.coef.shape[1], dtype=np.float32)
        for ra in apps:
            idxs = lay.version_entries.get((ra.name, ra.version or 0))
            if idxs is None:
                raise XmixSpecError(f"extra_args.xmix: unknown app {ra.name!r}"
                                    + (f" version {ra.version}" if ra.version else ""))
            layers = set(ra.layers) if ra.layers is not None else None
            for e_idx in idxs:
                e = lay.entries[e_idx]
                if layers is not None and e.layer not in layers and e.returned:
                    continue  # (condition reads stay on: the app's conditional writes need them)
                if e.is_read:  # a read's coefficient is its on/off gate (scale 0 = app off)
                    row[e_idx] = 0.0 if ra.scale == 0 else 1.0
                else:
                    row[e_idx] = e.default_scale if ra.scale is None else ra.scale
        if not row.any():
            return None
        row.flags.writeable = False
        return row

    def forget_rows(self) -> None:
        """Drop the cached coefficient rows (after an app version was placed or released: a
        selection's row names the entries of its versions)."""
        self._rows.clear()

    def update_requests(self, scheduler_output) -> None:
        """Registry update from a ``SchedulerOutput`` (called before the model runner's own
        update): forget finished and aborted requests, keep preempted ones, register new ones,
        and note where each tracked request's tokens start in this step."""
        cond = self.layout.conditions
        for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():  # finished or aborted
            self.forget(rid)
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if rid in self.req_slot:  # keep the row and the slot (its device state): the request comes back
                self.preempted[rid] = None
        for nr in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            sp = getattr(nr, "sampling_params", None)
            sel = self._selection(sp.extra_args if sp is not None else None)
            rid = nr.req_id
            self.forget(rid)
            if sel is not None:
                self.req_rows[rid] = sel.row
                if sel.fc is not None:
                    self.req_fc[rid] = sel.fc
                self.variants.add_request(rid, sel.row, sel.masks)
                P = len(nr.prompt_token_ids) if nr.prompt_token_ids is not None else len(nr.prompt_embeds)
                self.req_plen[rid] = P
                if sel.tok_cond and nr.prompt_token_ids is not None:
                    self.req_prompt[rid] = np.asarray(nr.prompt_token_ids, dtype=np.int32)
                if sel.reads:
                    self.req_reads[rid] = (sel.reads, P)
        # absolute position of the first scheduled token of each request with apps (alignment of
        # reads and conditions: chunked prefill, recompute and async scheduling come through here)
        self.step_pos = {}
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if self.preempted and cached is not None:  # scheduled again: no longer a victim for its slot
            for rid in cached.req_ids:
                self.preempted.pop(rid, None)
        track = self.req_reads if not cond.has_cond else self.req_rows
        if track:
            for nr in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
                if nr.req_id in track:
                    self.step_pos[nr.req_id] = int(nr.num_computed_tokens)
            if cached is not None:  # (app-free requests too: one C-level update, their positions unused)
                self.step_pos.update(zip(cached.req_ids, cached.num_computed_tokens))

    def forget(self, rid: str) -> None:
        """Drop request ``rid`` (finished, aborted, or registered again) and free its slot."""
        if self.req_rows.pop(rid, None) is None:
            return  # no app on: every other table here holds requests with a row only
        self.req_fc.pop(rid, None)
        self.variants.forget_request(rid)
        self.req_reads.pop(rid, None)
        self.req_plen.pop(rid, None)
        self.req_prompt.pop(rid, None)
        self.preempted.pop(rid, None)
        self._free(rid)

    def _free(self, rid: str) -> None:
        s = self.req_slot.pop(rid, None)
        if s is not None:
            self.slot_fc[s] = 0.0
            self.free_slots.append(s)

    def slot_for(self, rid: str) -> int:
        """The slot of request ``rid`` (:data:`NULL_SLOT` if it has no app on), taking a free one
        the first time (its row is then queued for upload).

        Raises:
            RuntimeError: no slot is free and no preempted request can give up its own."""
        row = self.req_rows.get(rid)
        if row is None:
            return NULL_SLOT
        s = self.req_slot.get(rid)
        if s is None:
            if not self.free_slots and self.preempted:
                victim = next(iter(self.preempted))  # the longest-preempted request gives its slot
                logger.warning("vllm_xmix: out of request slots; request %s (preempted) loses its slot and "
                               "its condition state (token history, prompt values, latches)", victim)
                self.preempted.pop(victim)
                self._free(victim)
            if not self.free_slots:
                raise RuntimeError(
                    f"vllm_xmix: out of request slots ({self.max_slots - 1}); more requests with apps "
                    "are running than max_num_seqs allows"
                )
            s = self.free_slots.pop()
            self.req_slot[rid] = s
            fc = self.req_fc.get(rid)
            if fc is not None:
                self.slot_fc[s] = fc
            self.pending_rows.append((s, row, self.req_plen.get(rid, 0), self.req_prompt.get(rid)))
        return s
