"""Probe-triggered actions (``read(...).on(op, threshold, action=...)``, :class:`..spec.model.Trigger`):
which deployed reads carry a trigger, and where a step's read values first cross its threshold.

Runs in the engine core, on the values each step already copied to the host (the read chunks of
``ReadTransport.reads_of``): the scheduler patch scans them when it takes the step's output, so
a ``stop`` ends the request after the step that computed the crossing value, with the token that
step sampled, and no synchronisation is added inside the forward.

A fired trigger is an event ``(app, read name, layer, action, position, value)``; the position
is absolute (the ``position``-th token of prompt + generated tokens, as in ``mi_results``).
A ``latch`` trigger is recorded here the same way; the writes it switches on are gated on the
device, in the forward (``runtime/conditions.py``, ``kernels/latch.py``), at the same position
(the same float32 values and comparison).
"""

from __future__ import annotations

import numpy as np

from ..spec import CONFIG_KEY

_COMPARE = {">": np.greater, ">=": np.greater_equal, "<": np.less, "<=": np.less_equal}


class TriggerTable:
    """The triggers of one deployment: ``(app, read name) -> (op, threshold, action)``.

    Built from the validated deployment dict (``additional_config["xmix"]``, as the plugin
    stores it at engine configuration), so no vector is loaded."""

    def __init__(self, by_read: dict[tuple[str, str], tuple[str, float, str]]):
        self.by_read = by_read

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "TriggerTable | None":
        """The table of the engine's deployment, or None if no read has a trigger."""
        add = getattr(vllm_config, "additional_config", None)
        raw = add.get(CONFIG_KEY) if isinstance(add, dict) else None
        by_read = {}
        for app in (raw or {}).get("apps", []):
            for op in app.get("ops", []):
                on = op.get("on") if op.get("primitive") == "read" else None
                if on:
                    by_read[(app["name"], op["name"])] = (on.get("op", ">"), float(on["threshold"]),
                                                          on.get("action", "flag"))
        return cls(by_read) if by_read else None

    def scan(self, chunks) -> list[tuple[str, str, int, str, int, float]]:
        """The first crossing in each chunk of a triggered read: ``(app, name, layer, action,
        position, value)`` per chunk that has one. ``chunks``: one request's read chunks of one
        step, ``(app, name, layer, tag, pos0, n, width, float32 bytes)``."""
        events = []
        for app, name, layer, tag, pos0, n, width, data in chunks:
            trig = self.by_read.get((app, name))
            if trig is None or tag != "probe":
                continue
            op, thr, action = trig
            vals = np.frombuffer(data, dtype=np.float32, count=int(n))
            hit = np.flatnonzero(_COMPARE[op](vals, np.float32(thr)))
            if hit.size:
                i = int(hit[0])
                events.append((app, name, int(layer), action, int(pos0) + i, float(vals[i])))
        return events

    def apps(self) -> set[str]:
        return {app for app, _ in self.by_read}


def stop_reason(app: str, name: str) -> str:
    """The ``stop_reason`` of a request ended by a ``stop`` trigger: ``"xmix:<app>.<read>"``."""
    return f"xmix:{app}.{name}"
