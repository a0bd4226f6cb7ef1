"""The per-step fill: before each forward, the device tables that say which request (slot) each
token of the step belongs to, and the coefficient rows of requests that got a slot this step.

Per step, on the forward's stream: ``tok_slot[:n]`` int32 (and with fused writes ``tok_fc[:n]``,
with conditions in the step's graph variant ``tok_pos[:n]``) is uploaded from a pinned staging ring, and the coefficient rows
of new slots with ``index_copy_`` (their latches, ``cond(latch=...)``, are reset to "never").
Nothing here reads device data back, so async scheduling keeps its overlap. The step's run mask (graph variant) is chosen here too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import torch

from .layout import DeviceLayout
from .reads import ReadTransport
from .slots import NULL_SLOT, SlotRegistry
from .variants import GraphVariants

logger = logging.getLogger("vllm.xmix")

#: pinned staging buffers for the per-step uploads, used in turn (a lap of RING steps): a buffer is
#: written again a lap after the copy that read it, which has run by then (vLLM's model runner
#: waits, before preparing a step's inputs, for the previous step's input copies: async
#: scheduling's ``prepare_inputs_event``, or the synchronous output); one CUDA event a lap checks it
RING = 8
#: the ring's pinned bytes above which it keeps to RING_MIN stages (a stage's fused-coefficient
#: buffer grows with max_num_batched_tokens x fused entries)
RING_BYTES = 64 << 20
RING_MIN = 4
#: new slots uploaded row by row (one host-to-device copy each, no allocation, no kernel); more
#: in one step go through one ``index_copy_``
_DIRECT_ROWS = 2


@dataclass
class _Stage:
    tok: torch.Tensor
    rows: torch.Tensor
    idx: torch.Tensor
    pos: torch.Tensor
    plen: torch.Tensor
    fc: torch.Tensor  # [max_tokens, n_fused] float32: the step's per-token fused coefficients
    prompts: torch.Tensor  # int32: prompt ids of the step's new slots (token conditions), grown on demand

    def __post_init__(self) -> None:  # numpy views of the pinned buffers, made once
        self.tok_np, self.rows_np, self.idx_np = self.tok.numpy(), self.rows.numpy(), self.idx.numpy()
        self.pos_np, self.plen_np, self.fc_np = self.pos.numpy(), self.plen.numpy(), self.fc.numpy()

    def nbytes(self) -> int:
        """The stage's bytes (pinned on a GPU)."""
        return sum(t.nbytes for t in (self.tok, self.rows, self.idx, self.pos, self.plen, self.fc, self.prompts))


def _new_stage(lay: DeviceLayout, pin: bool) -> _Stage:
    """One stage of the staging ring, sized for ``lay`` (pinned host memory where ``pin``)."""
    def buf(shape, dtype):
        return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pin)

    return _Stage(tok=buf(lay.max_tokens, torch.int32), rows=buf((lay.max_slots, lay.coef.shape[1]), torch.float32),
                  idx=buf(lay.max_slots, torch.int64), pos=buf(lay.max_tokens, torch.int32),
                  plen=buf(lay.max_slots, torch.int32), fc=buf(lay.tok_fc.shape, torch.float32),
                  prompts=buf(lay.max_tokens if lay.conditions.has_token_cond else 1, torch.int32))


