"""Read transport: this step's read values from the device buffer ``out`` to the host, one
snapshot per forward that had a read on, split per request and position.

After the forward is enqueued, :meth:`ReadTransport.snapshot` copies the step's read rows out of
``out`` (which the next forward reuses) into pinned host memory, asynchronously on the forward's
stream; the model-runner patch attaches each snapshot to its step's ``ModelRunnerOutput`` as
``xmix_reads``, and :meth:`ReadTransport.reads_of` splits it per request when the output is
consumed (waiting only for that copy). Nothing here blocks the forward.
"""

from __future__ import annotations

import torch


#: pinned snapshot buffers kept for reuse (vLLM has one or two steps' outputs pending)
_POOL = 4


class ReadTransport:
    """Pending read snapshots of one model instance.

    ``step_reads``: what the step fill recorded for the current step, per request with a read
    on: ``(req_id, first row, n rows, first position, read infos, prompt length)``. On CUDA the
    snapshots go to pinned host buffers (with their events) that are reused once their values
    were split (:meth:`reads_of`): no pinned allocation and no event creation per step.

    ``keep``: whether this rank's step outputs reach the engine core. Under tensor (and
    pipeline) parallelism vLLM takes the ``ModelRunnerOutput`` of one worker only (TP rank 0 of
    the last stage) and drops the others'; a rank that does not keep its values takes no
    snapshot (no copy, no pinned buffer, nothing pending), so read values come back once per
    request, from that rank. Set by the model-runner patch."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out
        self.keep = True
        self.taken = 0  # snapshots taken since start (introspection)
        self.step_reads: list[tuple] = []
        self._snapshots: list = []
        self._free: list[tuple[torch.Tensor, object]] = []

    def _buffer(self, rows: int):
        """A pinned ``[>= rows, n_cols]`` buffer and its event: a free one that is large enough,
        else a new one (rows rounded up to a power of two, at least 64)."""
        for i, (host, event) in enumerate(self._free):
            if host.shape[0] >= rows:
                return self._free.pop(i)
        n = max(64, 1 << (rows - 1).bit_length())
        return (torch.empty((n,) + tuple(self.out.shape[1:]), dtype=self.out.dtype, device="cpu", pin_memory=True),
                torch.cuda.Event())

    def snapshot(self) -> None:
        """After the forward is enqueued: copy this step's read rows out of ``out`` to host
        memory, asynchronously on the forward's stream (no-op if no read was on, or if this
        rank's outputs are dropped: :attr:`keep`)."""
        if not self.step_reads:
            return
        if not self.keep:
            self.step_reads = []
            return
        self.taken += 1
        last = self.step_reads[-1]  # (in batch order: its rows end last)
        T = last[1] + last[2]
        src = self.out[:T]
        if src.is_cuda:
            buf, event = self._buffer(T)
            buf[:T].copy_(src, non_blocking=True)
            event.record()
        else:
            buf, event = src.clone(), None
        self._snapshots.append((buf, event, self.step_reads, T))
        self.step_reads = []

    def pop_snapshot(self):
        """The oldest pending snapshot (FIFO: one per forward that had a read on), or None."""
        return self._snapshots.pop(0) if self._snapshots else None

    def reads_of(self, snapshot) -> dict[str, list]:
        """A snapshot as ``{req_id: [chunk, ...]}`` (waits for its device-to-host copy; its
        buffer is then free for a later step's snapshot).

        A chunk is ``(app, name, layer, tag, pos0, n, width, float32 bytes [n, width])`` (``tag``:
        ``"probe"`` or the capture's ``positions``): the values of one read entry for positions
        ``pos0 .. pos0+n-1`` of the request, already restricted to the positions the read returns
        (captures with ``generated`` / ``last``)."""
        buf, event, rows, T = snapshot
        if event is not None:
            event.synchronize()
        vals = buf[:T].numpy()
        # a row's columns are contiguous: one position's values are a slice of the buffer's bytes
        # (a decode step's: no numpy slicing per request)
        flat, row_bytes, item = memoryview(vals).cast("B"), vals.strides[0], vals.itemsize
        out: dict[str, list] = {}
        for rid, r0, n, pos0, reads, P in rows:
            chunks = []
            for positions, col, width, tag, app, name, layer in reads:  # tag "probe": one float per position
                lo, hi = pos0, pos0 + n  # positions covered this step
                if positions == "generated":
                    lo = max(lo, P - 1)
                elif positions == "last":
                    lo, hi = max(lo, P - 1), min(hi, P)
                if hi <= lo:
                    continue
                if hi - lo == 1:
                    at = (r0 + lo - pos0) * row_bytes + col * item
                    data = flat[at: at + width * item].tobytes()
                else:
                    data = vals[r0 + lo - pos0: r0 + hi - pos0, col: col + width].tobytes()
                chunks.append((app, name, layer, tag, lo, hi - lo, width, data))
            out[rid] = chunks
        if event is not None and len(self._free) < _POOL:  # (the chunks hold copies of the values)
            self._free.append((buf, event))
        return out
