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


class ReadTransport:
    """Pending read snapshots of one model instance.

    ``step_reads``: what the step fill recorded for the current step, per request with a read
    on: ``(req_id, first row, n rows, first position, read infos, prompt length)``."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out
        self.step_reads: list[tuple] = []
        self._snapshots: list = []

    def snapshot(self) -> None:
        """After the forward is enqueued: copy this step's read rows out of ``out`` to host
        memory, asynchronously on the forward's stream (no-op if no read was on)."""
        if not self.step_reads:
            return
        T = max(sr[1] + sr[2] for sr in self.step_reads)
        src = self.out[:T]
        if src.is_cuda:
            host = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
            host.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = src.clone(), None
        self._snapshots.append((host, event, self.step_reads))
        self.step_reads = []

    def pop_snapshot(self):
        """The oldest pending snapshot (FIFO: one per forward that had a read on), or None."""
        return self._snapshots.pop(0) if self._snapshots else None

    @staticmethod
    def reads_of(snapshot) -> dict[str, list]:
        """A snapshot as ``{req_id: [chunk, ...]}`` (waits for its device-to-host copy).

        A chunk is ``(app, name, layer, tag, pos0, n, width, float32 bytes [n, width])`` (``tag``:
        ``"probe"`` or the capture's ``positions``): the values of one read entry for positions
        ``pos0 .. pos0+n-1`` of the request, already restricted to the positions the read returns
        (captures with ``generated`` / ``last``)."""
        host, event, rows = snapshot
        if event is not None:
            event.synchronize()
        vals = host.numpy()
        out: dict[str, list] = {}
        for rid, r0, n, pos0, reads, P in rows:
            chunks = out.setdefault(rid, [])
            for positions, col, width, tag, app, name, layer in reads:  # tag "probe": one float per position
                lo, hi = pos0, pos0 + n  # positions covered this step
                if positions == "generated":
                    lo = max(lo, P - 1)
                elif positions == "last":
                    lo, hi = max(lo, P - 1), min(hi, P)
                if hi <= lo:
                    continue
                block = vals[r0 + lo - pos0: r0 + hi - pos0, col: col + width]
                chunks.append((app, name, layer, tag, lo, hi - lo, width, block.tobytes()))
        return out