class StepFill:
    """Fills the layout's per-step tables from the scheduler's batch (see the module docstring).

    ``forwards``: forwards filled so far; ``high_water``: tokens of the last step that had apps
    on (``tok_slot`` is zero beyond it); ``stage_waits``: times a fill had to wait for an earlier
    step's upload to finish."""

    def __init__(self, layout: DeviceLayout, slots: SlotRegistry, variants: GraphVariants,
                 reads: ReadTransport) -> None:
        self.layout, self.slots, self.variants, self.reads = layout, slots, variants, reads
        lay = layout
        pin = lay.device.type == "cuda"
        first = _new_stage(lay, pin)
        n_stages = RING if RING * first.nbytes() <= RING_BYTES else RING_MIN
        self._ring = [first] + [_new_stage(lay, pin) for _ in range(n_stages - 1)]
        self._ring_pos = 0
        self._cuda = pin
        #: recorded after the uploads of a lap's last stage, queried when the next lap starts (an
        #: event record is a slow driver call on a busy host, ~0.1 ms measured: once a lap, not a step)
        self._lap_event = None
        self.high_water = 0
        self.forwards = 0
        self.stage_waits = 0

    def fill(self, req_ids, num_scheduled_tokens: np.ndarray, n_padded: int | None = None,
             full_tokens: int | None = None) -> None:
        """Write ``tok_slot`` for this step's tokens (batch order) and upload new slot rows.

        ``req_ids``: batch-ordered request ids; ``num_scheduled_tokens``: int array, same order.
        ``n_padded``: the padded token count when known (V2), else padding relies on the
        invariant that ``tok_slot`` is zero beyond the last written non-null token.
        ``full_tokens``: the token count of the FULL CUDA graph the step replays, when known
        (V2), else None: a variant that did not capture that size gives way to the every-site
        one (:meth:`.variants.GraphVariants.full_variant`).

        Raises:
            RuntimeError: more tokens than the buffers hold, or no request slot left
            (:meth:`.slots.SlotRegistry.slot_for`)."""
        lay, reg, var = self.layout, self.slots, self.variants
        cond = lay.conditions
        self.forwards += 1
        if not reg.req_rows and self.high_water == 0 and not reg.pending_rows:
            var.set_variant(0)
            return  # fast path: no app on anywhere; tok_slot is all null already
        n_req = len(num_scheduled_tokens)
        ids = req_ids[:n_req]
        # per-request Python kept off the common path (every request with a row already has a slot)
        slots = np.fromiter(map(reg.req_slot.get, ids, repeat(NULL_SLOT)), dtype=np.int32, count=n_req)
        # slots exist only for requests with a row (req_slot keys are a subset of req_rows keys)
        if len(reg.req_slot) < len(reg.req_rows):  # some request with apps on has no slot yet
            for i in np.flatnonzero(slots == NULL_SLOT).tolist():
                slots[i] = reg.slot_for(ids[i])
        T = int(num_scheduled_tokens.sum())
        n_on = int(np.count_nonzero(slots))
        if not n_on:
            var.set_variant(0)
        else:
            if n_on == var.n_requests:  # every registered request is in this step: the cached union
                mask = var.variant_for(var.need_mask())
            else:  # some are not (waiting for a chunk, preempted): what this step's requests need
                mask = var.variant_for(var.need_of(ids[i] for i in np.flatnonzero(slots).tolist()))
            var.set_variant(var.full_variant(mask, full_tokens))
        any_on = n_on > 0
        if not any_on and self.high_water == 0 and not reg.pending_rows:
            return
        n = max(T, self.high_water)
        if n_padded is not None:
            n = max(n, min(n_padded, lay.max_tokens))
        if T > lay.max_tokens:
            raise RuntimeError(f"vllm_xmix: {T} tokens in a step > buffer size {lay.max_tokens}")
        stage = self._next_stage()
        tok = stage.tok_np
        tok[:T] = np.repeat(slots, num_scheduled_tokens[:n_req])
        tok[T:n] = NULL_SLOT
        lay.tok_slot[:n].copy_(stage.tok[:n], non_blocking=True)
        # written whenever fused entries exist, whatever fused_mode says: the first op call decides
        # fused_mode, and a compiled graph may still run after an eager forward came first
        if lay.fused_entries.size:
            fc = stage.fc_np
            if any_on:  # each token's row of its slot's coefficients (slot 0: zeros)
                np.take(reg.slot_fc, tok[:T], axis=0, out=fc[:T], mode="clip")
            else:
                fc[:T] = 0.0
            fc[T:n] = 0.0
            lay.tok_fc[:n].copy_(stage.fc[:n], non_blocking=True)
        row0 = None
        if cond.has_cond and var.needs_positions():  # absolute position of every token (0 for app-free tokens and padding)
            row0 = self._first_rows(num_scheduled_tokens[:n_req])
            starts = np.fromiter(map(reg.step_pos.get, ids, repeat(0)), dtype=np.int64, count=n_req)
            pos = stage.pos_np
            pos[:T] = np.repeat(starts - row0, num_scheduled_tokens[:n_req]) + np.arange(T)
            pos[:T][tok[:T] == NULL_SLOT] = 0
            pos[T:n] = 0
            cond.tok_pos[:n].copy_(stage.pos[:n], non_blocking=True)
        if reg.pending_rows:
            k = len(reg.pending_rows)
            if cond.has_token_cond:  # room for the prompt ids of the new slots, staged one after the other
                L = cond.hist.shape[1]
                buf = self._prompt_buffer(stage, sum(min(len(p), L) for *_, p in reg.pending_rows if p is not None))
                at = 0
            new_slots = [p[0] for p in reg.pending_rows]
            idx_h, rows_h, plen_h = stage.idx_np, stage.rows_np, stage.plen_np
            for i, (s, row, plen, prompt) in enumerate(reg.pending_rows):
                idx_h[i] = s
                rows_h[i] = row
                plen_h[i] = plen
                if prompt is not None and cond.has_token_cond:  # for a first chunk after a cache hit
                    m = min(len(prompt), L)
                    buf.numpy()[at: at + m] = prompt[:m]
                    cond.hist[s, :m].copy_(buf[at: at + m], non_blocking=True)
                    at += m
            reg.pending_rows.clear()
            if k <= _DIRECT_ROWS:  # the common case (a new request or two): one copy per row, no kernel
                for i, s in enumerate(new_slots):
                    lay.coef[s].copy_(stage.rows[i], non_blocking=True)
                    if cond.has_cond:
                        cond.slot_plen[s: s + 1].copy_(stage.plen[i: i + 1], non_blocking=True)
                cond.reset_latches(new_slots)
            else:
                rows = stage.rows[:k].to(lay.device, non_blocking=True)
                idx = stage.idx[:k].to(lay.device, non_blocking=True)
                lay.coef.index_copy_(0, idx, rows)
                if cond.has_cond:
                    cond.slot_plen.index_copy_(0, idx, stage.plen[:k].to(lay.device, non_blocking=True))
                cond.reset_latches(idx)
        if self._cuda and self._ring_pos == 0:  # this step used the lap's last stage
            if self._lap_event is None:
                self._lap_event = _new_event()
            self._lap_event.record()
        self.high_water = T if any_on else 0
        if reg.step_pos and reg.req_reads:
            rr, sp = reg.req_reads, reg.step_pos
            if row0 is None:
                row0 = self._first_rows(num_scheduled_tokens[:n_req])
            first, counts = row0.tolist(), num_scheduled_tokens[:n_req].tolist()  # (Python ints, once per step)
            self.reads.step_reads = [(r, first[i], counts[i], sp[r]) + rr[r]
                                     for i, r in enumerate(req_ids[:n_req]) if r in rr and r in sp]

    @staticmethod
    def _first_rows(counts: np.ndarray) -> np.ndarray:
        """The first row of each request in the step (``counts``: its tokens, batch order)."""
        row0 = np.zeros(len(counts), dtype=np.int64)
        np.cumsum(counts[:-1], out=row0[1:])
        return row0

    def dummy_forward(self) -> None:
        """Before a forward that does not go through :meth:`fill` (vLLM's dummy runs: profiling,
        warm-up, idle data-parallel ranks): no token belongs to any request, so the step's slot
        table is cleared (a dummy token must not write into a live request's slot) and, outside a
        variant capture, the step runs without the hook ops."""
        lay = self.layout
        if self.high_water:
            lay.tok_slot[: self.high_water].zero_()
            if lay.fused_entries.size:
                lay.tok_fc[: self.high_water].zero_()
            self.high_water = 0
        if not self.variants.capturing_variants:
            self.variants.set_variant(0)

    def _prompt_buffer(self, stage: _Stage, n: int) -> torch.Tensor:
        """The stage's pinned int32 staging buffer for prompt ids, holding at least ``n``; a
        larger one replaces it when needed (the stage's earlier copies have run: see
        :meth:`_next_stage`). Pinning memory is a slow driver call: never per request."""
        if stage.prompts.shape[0] < n:
            stage.prompts = torch.zeros(max(n, 2 * stage.prompts.shape[0]), dtype=torch.int32, device="cpu",
                                        pin_memory=self.layout.device.type == "cuda")
        return stage.prompts

    def _next_stage(self) -> _Stage:
        """This step's staging buffers (the ring's next). When a lap starts, the event recorded
        after the previous lap's last uploads must have completed: then every buffer's last copy
        has run. It always has (see :data:`RING`); if it ever has not, the fill waits for it
        (a host stall, counted in ``stage_waits`` and logged once)."""
        pos = self._ring_pos
        stage = self._ring[pos]
        self._ring_pos = (pos + 1) % len(self._ring)
        if pos == 0 and self._lap_event is not None and not self._lap_event.query():
            self.stage_waits += 1
            if self.stage_waits == 1:
                logger.warning("vllm_xmix: a step's slot-table upload waited for the uploads of %d steps earlier "
                               "(the host ran that far ahead of the GPU); counted in XmixState.stage_waits",
                               len(self._ring))
            self._lap_event.synchronize()
        return stage


def _new_event():
    """A CUDA event (timing off) for the lap check of :meth:`StepFill._next_stage`."""
    return torch.cuda.Event()
